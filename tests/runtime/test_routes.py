"""Routes (``runtime/routes.py``): the ways a model runs here when this JAX refuses it.

Against shared-corpus blobs and the installed jax, whichever it is: jax >= 0.11.1 refuses the
blobs of jax <= 0.7 (schema < 5) unless its expired-versions flag is set, and HLO-sharded blobs
whatever the flag; jax 0.10.2 reads both. Each test asserts what the installed version does.
Only the ``slow`` test builds a venv (the bridge: jax 0.10.2 re-exports the blob).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from jaxexp_mlflow.cli import main
from jaxexp_mlflow.runtime import compat, routes
from tests.conftest import CORPUS, REPO, corpus_cases, jax_refuses_expired, load_case

#: schema 2 (jax 0.6.2), nothing else old about it: jax >= 0.11.1 refuses it as expired only
EXPIRED = CORPUS / "jax-0.6.2" / "mlp"
#: schema 5, HLO shardings, 4 devices: jax >= 0.11.1 refuses it whatever the flag
SHARDED = CORPUS / "jax-0.8.3" / "sharded4"
#: schema 2 and HLO shardings
SHARDED_EXPIRED = CORPUS / "jax-0.6.2" / "sharded4"
#: calls blas_strsm, which jaxlib >= 0.7 no longer registers: no jax of today runs it
KERNELS = CORPUS / "jax-0.4.35" / "linalg"
#: whether the installed jax refuses expired blobs (jax >= 0.11.1)
REFUSES = jax_refuses_expired()


#: JAX's expired-versions flag off, as a user who did not set it has it
pytestmark = pytest.mark.usefixtures("expired_flag_off")


def _plan(case: Path) -> list[routes.Route]:
    from jaxexp_mlflow.cli.loading import plan_routes
    from jaxexp_mlflow.cli.uri import resolve

    return plan_routes(resolve(str(case / "exported.bin")))[0]


def _names(case: Path) -> list[str]:
    return [r.name for r in _plan(case)]


def _cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _said(result) -> str:  # noqa: ANN001
    """What a command printed, whitespace collapsed (an error is one line on stderr)."""
    return " ".join(result.output.split())


def _matches(got: list, want: list) -> bool:
    from jaxexp_mlflow.archive.reproduce import compare_outputs

    checks = compare_outputs([np.asarray(g) for g in got], want)
    return len(got) == len(want) and all(c.passed for c in checks)


# -- plan ------------------------------------------------------------------------------------------


def test_plan_expired_blob():
    plan = _plan(EXPIRED)
    names = [r.name for r in plan]
    if REFUSES:  # the flag first; the plain load does not work
        assert names[0] == routes.EXPIRED_FLAG
        assert routes.DIRECT not in names
        assert routes.BRIDGE in names  # a re-export by jax 0.10.2 works too
        assert plan[0].closes_on == routes.OLD_LAYOUT_UNTIL
    else:  # jax 0.10.2 reads it as it is; it has no flag to set
        assert names[0] == routes.DIRECT
        assert routes.EXPIRED_FLAG not in names and routes.BRIDGE not in names
    # the writer's era is offered whatever this jax is, dated from the blob (a bare blob)
    era = routes.find(plan, routes.RECORDED_ENV)
    assert era is not None and era.source.startswith("inferred from the blob")
    assert compat._vkey(era.jax_version) < (0, 7)


@pytest.mark.parametrize("case", [SHARDED, SHARDED_EXPIRED], ids=lambda c: c.parent.name)
def test_plan_hlo_sharded_blob(case):
    plan = _plan(case)
    names = [r.name for r in plan]
    if REFUSES:  # the flag does not help: never offered; an older jax reads it
        assert routes.EXPIRED_FLAG not in names and routes.DIRECT not in names
        assert names[0] == routes.BRIDGE
        assert plan[0].jax_version == routes.BRIDGE_JAX
        assert routes.RECORDED_ENV in names
    else:
        assert names[0] == routes.DIRECT
        assert routes.EXPIRED_FLAG not in names
    # the writer's era is a jax that reads HLO shardings (not jax >= 0.11.1, as this process)
    era = routes.find(plan, routes.RECORDED_ENV)
    assert era is not None and compat._vkey(era.jax_version) < compat.ENFORCING_JAX
    if sys.version_info < (3, 12):  # and one with wheels for this Python
        assert compat._vkey(era.jax_version) < routes.NEEDS_PYTHON_312
    import jax

    if len(jax.devices()) < 4:  # a route run here needs the devices first, and says so
        for r in plan:
            if r.name in routes.IN_PROCESS + (routes.BRIDGE,):
                assert "First fix this machine (devices" in r.how, r


def test_plan_blob_whose_kernels_are_gone():
    """0.4.35's linalg calls blas_strsm: neither this jax nor a re-export of the same module
    runs it; the writer's era does."""
    plan = _plan(KERNELS)
    assert [r.name for r in plan] == [routes.RECORDED_ENV]
    assert compat._vkey(plan[0].jax_version) < (0, 7)


def test_every_route_says_when_it_closes():
    """Every route of every corpus blob has a closing date, or says it has none."""
    from jaxexp_mlflow.cli.check import blob_meta
    from jaxexp_mlflow.codec.blob import describe

    cases = corpus_cases()
    assert len(cases) == 32
    seen = set()
    for case in cases:
        desc = describe((case / "exported.bin").read_bytes(), source=str(case))
        meta = blob_meta(desc)
        verdict = compat.assess(meta, description=desc, allow_other_platform=True)
        # an IREE verdict that says it compiles: the iree route is offered too
        plan = routes.plan(verdict, meta, desc, iree_verdict=compat.Verdict(status="ok"))
        assert plan, case
        for r in plan:
            seen.add(r.name)
            assert r.closes
            assert r.closes_on is not None or r.closes.startswith(routes.NO_DATE), r
            assert f"Closes: {r.closes}" in str(r)
            json.dumps(r.to_dict())
    # jax 0.10.2 reads every blob but one without a flag: no flag, no bridge
    old = set() if REFUSES else {routes.EXPIRED_FLAG, routes.BRIDGE}
    assert seen == set(routes.ROUTES) - old


# -- jaxexp predict --route ------------------------------------------------------------------------


def test_predict_expired_blob_by_route(tmp_path):
    blob = str(EXPIRED / "exported.bin")
    inputs = str(EXPIRED / "inputs.npz")
    _, _, want = load_case(EXPIRED)
    plain = _cli("predict", blob, "--input", inputs, "--output", str(tmp_path / "plain.npz"))
    flagged = _cli(
        "predict", blob, "--input", inputs, "--route", "expired-flag",
        "--output", str(tmp_path / "flag.npz"), "--json",
    )  # fmt: skip
    if REFUSES:
        # refused before JAX reads it, naming the routes that work, the flag first
        assert plain.exit_code == 1, plain.output
        assert "[expired]" in plain.output
        assert "Routes that work here, in order: 1. expired-flag" in _said(plain)
        assert not (tmp_path / "plain.npz").exists()
        assert flagged.exit_code == 0, flagged.output
        report = json.loads(flagged.stdout)
        assert report["route"]["name"] == "expired-flag"
        with np.load(tmp_path / "flag.npz") as data:
            assert _matches([data[f"out_{i}"] for i in range(len(data.files))], want)
        import jax

        assert getattr(jax.config, compat.EXPIRED_FLAG) is False  # scoped: restored
    else:
        assert plain.exit_code == 0, plain.output
        with np.load(tmp_path / "plain.npz") as data:
            assert _matches([data[f"out_{i}"] for i in range(len(data.files))], want)
        # no flag to set here, and none needed: refused, naming the route that works
        assert flagged.exit_code == 1, flagged.output
        assert "--route expired-flag: that route does not work here" in flagged.output
        assert "1. direct" in flagged.output


def test_predict_direct_refused_naming_the_routes(tmp_path):
    out = tmp_path / "out.npz"
    gone = _cli(
        "predict", str(KERNELS / "exported.bin"), "--input", str(KERNELS / "inputs.npz"),
        "--route", "direct", "--output", str(out),
    )  # fmt: skip
    assert gone.exit_code == 1, gone.output
    assert "--route direct: that route does not work here" in gone.output
    assert "Routes that work here, in order: 1. recorded-env (jax 0.6" in _said(gone)
    assert not out.exists()
    expired = _cli(
        "predict", str(EXPIRED / "exported.bin"), "--input", str(EXPIRED / "inputs.npz"),
        "--route", "direct", "--json",
    )  # fmt: skip
    if REFUSES:
        assert expired.exit_code == 1
        assert "that route does not work here" in expired.output
        assert "1. expired-flag" in expired.output and "bridge (jax 0.10.2)" in expired.output
    else:
        assert expired.exit_code == 0, expired.output
        assert json.loads(expired.stdout)["route"]["name"] == "direct"


# -- load_model(route=...) and jaxexp verify --route -----------------------------------------------


@pytest.fixture(scope="module")
def expired_model(tmp_path_factory):
    """A model directory of the jax 0.6.2 MLP blob with its inputs and outputs as reference,
    saved as jax 0.10.2 saved it (with the flag, under jax >= 0.11.1); once per module, only
    loaded and verified."""
    import jax
    import mlflow

    _, inputs, _ = load_case(EXPIRED)
    data = (EXPIRED / "exported.bin").read_bytes()
    path = tmp_path_factory.mktemp("expired") / "model"
    with routes.expired_flag():
        tree = jax.export.deserialize(bytearray(data)).in_tree
        args, _ = jax.tree.unflatten(tree, inputs)  # (params dict, batch)
        mlflow.jaxexp.save_model(data, str(path), input_example=args)
    return path


def test_load_model_takes_a_route_when_asked(expired_model):
    import jax
    import mlflow

    from jaxexp_mlflow.errors import IncompatibleError

    _, inputs, want = load_case(EXPIRED)

    def run(model):
        args, kwargs = jax.tree.unflatten(model.exported.in_tree, inputs)
        return jax.tree.leaves(model(*args, **kwargs))

    if REFUSES:
        for route in (None, "direct"):
            with pytest.raises(IncompatibleError, match=r"1\. expired-flag") as err:
                mlflow.jaxexp.load_model(str(expired_model), route=route)
            assert "[expired]" in str(err.value)
        model = mlflow.jaxexp.load_model(str(expired_model), route="expired-flag")
        assert model.route == "expired-flag"
        assert _matches(run(model), want)
        assert getattr(jax.config, compat.EXPIRED_FLAG) is False
    else:
        model = mlflow.jaxexp.load_model(str(expired_model))
        assert model.route == "direct" and _matches(run(model), want)
        with pytest.raises(IncompatibleError, match=r"does not apply[\s\S]*1\. direct"):
            mlflow.jaxexp.load_model(str(expired_model), route="expired-flag")
    # routes that run outside the call say how to take them; none is taken silently
    with pytest.raises(IncompatibleError, match="--route bridge"):
        mlflow.jaxexp.load_model(str(expired_model), route="bridge")
    with pytest.raises(IncompatibleError, match="expected one of direct, expired-flag"):
        mlflow.jaxexp.load_model(str(expired_model), route="fastest")
    with pytest.raises(IncompatibleError, match="route of the JAX backend"):
        mlflow.jaxexp.load_model(str(expired_model), route="direct", backend="iree")


def test_pyfunc_takes_a_route_from_model_config(expired_model):
    """pyfunc (``mlflow.pyfunc.load_model``, ``mlflow models serve`` through
    ``MLFLOW_PYFUNC_INFERENCE_CONFIG``) takes a route only when ``model_config`` names it."""
    import mlflow

    from jaxexp_mlflow.errors import IncompatibleError

    config = {"route": "expired-flag", "compilation_cache": False}
    if REFUSES:
        with pytest.raises(IncompatibleError, match=r"1\. expired-flag"):
            mlflow.pyfunc.load_model(str(expired_model), model_config={"route": None})
        model = mlflow.pyfunc.load_model(str(expired_model), model_config=config)
        assert model.get_raw_model().route == "expired-flag"
    else:
        with pytest.raises(IncompatibleError, match="does not apply"):
            mlflow.pyfunc.load_model(str(expired_model), model_config=config)
    with pytest.raises(IncompatibleError, match="--route bridge"):
        mlflow.pyfunc.load_model(str(expired_model), model_config={"route": "bridge"})


def test_verify_by_route(expired_model):
    result = _cli("verify", str(expired_model), "--route", "auto", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["ok"] is True
    assert report["route"]["name"] == ("expired-flag" if REFUSES else "direct")
    both = _cli("verify", str(expired_model), "--route", "auto", "--env-manager", "uv")
    assert both.exit_code == 2 and "pass one" in both.output


# -- the bridge, end to end (builds a venv with jax 0.10.2) ---------------------------------------

_BRIDGE_CHILD = r"""
import json, sys
import jax, numpy as np
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from jaxexp_mlflow.cli.loading import load
from jaxexp_mlflow.cli.uri import resolve
from jaxexp_mlflow.archive.reproduce import compare_outputs
from tests.conftest import load_case

case = Path(sys.argv[2])
_, inputs, want = load_case(case)
model = load(resolve(str(case / "exported.bin")), route="bridge")
args, kwargs = jax.tree.unflatten(model.exported.in_tree, inputs)
got = [np.asarray(x) for x in jax.tree.leaves(model(*args, **kwargs))]
checks = compare_outputs(got, want)
print("RESULT " + json.dumps({
    "route": model.route, "devices": len(jax.devices()),
    "match": len(got) == len(want) and all(c.passed for c in checks),
}))
"""


@pytest.mark.slow
def test_bridge_route_end_to_end(tmp_path):
    """0.8.3's HLO-sharded blob re-exported by jax 0.10.2 in a cached venv, then run here on 4
    devices; ``jaxexp predict --route bridge`` where this jax refuses the blob."""
    from tests.conftest import result_of

    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
    }
    env.pop(compat.EXPIRED_ENV, None)
    proc = subprocess.run(
        [sys.executable, "-c", _BRIDGE_CHILD, str(REPO), str(SHARDED)],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=1800,
    )  # fmt: skip
    res = result_of(proc)
    assert res == {"route": "bridge", "devices": 4, "match": True}
    out = tmp_path / "out.npz"
    jaxexp = Path(sys.executable).parent / "jaxexp"
    cli = subprocess.run(
        [str(jaxexp), "predict", str(SHARDED / "exported.bin"), "--input",
         str(SHARDED / "inputs.npz"), "--route", "bridge", "--output", str(out), "--json"],
        capture_output=True, text=True, env=env, timeout=1800,
    )  # fmt: skip
    if REFUSES:
        assert cli.returncode == 0, cli.stderr
        assert json.loads(cli.stdout)["route"]["name"] == "bridge"
        _, _, want = load_case(SHARDED)
        with np.load(out) as data:
            assert _matches([data[f"out_{i}"] for i in range(len(data.files))], want)
    else:  # this jax reads it: the bridge is not a route here, and the refusal says what is
        assert cli.returncode == 1
        assert "--route bridge: that route does not work here" in cli.stderr
        assert "1. direct" in cli.stderr


_REFRESH_CHILD = r"""
import json, sys
import jax, mlflow, numpy as np
sys.path.insert(0, sys.argv[1])
from pathlib import Path
import jaxexp_mlflow
from jaxexp_mlflow.errors import JaxExpError
from jaxexp_mlflow.archive.reproduce import compare_outputs
from tests.conftest import load_case

model_dir, case, store = sys.argv[2], Path(sys.argv[3]), sys.argv[4]
mlflow.set_tracking_uri(f"sqlite:///{store}/mlflow.db")
_, inputs, want = load_case(case)
try:
    jaxexp_mlflow.refresh(model_dir, name="plain")
    plain = "refreshed"
except JaxExpError as err:
    plain = str(err)
info = jaxexp_mlflow.refresh(model_dir, name="bridged", bridge=True)
model = mlflow.jaxexp.load_model(info.model_uri)  # current: loads as it is
got = [np.asarray(x) for x in jax.tree.leaves(model(*inputs))]
tags = mlflow.get_logged_model(info.model_id).tags
print("RESULT " + json.dumps({
    "plain": plain, "route": tags.get("jaxexp.refresh.route"),
    "jax": model.metadata["jax_version"] == jax.__version__, "status": model.verdict.status,
    "match": len(got) == len(want) and all(c.passed for c in compare_outputs(got, want)),
}))
"""

#: jax 0.8.3's HLO-sharded blob as a model directory (saved by jax 0.10.2 with its reference)
SHARDED_MODEL = REPO / "tests" / "data" / "models" / "jax-0.8.3-sharded4"


@pytest.mark.slow
def test_refresh_by_bridge(tmp_path):
    """``jaxexp refresh --route bridge``: a model this jax may not read at all (old-style HLO
    shardings) is re-exported by jax 0.10.2 in a cached venv, checked against its stored
    reference and logged as a current model; under jax >= 0.11.1 the plain refresh is refused
    naming the bridge."""
    from tests.conftest import result_of

    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
    }
    env.pop(compat.EXPIRED_ENV, None)
    proc = subprocess.run(
        [sys.executable, "-c", _REFRESH_CHILD, str(REPO), str(SHARDED_MODEL), str(SHARDED),
         str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=1800,
    )  # fmt: skip
    res = result_of(proc)
    assert res["route"] == f"bridge (jax {routes.BRIDGE_JAX})"
    assert res["jax"] and res["status"] == "ok" and res["match"], res
    if REFUSES:
        assert "hlo_sharding" in res["plain"] and "--route bridge" in res["plain"], res["plain"]
    else:
        assert res["plain"] == "refreshed"
