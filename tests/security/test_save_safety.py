"""Saving never publishes a model that cannot load, nor half a model."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import mlflow
import numpy as np
import pytest
from mlflow.exceptions import MlflowException

import jaxexp_mlflow  # noqa: F401  (installs mlflow.jaxexp)
from jaxexp_mlflow.errors import IncompatibleError, JaxExpError, ParamsMismatchError
from jaxexp_mlflow.flavors import readback
from jaxexp_mlflow.store.atomic import TMP_MARKER
from tests.models import batch, export_mlp, mlp_apply, mlp_params

REPO = Path(__file__).resolve().parents[2]


def _debris(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if TMP_MARKER in p.name)


def _save_or_refuse(fn, params, x, path: Path) -> None:
    """Either a typed error and nothing at ``path``, or a model that reproduces ``fn``."""
    try:
        mlflow.jaxexp.save_model(jax.jit(fn), path, params=params, input_example=x)
    except JaxExpError:
        assert not path.exists() and not _debris(path.parent)
        return
    model = mlflow.jaxexp.load_model(str(path))
    np.testing.assert_allclose(model(x), fn(params, x), rtol=1e-6)


def test_failures_leave_no_directory_and_a_resave_works(tmp_path):
    params, path = mlp_params(), tmp_path / "m"
    exp = export_mlp(params)
    zero = dict(params, b2=jnp.zeros((0,)))  # Orbax cannot store it: fails after code/ is copied
    with pytest.raises(ParamsMismatchError):
        mlflow.jaxexp.save_model(exp, path, params=zero)
    with pytest.raises(MlflowException, match="YAML|represent|serializ"):  # fails at MLmodel
        mlflow.jaxexp.save_model(exp, path, params=params, metadata={"bad": object()})
    assert not path.exists() and not _debris(tmp_path)
    mlflow.jaxexp.save_model(exp, path, params=params, input_example=batch(2))
    assert {"MLmodel", "exported.bin", "params", "reference"} <= {p.name for p in path.iterdir()}
    # a second save to the same path is refused and leaves the first model untouched
    before = sorted((p.relative_to(path), p.stat().st_mtime_ns) for p in path.rglob("*"))
    with pytest.raises(MlflowException, match="already exists"):
        mlflow.jaxexp.save_model(exp, path, params=params)
    assert sorted((p.relative_to(path), p.stat().st_mtime_ns) for p in path.rglob("*")) == before
    assert not _debris(tmp_path)


def test_failure_into_an_existing_empty_directory_leaves_it_empty(tmp_path):
    path = tmp_path / "empty"
    path.mkdir()
    case = REPO.parent / "shared/corpus/jax-0.4.35/linalg"
    if not case.is_dir() or jax.__version__ != "0.10.2":
        pytest.skip("needs the corpus and jax 0.10.2 (whose jaxlib lacks the 0.4.35 kernels)")
    from tests.conftest import load_case

    _, inputs, _ = load_case(case)
    with pytest.raises(IncompatibleError):
        mlflow.jaxexp.save_model(
            (case / "exported.bin").read_bytes(), path, input_example=tuple(inputs)
        )
    assert path.is_dir() and not any(path.iterdir()) and not _debris(tmp_path)


def test_colliding_key_paths_never_publish_wrong_weights(tmp_path):
    def fn(p, x):
        return x * p["a.b"] + p["a"]["b"]

    params = {"a.b": jnp.full((3,), 2.0), "a": {"b": jnp.full((3,), 5.0)}}
    _save_or_refuse(fn, params, np.ones((2, 3), np.float32), tmp_path / "m")


def test_typed_prng_key_params_never_publish_an_unloadable_model(tmp_path):
    def fn(p, x):
        return x + jax.random.uniform(p["key"], x.shape)

    _save_or_refuse(fn, {"key": jax.random.key(0)}, np.ones((2, 3), np.float32), tmp_path / "m")


def test_reference_is_computed_from_the_params_as_stored(tmp_path):
    params, x = mlp_params(), batch(3)
    np_params = jax.tree.map(np.asarray, params)  # numpy leaves take the zero-copy path
    path = tmp_path / "m"
    mlflow.jaxexp.save_model(export_mlp(params), path, params=np_params, input_example=x)
    assert readback.LAST_TIMINGS["load"] > 0 and readback.LAST_TIMINGS["run"] > 0
    with np.load(path / "reference" / "outputs.npz") as ref:
        np.testing.assert_allclose(ref["out_0"], mlp_apply(params, x), rtol=1e-6)


def _race(seed: int, root: Path, n: int, other_alive=lambda: True) -> dict:
    """Save the seed's model to ``root/m0`` .. ``m{n-1}`` once the other racer is ready too;
    which saves this process won, and how each lost one ended. Runs in this process and, as
    its own source, in a child: two processes saving to one path."""
    import time

    import mlflow

    from jaxexp_mlflow.errors import SaveConflictError  # the package installs mlflow.jaxexp
    from tests.models import batch, export_mlp, mlp_params

    params = mlp_params(seed=seed)
    exp = export_mlp(params)
    (root / f"ready-{seed}").touch()
    while len(list(root.glob("ready-*"))) < 2:  # start together
        assert other_alive(), "the other racer ended before it was ready"
        time.sleep(0.005)
    won, lost = [], []
    for i in range(n):
        try:
            mlflow.jaxexp.save_model(
                exp, root / f"m{i}", params=params, input_example=batch(2), include_package=False
            )
            won.append(i)
        except SaveConflictError:  # both wrote a whole model, the other renamed first
            lost.append("conflict")
        except mlflow.exceptions.MlflowException as e:  # the other one was already there
            assert "already exists" in e.message, e.message
            lost.append("exists")
    return {"seed": seed, "won": won, "lost": lost}


WORKER = (
    "import json, sys\n"
    "from pathlib import Path\n"
    + inspect.getsource(_race)
    + "seed, root, n = int(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])\n"
    + "print('RESULT ' + json.dumps(_race(seed, root, n)))\n"
)


def test_two_processes_saving_to_one_path_leave_one_complete_model(tmp_path):
    n = 3
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    # the other process: a child racing this one (seed 20 here, 10 there)
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, "10", str(tmp_path), str(n)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )
    try:
        here = _race(20, tmp_path, n, other_alive=lambda: proc.poll() is None)
    finally:
        out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")][-1]
    results = {}
    for res in (json.loads(line[len("RESULT ") :]), here):
        results[res["seed"]] = set(res["won"])
        print(res)  # how each lost race ended (conflict at rename / path already taken)
    assert not _debris(tmp_path)
    x = batch(3)
    for i in range(n):
        winners = [seed for seed, won in results.items() if i in won]
        assert len(winners) == 1, (i, results)
        model = mlflow.jaxexp.load_model(str(tmp_path / f"m{i}"))
        # the weights are the winner's, and so is the stored reference result
        want = mlp_apply(mlp_params(seed=winners[0]), x)
        np.testing.assert_allclose(model(x), want, rtol=1e-5, atol=1e-6)
        with np.load(tmp_path / f"m{i}" / "reference" / "outputs.npz") as ref:
            np.testing.assert_allclose(
                ref["out_0"], mlp_apply(mlp_params(seed=winners[0]), batch(2)), rtol=1e-5
            )


def test_failed_log_model_registers_no_version(tracking_uri):
    params = mlp_params()
    client = mlflow.MlflowClient()
    with mlflow.start_run(), pytest.raises(ParamsMismatchError):
        mlflow.jaxexp.log_model(
            export_mlp(params),
            name="m",
            params=dict(params, b2=jnp.zeros((0,))),
            registered_model_name="never",
        )
    assert client.search_model_versions("name='never'") == []
    (logged,) = mlflow.search_logged_models(output_format="list")
    assert logged.status.to_proto() != 0 and str(logged.status).endswith("FAILED")


def test_big_params_are_checked_on_disk_not_restored_twice(tmp_path, monkeypatch):
    """Above the read-back's restore limit the checkpoint is verified whole, not re-read; below
    it too when every array file's checksum was taken from the params in memory (the default
    save: the verified files are the params given, tests/flavors/test_save_runs.py has the
    other)."""
    from jaxexp_mlflow.params import restore as params_codec

    calls = {"restore": 0, "verify": 0}
    restore, verify = params_codec.restore_params, params_codec.verify_manifest

    def counting_restore(*a, **k):
        calls["restore"] += 1
        return restore(*a, **k)

    def counting_verify(*a, **k):
        calls["verify"] += 1
        return verify(*a, **k)

    monkeypatch.setattr(params_codec, "restore_params", counting_restore)
    monkeypatch.setattr(params_codec, "verify_manifest", counting_verify)
    params = mlp_params()
    monkeypatch.setenv("JAXEXP_READBACK_RESTORE_MAX_BYTES", "0")
    mlflow.jaxexp.save_model(
        jax.jit(mlp_apply), tmp_path / "big", params=params, input_example=batch(2)
    )
    assert calls == {"restore": 0, "verify": 1}
    monkeypatch.delenv("JAXEXP_READBACK_RESTORE_MAX_BYTES")
    mlflow.jaxexp.save_model(
        jax.jit(mlp_apply), tmp_path / "small", params=params, input_example=batch(2)
    )
    assert calls == {"restore": 0, "verify": 2}
    for name in ("big", "small"):
        model = mlflow.jaxexp.load_model(str(tmp_path / name))
        np.testing.assert_allclose(model(batch(3)), mlp_apply(params, batch(3)), rtol=1e-6)
