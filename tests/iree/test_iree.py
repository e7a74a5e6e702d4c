"""The IREE backend: archived models run without importing JAX.

Skipped where the ``iree`` extra is not installed (the oldest-jax environment). Every test
shares the session's ``.vmfb`` cache (``JAXEXP_IREE_CACHE``, set in conftest), so each module
is compiled once per session.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("iree.runtime")
pytest.importorskip("iree.compiler")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from click.testing import CliRunner  # noqa: E402

import jaxexp_mlflow.flavors.jaxexp as flavor  # noqa: E402
from jaxexp_mlflow.archive.reproduce import compare_outputs  # noqa: E402
from jaxexp_mlflow.cli import main as cli_main  # noqa: E402
from jaxexp_mlflow.codec import blob, reader  # noqa: E402
from jaxexp_mlflow.errors import IncompatibleError, InputError  # noqa: E402
from jaxexp_mlflow.iree import compiler, loader, shapes  # noqa: E402
from jaxexp_mlflow.iree import model as iree_model  # noqa: E402
from tests import models  # noqa: E402
from tests.conftest import REPO, case_id, corpus_cases, load_case, result_of  # noqa: E402

RUNNABLE = [
    c
    for c in corpus_cases()
    if (lambda d: d.nr_devices == 1 and not set(d.custom_call_targets or ()) - {"shape_assertion"})(
        reader.read_blob((c / "exported.bin").read_bytes())
    )
]
REFUSED = [c for c in corpus_cases() if c not in RUNNABLE]


@pytest.fixture(scope="module")
def corpus_compiled():
    """Compile the runnable corpus modules into the session cache, two at a time, as the CLI's
    bare-blob load does (with the batch-1 function where the blob has one)."""

    def compile_blob(case):
        data = (case / "exported.bin").read_bytes()
        description = blob.describe(data, source=str(case))
        platform = loader.platform_index(description.platforms)
        entry = iree_model.batch1_entry(description, 0, platform)
        return compiler.compiled(reader.read_module(data), entry=entry)

    with ThreadPoolExecutor(2) as pool:  # iree-compile runs as a subprocess
        list(pool.map(compile_blob, RUNNABLE))
    return True


@pytest.fixture(scope="module")
def mlp_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("iree") / "mlp"
    flavor.save_model(
        jax.jit(models.mlp_apply), path, params=models.mlp_params(), input_example=models.batch()
    )
    return path


def test_corpus_covers_every_jax_version():
    versions = {c.parent.name for c in RUNNABLE}
    assert versions == {"jax-0.4.35", "jax-0.6.2", "jax-0.8.3", "jax-0.10.2"}, versions
    assert len(RUNNABLE) >= 24


@pytest.mark.parametrize("case", RUNNABLE, ids=case_id)
def test_corpus_blob_reproduces_through_cli_backend_iree(case, corpus_compiled, tmp_path):
    """`jaxexp predict BLOB --backend iree` reproduces the outputs the exporter stored."""
    meta, inputs, outputs = load_case(case)
    out = tmp_path / "out.npz"
    result = CliRunner().invoke(
        cli_main,
        ["predict", str(case / "exported.bin"), "--input", str(case / "inputs.npz"),
         "--output", str(out), "--backend", "iree"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    from jaxexp_mlflow.codec.arrays import load_arrays

    got = load_arrays(out, [o["dtype"] for o in meta["outputs"]], "out")
    checks = compare_outputs(got, outputs)
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]
    assert [g.dtype for g in got] == [w.dtype for w in outputs]


@pytest.mark.parametrize("case", REFUSED, ids=case_id)
def test_corpus_refusals_name_the_reason(case):
    data = (case / "exported.bin").read_bytes()
    with pytest.raises(IncompatibleError) as err:
        loader.build(data, {}, source=str(case))
    expected = "iree_devices" if case.name == "sharded4" else "iree_custom_calls"
    assert expected in str(err.value), str(err.value)


FRESH_PROCESS = r"""
import json, sys, time
import numpy as np
import mlflow
path = sys.argv[1]
model = mlflow.jaxexp.load_model(path, backend="iree")
x = np.load(path + "/reference/inputs.npz")["in_0"]
want = np.load(path + "/reference/outputs.npz")["out_0"]
err = float(np.abs(model(x) - want).max())
pf = mlflow.pyfunc.load_model(path, model_config={"backend": "iree"})
err_pf = float(np.abs(pf.predict(x) - want).max())
try:
    model(x[:0])
    empty = "accepted"
except Exception as e:
    empty = type(e).__name__
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "orbax"))
print("RESULT " + json.dumps({"err": err, "err_pf": err_pf, "empty": empty, "loaded": loaded,
      "compiler": "iree.compiler" in sys.modules}))
"""


def test_fresh_process_never_imports_jax(mlp_dir):
    """load_model(backend="iree") and pyfunc's backend key run without importing JAX; with the
    modules in the cache (batch 1 and the bucket of the batch it is called with: the model goes
    per batch size, its rows being proven independent), not even the IREE compiler is imported."""
    warm = flavor.load_model(str(mlp_dir), backend="iree")  # fills the session cache
    warm(np.load(mlp_dir / "reference" / "inputs.npz")["in_0"])  # and the batch's bucket
    proc = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS, str(mlp_dir)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
    )
    result = result_of(proc)
    assert result["loaded"] == [], result["loaded"]
    assert result["compiler"] is False
    assert result["err"] < 1e-5 and result["err_pf"] < 1e-5
    assert result["empty"] == "InputError"  # IREE drops shape_assertion: checked before the call


def test_verify_backend_iree_reproduces_the_reference(mlp_dir):
    result = CliRunner().invoke(cli_main, ["verify", str(mlp_dir), "--backend", "iree", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["ok"] and report["environment"]["iree_runtime_version"].startswith("3.13")


def test_sdy_module_is_prepared_at_save_and_runs(tmp_path):
    """A single-device export with shardings carries sdy; save stores a stripped module beside
    the untouched blob, and the exporter's shape constraint is checked before the call."""
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    fn = jax.jit(lambda a: jnp.sin(a) * 2, in_shardings=sharding, out_shardings=sharding)
    (b,) = jax.export.symbolic_shape("b", constraints=["b >= 2"])
    exp = jax.export.export(fn)(jax.ShapeDtypeStruct((b,), jnp.float32))
    data = exp.serialize()
    flavor.save_model(data, tmp_path / "m")
    assert (tmp_path / "m" / "exported.bin").read_bytes() == data
    with pytest.raises(IncompatibleError, match="iree_sdy"):
        loader.build(data, {}, source="bare")  # without the preparation
    model = flavor.load_model(str(tmp_path / "m"), backend="iree")
    assert model.metadata["iree"]["changes"] == ["sdy stripped"]
    x = np.linspace(0, 1, 5, dtype=np.float32)
    np.testing.assert_allclose(model(x), np.asarray(exp.call(x)), rtol=1e-6)
    with pytest.raises(InputError, match="b >= 2"):
        model(x[:1])


def test_float64_is_kept():
    with jax.enable_x64(True):
        exp = jax.export.export(jax.jit(lambda x: x * (1 + 1e-12)))(
            jax.ShapeDtypeStruct((3,), jnp.float64)
        )
        data = exp.serialize()
    model = loader.build(data, {}, source="f64")
    y = model(np.ones(3))
    assert y.dtype == np.float64 and y[0] != 1.0  # demoted to f32, 1 + 1e-12 would be 1.0


def test_compressed_params_are_refused_with_the_reason(tmp_path):
    flavor.save_model(
        jax.jit(models.mlp_apply),
        tmp_path / "z",
        params=models.mlp_params(),
        input_example=models.batch(),
        compression="zstd",
    )
    with pytest.raises(IncompatibleError, match="compression=None"):
        flavor.load_model(str(tmp_path / "z"), backend="iree")


def test_tampered_prepared_module_is_refused(tmp_path, mlp_dir):
    import shutil

    import yaml

    from jaxexp_mlflow.errors import ArtifactError

    path = tmp_path / "m"
    shutil.copytree(mlp_dir, path)
    mlmodel = yaml.safe_load((path / "MLmodel").read_text())
    mlmodel["flavors"]["jaxexp"]["iree"]["module"] = "../../etc/passwd"
    mlmodel["flavors"]["jaxexp"]["iree"]["module_sha256"] = "0" * 64
    (path / "MLmodel").write_text(yaml.safe_dump(mlmodel))
    with pytest.raises(ArtifactError, match="expected a path inside the model directory"):
        flavor.load_model(str(path), backend="iree")


@pytest.mark.parametrize(
    ("avals", "shapes_", "constraints", "problem"),
    [
        (["float32[b,8]"], [(3, 8)], [], None),
        (["float32[b,8]", "float32[b]"], [(3, 8), (4,)], [], "is 3 elsewhere"),
        (["float32[b,8]"], [(0, 8)], [], "expected >= 1"),
        (["float32[b,8]"], [(3, 7)], [], "expected size 8"),
        (["float32[2*b]", "float32[b]"], [(6,), (3,)], [], None),
        (["float32[2*b]"], [(5,)], [], "cannot solve"),
        (["float32[b + 1]", "float32[b]"], [(4,), (3,)], ["b <= 2"], "b <= 2"),
        (["float32[floordiv(n, 2)]", "float32[n]"], [(3,), (6,)], [], None),
        (["float32[b,8]"], [(3,)], [], "wrong rank"),
    ],
)
def test_shape_checks_match_jax_assertions(avals, shapes_, constraints, problem):
    parsed = [shapes.Aval.parse(a) for a in avals]
    names = [f"in{i}" for i in range(len(avals))]
    if problem is None:
        shapes.bind_dims(parsed, shapes_, names, constraints)
    else:
        with pytest.raises(InputError, match=problem):
            shapes.bind_dims(parsed, shapes_, names, constraints)


def test_dynamic_broadcasts_are_made_explicit_at_save(tmp_path):
    """log_softmax over a symbolic batch lowers to chained dynamic_broadcast_in_dim ops, which
    IREE cannot compile as exported; the prepared module compiles once and serves any batch."""
    (b,) = jax.export.symbolic_shape("b")
    exp = jax.export.export(jax.jit(jax.nn.log_softmax))(jax.ShapeDtypeStruct((b, 8), jnp.float32))
    data = exp.serialize()
    with pytest.raises(IncompatibleError, match="dynamic_broadcast_in_dim"):
        loader.build(data, {}, source="bare")
    flavor.save_model(data, tmp_path / "m")
    model = flavor.load_model(str(tmp_path / "m"), backend="iree")
    assert model.metadata["iree"]["changes"] == ["dynamic broadcasts made explicit"]
    for n in (1, 7):
        x = np.random.default_rng(n).standard_normal((n, 8)).astype(np.float32)
        np.testing.assert_allclose(model(x), np.asarray(exp.call(x)), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_mlflow_models_serve_with_backend_iree_maps_no_jaxlib(mlp_dir, tmp_path):
    """`mlflow models serve` with the pyfunc key backend=iree answers over HTTP, and no process
    of the server has jaxlib mapped."""
    import psutil
    import requests

    from tests.servers import server_env, start_server, stop_server

    env = server_env(tmp_path)
    env["MLFLOW_PYFUNC_INFERENCE_CONFIG"] = json.dumps({"backend": "iree"})
    proc, url = start_server(str(mlp_dir), "local", env, tmp_path / "server.log")
    try:
        x = np.load(mlp_dir / "reference" / "inputs.npz")["in_0"]
        want = np.load(mlp_dir / "reference" / "outputs.npz")["out_0"]
        resp = requests.post(f"{url}/invocations", json={"inputs": x.tolist()}, timeout=60)
        assert resp.status_code == 200, resp.text
        np.testing.assert_allclose(np.asarray(resp.json()["predictions"]), want, atol=1e-5)
        bad = requests.post(f"{url}/invocations", json={"inputs": x[:, :3].tolist()}, timeout=60)
        assert bad.status_code == 400
        server = psutil.Process(proc.pid)
        mapped = {
            m.path for p in (server, *server.children(recursive=True)) for m in p.memory_maps()
        }
        assert any("iree" in m for m in mapped)
        assert not any("jaxlib" in m for m in mapped), sorted(m for m in mapped if "jaxlib" in m)
    finally:
        stop_server(proc)


def test_batch1_function_is_compiled_in_and_agrees(mlp_dir, monkeypatch):
    """A model with one dimension variable compiled as one module (JAXEXP_IREE_STATIC=0) gets a
    static batch-1 function beside ``main`` (``model.batch1_entry``): batch-1 calls go to it,
    others to ``main``; both agree with JAX."""
    import yaml

    monkeypatch.setenv("JAXEXP_IREE_STATIC", "0")
    meta = yaml.safe_load((mlp_dir / "MLmodel").read_text())["flavors"]["jaxexp"]
    model = loader.load_directory(mlp_dir, meta)
    assert model._batch1 is not None
    x = np.asarray(models.batch(), np.float32)
    expected = np.asarray(flavor.load_model(str(mlp_dir))(x))
    np.testing.assert_allclose(model(x[:1]), expected[:1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(model(x), expected, rtol=1e-5, atol=1e-5)
    (seen_1,) = [r.function for k, (_, r) in model._shapes_seen.items() if k[0][0] == 1]
    assert seen_1 is model._batch1[1]
