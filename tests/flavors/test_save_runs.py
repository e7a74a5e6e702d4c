"""How often a save runs the model: once for the reference, then the padded batches of
the row proof, each distinct batch once; a decode loop is proven on one padded batch. The model
is the real loaded ``JaxExpModel`` (its jitted calls counted by a delegating wrapper) and XLA's
own compile events (``jax.monitoring``). The read-back still refuses a blob or a params file
that differs from what was given, on every path."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import mlflow
import numpy as np
import pytest
import yaml

import jaxexp_mlflow  # noqa: F401  (installs mlflow.jaxexp)
from jaxexp_mlflow.errors import ArtifactError, JaxExpError
from jaxexp_mlflow.params import orbax_io
from jaxexp_mlflow.params import restore as params_restore
from jaxexp_mlflow.runtime import rows
from jaxexp_mlflow.runtime.model import JaxExpModel
from jaxexp_mlflow.store import artifact
from tests.conftest import llm_example
from tests.models import batch, mlp_apply, mlp_params

REPO = Path(__file__).resolve().parents[2]


def _llm() -> object:
    return llm_example()


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """Every run of a loaded model (its two jitted entry points, the real ones called through)
    with the batch size it ran at; every XLA compile of the model's call (a fresh compilation
    cache: no compile is skipped as a hit)."""
    monkeypatch.setenv("JAXEXP_COMPILATION_CACHE", str(tmp_path / "xla-cache"))
    seen: dict[str, list] = {"runs": [], "compiles": [], "restores": 0, "with_params": []}
    call, call_with = JaxExpModel.__call__, JaxExpModel.call_with_params
    restore = params_restore.restore_params

    def counting_call(self, *inputs, **kw):
        seen["runs"].append(int(jax.tree.leaves(inputs)[0].shape[0]))
        return call(self, *inputs, **kw)

    def counting_call_with(self, params, *inputs, **kw):
        seen["runs"].append(int(jax.tree.leaves(inputs)[0].shape[0]))
        seen["with_params"].append(int(jax.tree.leaves(inputs)[0].shape[0]))
        return call_with(self, params, *inputs, **kw)

    def counting_restore(*a, **k):
        seen["restores"] += 1
        return restore(*a, **k)

    def on_event(event: str, duration: float, **kw: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration" and "_raw_call" in str(
            kw.get("fun_name")
        ):
            seen["compiles"].append(event)

    monkeypatch.setattr(JaxExpModel, "__call__", counting_call)
    monkeypatch.setattr(JaxExpModel, "call_with_params", counting_call_with)
    monkeypatch.setattr(params_restore, "restore_params", counting_restore)
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)


def _padding(path: Path) -> dict:
    return yaml.safe_load((path / "MLmodel").read_text())["flavors"]["jaxexp"]["padding"]


def test_a_save_runs_the_model_once_then_each_distinct_padded_batch(tmp_path, counted):
    """One row: the ``last``, ``first`` and ``reversed`` fillers all repeat it, one padded run
    stands for the three; ``zeros`` is the other. Three rows: four distinct padded batches.
    Params proven from memory are bound, never restored a second time."""
    params = mlp_params()
    k1, k3 = rows.fill_count(1), rows.fill_count(3)
    mlflow.jaxexp.save_model(
        jax.jit(mlp_apply), tmp_path / "one", params=params, input_example=batch(1)
    )
    assert counted["runs"] == [1, 1 + k1, 1 + k1]  # was 1 + 1 (restored vs given) + 4
    assert len(counted["compiles"]) == 2  # the example's batch size and the padded one
    assert counted["restores"] == 0
    # the reference ran through the model's own call, as load_model's model runs (the
    # executable runtime.cpu_compile chose), not through call_with_params
    assert counted["with_params"] == []
    padding = _padding(tmp_path / "one")
    assert padding["rows_independent"] is True
    assert "2 identical padded batches run once" in padding["proof"]
    counted["runs"].clear()
    mlflow.jaxexp.save_model(
        jax.jit(mlp_apply), tmp_path / "three", params=params, input_example=batch(3)
    )
    assert counted["runs"] == [3] + [3 + k3] * len(rows.FILLERS)
    assert counted["restores"] == 0
    model = mlflow.jaxexp.load_model(str(tmp_path / "three"))
    np.testing.assert_allclose(model(batch(5)), mlp_apply(params, batch(5)), rtol=1e-6)


def test_a_decode_loop_runs_twice_per_save(tmp_path, counted):
    """examples/llm.py's ``generate`` (a ``fori_loop``): the reference run, then one padded
    batch of zeros rows; the proof still holds the tokens exact, and pyfunc pads with it."""
    llm = _llm()
    cfg = llm.CONFIGS["tiny"]
    params = llm.init_params(cfg, jax.random.key(0))
    ids = llm.prompt(cfg, batch=2)
    fn = jax.jit(lambda p, x: llm.generate(p, x, max_new_tokens=4))
    mlflow.jaxexp.save_model(fn, tmp_path / "m", params=params, input_example=ids)
    assert counted["runs"] == [2, 2 + rows.fill_count(2)]
    assert len(counted["compiles"]) == 2
    assert counted["restores"] == 0
    padding = _padding(tmp_path / "m")
    assert padding["rows_independent"] is True and "(zeros)" in padding["proof"]
    want = np.asarray(fn(params, llm.prompt(cfg, batch=3, seed=3)))
    pyfunc = mlflow.pyfunc.load_model(str(tmp_path / "m"))
    assert np.array_equal(np.asarray(pyfunc.predict(llm.prompt(cfg, batch=3, seed=3))), want)


def test_a_loop_that_mixes_rows_is_not_proven_by_its_one_padded_batch(tmp_path):
    """A loop whose every step adds the batch mean: the zeros rows change the real rows."""

    def fn(p, x):
        return jax.lax.fori_loop(0, 3, lambda i, h: jax.numpy.tanh(h @ p["w"] + h.mean(0)), x)

    params = {"w": np.eye(4, dtype=np.float32) * 0.5}
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32) + 3.0
    mlflow.jaxexp.save_model(jax.jit(fn), tmp_path / "m", params=params, input_example=x)
    padding = _padding(tmp_path / "m")
    assert padding["rows_independent"] is False
    assert "changes when the batch is padded" in padding["proof"]


def flip_middle_byte(path: Path, mask: int) -> None:
    """XOR the middle byte of the file at ``path`` with ``mask`` (damage on disk)."""
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= mask
    path.write_bytes(bytes(raw))


def test_the_read_back_refuses_a_damaged_blob(tmp_path, monkeypatch):
    """A byte of ``exported.bin`` flipped after it was written: refused, nothing published."""
    real = artifact.write_blob

    def write_then_damage(path, data):
        real(path, data)
        flip_middle_byte(Path(path, artifact.EXPORTED_FILE), 0x01)

    monkeypatch.setattr(artifact, "write_blob", write_then_damage)
    target = tmp_path / "m"
    with pytest.raises(JaxExpError, match="does not load back"):
        mlflow.jaxexp.save_model(
            jax.jit(mlp_apply), target, params=mlp_params(), input_example=batch(2)
        )
    assert not target.exists()
    assert not [p for p in tmp_path.iterdir() if ".jaxexp-tmp-" in p.name]


def test_compressed_params_are_still_restored_and_compared(tmp_path, counted, monkeypatch):
    """zstd chunk files are checksummed from disk, not from memory: the read-back restores them
    and runs restored and given params (two runs at the example's size); a chunk damaged while
    Orbax writes is refused."""
    params = mlp_params()
    mlflow.jaxexp.save_model(
        jax.jit(mlp_apply),
        tmp_path / "z",
        params=params,
        input_example=batch(3),
        compression="zstd",
    )
    assert counted["restores"] == 1
    assert counted["runs"][:2] == [3, 3]  # restored, then given: they must agree
    assert counted["with_params"] == [3, 3]  # both through one executable
    real_save = orbax_io.save

    def save_then_damage(tree, path, **kw):
        real_save(tree, path, **kw)
        chunk = next(
            p
            for p in (Path(path) / "w1").rglob("*")
            if p.is_file() and not p.name.startswith(".") and p.suffix != ".json"
        )
        flip_middle_byte(chunk, 0xFF)

    monkeypatch.setattr(orbax_io, "save", save_then_damage)
    target = tmp_path / "damaged"
    with pytest.raises(ArtifactError, match="do not reproduce the outputs|does not load back"):
        mlflow.jaxexp.save_model(
            jax.jit(mlp_apply), target, params=params, input_example=batch(3), compression="zstd"
        )
    assert not target.exists()


def test_buckets_off_at_save_runs_no_padded_batch(tmp_path, counted):
    """``serving_config={"buckets": "off"}``: nothing will be padded, so no row proof runs (the
    record says so, and a load that turns buckets on still calls each batch at its own size)."""
    params = mlp_params()
    path = tmp_path / "m"
    mlflow.jaxexp.save_model(
        jax.jit(mlp_apply),
        path,
        params=params,
        input_example=batch(3),
        serving_config={"buckets": "off"},
    )
    assert counted["runs"] == [3] and len(counted["compiles"]) == 1
    assert _padding(path) == {
        "rows_independent": False,
        "proof": "not run: saved with serving_config buckets off",
    }
    pyfunc = mlflow.pyfunc.load_model(str(path), model_config={"buckets": [1, 8]})
    assert not pyfunc._model_impl._bucketed  # not proven: each batch at its own size
    np.testing.assert_allclose(pyfunc.predict(batch(5)), mlp_apply(params, batch(5)), rtol=1e-6)


def test_the_proof_runs_each_distinct_padded_batch_once():
    """On a plain function: a one-row batch meets two distinct padded batches of the four
    kinds; one kind runs once; an unknown kind is the caller's error."""
    seen = []

    def call(leaves):
        seen.append(leaves[0].copy())
        return [np.tanh(leaves[0])]

    x = np.arange(1, 5, dtype=np.float32).reshape(1, 4)
    record = rows.prove(call, [x], source="t", exact=[np.tanh(x)])
    assert record["rows_independent"] is True and len(seen) == 2
    assert {tuple(b[-1]) for b in seen} == {tuple(x[0]), (0.0, 0.0, 0.0, 0.0)}
    seen.clear()
    assert rows.prove(call, [x], source="t", exact=[np.tanh(x)], fillers=("zeros",))[
        "rows_independent"
    ]
    assert len(seen) == 1 and not seen[0][1:].any()
    mixing = rows.prove(
        lambda ls: [ls[0] - ls[0].mean(0)], [x], source="t", exact=[x - x], fillers=("zeros",)
    )
    assert mixing["rows_independent"] is False
    with pytest.raises(ValueError, match="fillers"):
        rows.prove(call, [x], source="t", fillers=("ones",))


CHILD = """
import sys, jax, mlflow, numpy as np, jaxexp_mlflow
from tests.models import batch
events = []
jax.monitoring.register_event_listener(lambda event, **kw: events.append(event))
model = mlflow.jaxexp.load_model(sys.argv[1])
x = jax.device_put(batch(3))
events.clear()  # the load's own small helpers compile apart: the model's first call alone
model(x)
print(events.count("/jax/compilation_cache/cache_hits"),
      events.count("/jax/compilation_cache/cache_misses"))
"""


def test_a_save_fills_the_compilation_cache_a_later_save_and_load_read(tmp_path, monkeypatch):
    """The read-back compiles into the persistent cache as load_model does, with the params
    committed as a restore commits them: a second save of the same function compiles nothing,
    and a fresh process' load_model runs the example's shape from the cache."""
    import os
    import subprocess

    monkeypatch.setenv("JAXEXP_COMPILATION_CACHE", str(tmp_path / "xla"))
    events: list[str] = []

    def on_event(event: str, **kw: object) -> None:
        events.append(event)

    jax.monitoring.register_event_listener(on_event)
    try:
        params = mlp_params()
        for name in ("first", "second"):
            events.clear()
            mlflow.jaxexp.save_model(
                jax.jit(mlp_apply), tmp_path / name, params=params, input_example=batch(3)
            )
            if name == "first":
                assert events.count("/jax/compilation_cache/cache_hits") == 0
        assert events.count("/jax/compilation_cache/cache_hits") == 2  # reference + padded
        assert events.count("/jax/compilation_cache/cache_misses") == 0
    finally:
        jax.monitoring.unregister_event_listener(on_event)
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "first")],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["1", "0"]  # one hit, no miss
