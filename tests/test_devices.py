"""Platforms and devices (issue 5, points 1-2).

Multi-device behaviour runs in subprocesses with
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (the device count is fixed when JAX starts);
each subprocess runs several checks and reports them as one JSON line, to pay the ~3 s import
cost once.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import jax
import mlflow
import numpy as np
import pytest

import jaxexp_mlflow  # noqa: F401  (installs mlflow.jaxexp)
from jaxexp_mlflow.errors import IncompatibleError
from jaxexp_mlflow.runtime import devices
from tests.conftest import CORPUS, corpus_cases, run_on_devices
from tests.models import batch, export_mlp, mlp_apply, mlp_params

REPO = Path(__file__).resolve().parents[1]
VERSIONS = sorted({c.parent.name.removeprefix("jax-") for c in corpus_cases()})

WORKER = textwrap.dedent(
    """
    import json, sys, tempfile, traceback
    import numpy as np, jax, jax.numpy as jnp, mlflow
    import jaxexp_mlflow
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jaxexp_mlflow.errors import IncompatibleError
    from tests.conftest import CORPUS, load_case
    from tests.models import batch, mlp_apply, mlp_params

    tmp = tempfile.mkdtemp()
    res = {"n_devices": len(jax.devices())}

    def close(a, b):
        return bool(np.allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6))

    def corpus_sharded(version):
        case = CORPUS / f"jax-{version}" / "sharded4"
        _, ins, outs = load_case(case)
        path = f"{tmp}/sharded-{version}"
        mlflow.jaxexp.save_model((case / "exported.bin").read_bytes(), path,
                                 input_example=tuple(ins))
        model = mlflow.jaxexp.load_model(path)
        y = model(*ins)
        pred = mlflow.pyfunc.load_model(path).predict({"0": ins[0], "1": ins[1]})
        return {
            "match": close(y, outs[0]),
            "out_devices": len(y.sharding.device_set),
            "x_spec": list(model.placement.in_shardings[0].spec),
            "mesh": int(model.placement.mesh.devices.size),
            "pyfunc_numpy": type(pred).__name__ == "ndarray" and close(pred, outs[0]),
        }

    def live_sharded_params():
        mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
        params = mlp_params()
        specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}
        psh = {k: NamedSharding(mesh, s) for k, s in specs.items()}
        xsh = NamedSharding(mesh, P("data", None))
        f = jax.jit(mlp_apply, in_shardings=(psh, xsh), out_shardings=xsh)
        sds = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
        exp = jax.export.export(f)(jax.tree.map(sds, params, psh), sds(batch(8), xsh))
        path = f"{tmp}/live"
        mlflow.jaxexp.save_model(exp, path, params=params, input_example=batch(8))
        model = mlflow.jaxexp.load_model(path)
        x = batch(8, seed=4)
        pred = mlflow.pyfunc.load_model(path).predict(x)
        return {
            "nr_devices": exp.nr_devices,
            "param_specs": {k: list(v.sharding.spec) for k, v in model.params.items()},
            "param_devices": {k: len(v.sharding.device_set) for k, v in model.params.items()},
            "match": close(model(x), mlp_apply(params, x)),
            "pyfunc_numpy": type(pred).__name__ == "ndarray" and close(pred, mlp_apply(params, x)),
        }

    def data_parallel():
        params = mlp_params()
        path = f"{tmp}/dp"
        mlflow.jaxexp.save_model(jax.jit(mlp_apply), path, params=params, input_example=batch(4))
        model = mlflow.jaxexp.load_model(path, data_parallel=True)
        out = {}
        for n in (16, 5):  # 16 splits over the devices; 5 does not: replicated
            y = model(batch(n))
            out[n] = {"match": close(y, mlp_apply(params, batch(n))),
                      "devices": len(y.sharding.device_set), "spec": list(y.sharding.spec)}
        out["params_replicated"] = tuple(model.params["w1"].sharding.spec) == ()
        return out

    def too_few(version):
        case = CORPUS / f"jax-{version}" / "sharded4"
        path = f"{tmp}/few-{version}"
        mlflow.jaxexp.save_model((case / "exported.bin").read_bytes(), path)
        try:
            mlflow.jaxexp.load_model(path)
        except IncompatibleError as err:
            msg = str(err)
        else:
            msg = None
        exp = jax.export.deserialize(bytearray((case / "exported.bin").read_bytes()))
        from jaxexp_mlflow.runtime import devices
        try:
            devices.plan(exp)
        except IncompatibleError as err:
            plan_msg = str(err)
        else:
            plan_msg = None
        return {"load": msg, "plan": plan_msg}

    for task in sys.argv[1:]:
        name, _, arg = task.partition(":")
        try:
            res[task] = globals()[name](*([arg] if arg else []))
        except Exception:
            res[task] = {"error": traceback.format_exc()}
    print("RESULT " + json.dumps(res))
    """
)


def run_worker(n_devices: int, *tasks: str) -> dict:
    res = run_on_devices(WORKER, n_devices, *tasks)
    assert res["n_devices"] == n_devices
    for task in tasks:
        assert "error" not in res[task], res[task]["error"]
    return res


needs_corpus = pytest.mark.skipif(not VERSIONS, reason="corpus not available")


@needs_corpus
@pytest.mark.parametrize("n_devices", [4, 8])
def test_corpus_sharded4_runs_on_more_or_equal_devices(n_devices):
    extra = ("live_sharded_params", "data_parallel") if n_devices == 8 else ()
    tasks = [f"corpus_sharded:{v}" for v in VERSIONS] + list(extra)
    res = run_worker(n_devices, *tasks)
    for v in VERSIONS:
        r = res[f"corpus_sharded:{v}"]
        assert r["match"] and r["pyfunc_numpy"], (v, r)
        # always a mesh of exactly the exported 4 devices, x sharded on its leading dimension
        assert r["mesh"] == 4 and r["out_devices"] == 4
        assert r["x_spec"][0] is not None and not any(r["x_spec"][1:])
    if n_devices == 8:
        live = res["live_sharded_params"]
        assert live["nr_devices"] == 4 and live["match"] and live["pyfunc_numpy"]
        # restored straight into the exported shardings
        assert live["param_specs"] == {
            "w1": [None, "model"],
            "b1": ["model"],
            "w2": ["model", None],
            "b2": [],
        }
        assert set(live["param_devices"].values()) == {4}
        dp = res["data_parallel"]
        assert dp["16"] == {"match": True, "devices": 8, "spec": ["batch"]}
        assert dp["5"]["match"] and dp["params_replicated"]


@needs_corpus
def test_fewer_devices_than_exported_fails_before_compile_with_both_counts():
    res = run_worker(2, *[f"too_few:{v}" for v in VERSIONS])
    for v in VERSIONS:
        r = res[f"too_few:{v}"]
        for msg in (r["load"], r["plan"]):
            assert msg is not None, v
            assert "exported for 4 devices" in msg and "only 2 cpu device(s)" in msg
            assert "--xla_force_host_platform_device_count=4" in msg


def test_multi_platform_export_from_cpu_runs_here(tmp_path):
    params, x = mlp_params(), batch(3)
    path = tmp_path / "multi"
    mlflow.jaxexp.save_model(
        jax.jit(mlp_apply), path, params=params, input_example=x, platforms=("cpu", "cuda", "tpu")
    )
    model = mlflow.jaxexp.load_model(str(path))
    assert model.metadata["platforms"] == ["cpu", "cuda", "tpu"]
    assert model.placement.platform == "cpu" and model.verdict.status == "ok"
    np.testing.assert_allclose(model(batch(5)), mlp_apply(params, batch(5)), rtol=1e-5)


def test_other_platform_is_refused_naming_both_unless_opted_in(tmp_path):
    params, x = mlp_params(), batch(3)
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    exp = jax.export.export(jax.jit(mlp_apply), platforms=("tpu",))(
        specs, jax.ShapeDtypeStruct(x.shape, x.dtype)
    )
    path = tmp_path / "tpu"
    mlflow.jaxexp.save_model(exp, path, params=params)
    with pytest.raises(IncompatibleError, match=r"(?s)\['tpu'\].*'cpu'.*allow_other_platform"):
        mlflow.jaxexp.load_model(str(path))
    with pytest.raises(IncompatibleError, match=r"\['tpu'\].*'cpu'"):
        devices.plan(exp)
    model = mlflow.jaxexp.load_model(str(path), allow_other_platform=True)
    assert model.verdict.status == "warn" and model.verdict.codes() == ["platform"]
    assert any("platform" in str(c) for c in model.exported.disabled_safety_checks)
    np.testing.assert_allclose(model(x), mlp_apply(params, x), rtol=1e-5)


def test_single_device_plan_and_data_parallel_on_one_device(tmp_path):
    params = mlp_params()
    exp = export_mlp(params)
    p = devices.plan(exp)
    assert p.mesh is None and p.in_shardings == (None,) * len(exp.in_avals)
    path = tmp_path / "m"
    mlflow.jaxexp.save_model(exp, path, params=params)
    model = mlflow.jaxexp.load_model(str(path), data_parallel=True)  # one device: a no-op
    assert not model.placement.data_parallel
    np.testing.assert_allclose(model(batch(4)), mlp_apply(params, batch(4)), rtol=1e-6)


@needs_corpus
def test_data_parallel_does_not_bypass_the_device_count():
    exp = jax.export.deserialize(
        bytearray((CORPUS / f"jax-{VERSIONS[-1]}" / "sharded4" / "exported.bin").read_bytes())
    )
    # data_parallel applies to 1-device exports only; a 4-device export still needs 4
    with pytest.raises(IncompatibleError, match="exported for 4 devices"):
        devices.plan(exp, data_parallel=True)
