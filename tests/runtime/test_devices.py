"""Platforms and devices.

Multi-device behaviour runs in a child with
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (the device count is fixed when JAX starts):
the session's one child of that device count (``tests.conftest.device_child``); each script runs
several checks and reports them as one JSON line.
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
from tests.conftest import CORPUS, corpus_cases, corpus_refusals, run_on_device_child
from tests.models import batch, export_mlp, mlp_apply, mlp_params

REPO = Path(__file__).resolve().parents[2]
VERSIONS = sorted(
    {c.parent.name.removeprefix("jax-") for c in corpus_cases()},
    key=lambda v: tuple(int(x) for x in v.split(".")),
)

WORKER = textwrap.dedent(
    """
    import json, sys, tempfile, traceback
    import numpy as np, jax, jax.numpy as jnp, mlflow
    import jaxexp_mlflow
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from pathlib import Path
    from jaxexp_mlflow.errors import IncompatibleError
    from tests.conftest import CORPUS, as_logged_by_older_jax, corpus_refusals, load_case
    from tests.models import batch, mlp_apply, mlp_params

    tmp = tempfile.mkdtemp()
    res = {"n_devices": len(jax.devices())}
    FLAG = "jax_export_deserialize_expired_versions"

    def close(a, b):
        return bool(np.allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6))

    def flagged(value, fn):
        # fn() with jax's flag for expired blobs set to value (where this jax has the flag)
        if not hasattr(jax.config, FLAG):
            return fn()
        before = getattr(jax.config, FLAG)
        jax.config.update(FLAG, value)
        try:
            return fn()
        finally:
            jax.config.update(FLAG, before)

    def message(fn, errors=(IncompatibleError,)):
        try:
            fn()
        except errors as err:
            return str(err)
        return None

    def refused(case, tag):
        # a blob this jax does not read (jax >= 0.11.1: HLO shardings): without and with the
        # flag, saving it is refused, and so is loading the model an older jax logged of it
        # (that jax's save is mimicked: a model of 0.10.2's blob of the same function, its blob
        # swapped); jax itself refuses to deserialize it
        path = f"{tmp}/older-{tag}"
        newest = CORPUS / "jax-0.10.2" / "sharded4"
        mlflow.jaxexp.save_model((newest / "exported.bin").read_bytes(), path)
        as_logged_by_older_jax(Path(path), case / "exported.bin")
        data = (case / "exported.bin").read_bytes()
        out = {}
        for flag in (False, True):
            out[str(flag)] = flagged(flag, lambda: {
                "save": message(lambda: mlflow.jaxexp.save_model(data, f"{tmp}/s-{tag}-{flag}")),
                "load": message(lambda: mlflow.jaxexp.load_model(path)),
                "pyfunc": message(lambda: mlflow.pyfunc.load_model(path)),
                "jax": message(lambda: jax.export.deserialize(bytearray(data)), Exception),
            })
        return {"refused": out}

    def corpus_sharded(version):
        case = CORPUS / f"jax-{version}" / "sharded4"
        if corpus_refusals(case, expired_flag=True):
            return refused(case, f"sharded-{version}")
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

    def named_shardings_recorded():
        # jax >= 0.10 serializes NamedShardings; Exported.in_shardings_hlo is then all None
        import yaml
        from jaxexp_mlflow.codec import blob
        mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
        params = mlp_params()
        psh = {"w1": NamedSharding(mesh, P(None, "model")), "b1": NamedSharding(mesh, P("model")),
               "w2": NamedSharding(mesh, P("model", None)), "b2": NamedSharding(mesh, P())}
        xsh = NamedSharding(mesh, P())
        f = jax.jit(mlp_apply, in_shardings=(psh, xsh), out_shardings=xsh)
        sds = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
        exp = jax.export.export(f)(jax.tree.map(sds, params, psh), sds(batch(4), xsh))
        path = Path(tmp, "named")
        mlflow.jaxexp.save_model(exp, path, params=params, input_example=batch(4))
        conf = yaml.safe_load((path / "MLmodel").read_text())["flavors"]["jaxexp"]
        desc = blob.describe((path / "exported.bin").read_bytes())
        # a 1-device export annotated with a 1-device mesh: data_parallel must refuse it
        one = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("one",)), P())
        g = jax.jit(mlp_apply, in_shardings=({k: one for k in params}, one), out_shardings=one)
        annotated = jax.export.export(g)(
            jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params),
            jax.ShapeDtypeStruct(batch(4).shape, batch(4).dtype))
        mlflow.jaxexp.save_model(annotated, f"{tmp}/one-mesh", params=params,
                                 input_example=batch(4))
        return {
            "mlmodel": [conf["in_shardings"], conf["out_shardings"]],
            "blob": [list(desc.in_shardings), list(desc.out_shardings)],
            "nr_devices": conf["nr_devices"],
            "data_parallel": message(
                lambda: mlflow.jaxexp.load_model(f"{tmp}/one-mesh", data_parallel=True)),
        }

    def too_few(version):
        case = CORPUS / f"jax-{version}" / "sharded4"
        if corpus_refusals(case, expired_flag=True):
            return refused(case, f"few-{version}")
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
    res = run_on_device_child(WORKER, n_devices, *tasks)
    assert res["n_devices"] == n_devices
    for task in tasks:
        assert "error" not in res[task], res[task]["error"]
    return res


needs_corpus = pytest.mark.skipif(not VERSIONS, reason="corpus not available")


@pytest.fixture(scope="module")
def on_two_devices() -> dict:
    """The 2-device checks of this module, run by one child (read only); each test asserts
    that its own tasks ran without error."""
    res = run_on_device_child(
        WORKER, 2, "named_shardings_recorded", *[f"too_few:{v}" for v in VERSIONS]
    )
    assert res["n_devices"] == 2
    return res


def ran(res: dict, task: str) -> dict:
    """The result of ``task``, asserting it raised nothing unexpected."""
    assert "error" not in res[task], res[task]["error"]
    return res[task]


def assert_refused(version: str, r: dict, *, n_devices: int) -> None:
    """What jax >= 0.11.1 does with a sharded4 blob of old-style (HLO) shardings: refused
    before anything runs, with and without the flag for expired blobs, saying why and what to
    do; and jax itself indeed refuses to deserialize it, flag or not."""
    case = CORPUS / f"jax-{version}" / "sharded4"
    for flag in ("False", "True"):
        want = corpus_refusals(case, expired_flag=flag == "True")
        assert "hlo_sharding" in want
        got = r["refused"][flag]
        assert got["jax"] is not None, (version, flag)  # jax's own refusal
        assert "cannot read the given blob" in got["save"], (version, flag, got["save"])
        for msg in (got["save"], got["load"], got["pyfunc"]):
            assert msg is not None, (version, flag, got)
            assert "[hlo_sharding]" in msg and "does not help" in msg  # found, and why
            assert "jaxexp refresh" in msg and "export the function again" in msg  # what to do
            blocking = msg.split("- (warning)")[0]  # with the flag, [expired] only warns
            assert ("[expired]" in blocking) == ("expired" in want), (version, flag, msg)
        for msg in (got["load"], got["pyfunc"]):  # the whole verdict: devices too
            assert "cannot run here" in msg
            if n_devices < 4:
                assert "exported for 4 devices" in msg and f"only {n_devices} cpu device(s)" in msg
                assert "--xla_force_host_platform_device_count=4" in msg
            else:
                assert "[devices]" not in msg


@needs_corpus
@pytest.mark.parametrize("n_devices", [4, 8])
def test_corpus_sharded4_runs_on_more_or_equal_devices(n_devices):
    extra = ("live_sharded_params", "data_parallel") if n_devices == 8 else ()
    tasks = [f"corpus_sharded:{v}" for v in VERSIONS] + list(extra)
    res = run_worker(n_devices, *tasks)
    for v in VERSIONS:
        r = res[f"corpus_sharded:{v}"]
        if corpus_refusals(CORPUS / f"jax-{v}" / "sharded4", expired_flag=True):
            assert_refused(v, r, n_devices=n_devices)
            continue
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


def test_named_shardings_are_recorded_and_seen_by_data_parallel(on_two_devices):
    """An export whose shardings JAX serializes as NamedShardings (every export since jax
    0.10; its ``in_shardings_hlo`` is all None, and deprecated): MLmodel records the blob's own
    shardings, and ``data_parallel`` still refuses a 1-device export that carries them."""
    r = ran(on_two_devices, "named_shardings_recorded")
    assert r["nr_devices"] == 2
    assert r["mlmodel"] == r["blob"]  # the JAX-free reader's, from the blob itself
    ins, outs = r["mlmodel"]
    assert len(ins) == 5 and len(outs) == 1 and None not in ins + outs  # b1 b2 w1 w2 x, out
    assert "spec=P(None, 'model')" in ins[2] and "spec=P('model', None)" in ins[3]
    assert all("NamedSharding(" in s for s in ins + outs)
    msg = r["data_parallel"]
    assert msg is not None and "needs a 1-device export without sharding annotations" in msg
    assert "AbstractMesh('one': 1" in msg and "without data_parallel" in msg


@needs_corpus
def test_fewer_devices_than_exported_fails_before_compile_with_both_counts(on_two_devices):
    for v in VERSIONS:
        r = ran(on_two_devices, f"too_few:{v}")
        if corpus_refusals(CORPUS / f"jax-{v}" / "sharded4", expired_flag=True):
            assert_refused(v, r, n_devices=2)  # never deserialized: no plan to make
            continue
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
    # the newest corpus version (NamedShardings: every jax tested reads it; the older ones'
    # refusals under jax >= 0.11.1 are checked above)
    newest = CORPUS / f"jax-{VERSIONS[-1]}" / "sharded4"
    assert VERSIONS[-1] == "0.10.2" and not corpus_refusals(newest, expired_flag=True)
    exp = jax.export.deserialize(bytearray((newest / "exported.bin").read_bytes()))
    # data_parallel applies to 1-device exports only; a 4-device export still needs 4
    with pytest.raises(IncompatibleError, match="exported for 4 devices"):
        devices.plan(exp, data_parallel=True)
