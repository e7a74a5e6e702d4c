"""Logging a bare blob this JAX refuses: stored unchanged, read back through a route
recorded in MLmodel, then verified and refreshed through the CLI.

Against shared-corpus blobs and the installed jax, whichever it is: jax >= 0.11.1 refuses the
blobs of jax <= 0.7 (schema < 5) unless its expired-versions flag is set (the ``expired-flag``
route: in this process), and the HLO-sharded ones whatever the flag (the ``bridge`` route: jax
0.10.2 in a cached venv); no jaxlib of today runs the LAPACK kernels of jax 0.4.35's ``linalg``
(the ``recorded-env`` route: the writer's era in a cached venv). jax 0.10.2 reads every blob.
Each test asserts what the installed version does; the ones that build a venv are ``slow``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from jaxexp_mlflow.cli import main
from jaxexp_mlflow.errors import ArtifactError, IncompatibleError, UnsupportedModelError
from jaxexp_mlflow.runtime import compat
from tests.conftest import (
    CORPUS,
    REPO,
    case_id,
    corpus_cases,
    jax_refuses_expired,
    load_case,
    sqlite_uri,
)

REFUSES = jax_refuses_expired()
#: one blob of each era that runs in this process (no venv): grads, symbolic dims, pytrees
QUICK = [
    CORPUS / "jax-0.4.35" / "vjp2",
    CORPUS / "jax-0.6.2" / "mlp_poly",
    CORPUS / "jax-0.8.3" / "mlp",
    CORPUS / "jax-0.10.2" / "pytree_io",
]
#: calls blas_strsm, which no jaxlib of today registers: only its own era runs it
KERNELS = CORPUS / "jax-0.4.35" / "linalg"
needs_corpus = pytest.mark.skipif(not CORPUS.is_dir(), reason="corpus not available")


#: JAX's expired-versions flag off, as a user who did not set it has it
pytestmark = pytest.mark.usefixtures("expired_flag_off")


def _cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _said(text: str) -> str:
    return " ".join(text.split())


def _local(uri: str) -> Path:
    from mlflow.artifacts import download_artifacts

    return Path(download_artifacts(artifact_uri=uri))


def _section(model_dir: Path) -> dict:
    return yaml.safe_load((model_dir / "MLmodel").read_text())["flavors"]["jaxexp"]


def _expected_route(case: Path) -> str:
    old = case.parent.name in ("jax-0.4.35", "jax-0.6.2")
    return "expired-flag" if REFUSES and old else "direct"


@needs_corpus
@pytest.mark.parametrize("case", QUICK, ids=case_id)
def test_log_verify_refresh_through_the_cli(case, tracking_uri):
    """``jaxexp log BLOB --input-example``, ``verify``, ``refresh``, ``verify`` as a user runs
    them, without any flag: the route is planned, named, recorded, and taken again by verify;
    the refreshed model loads as it is."""
    logged = _cli(
        "log", str(case / "exported.bin"), "--input-example", str(case / "inputs.npz"), "--json"
    )
    assert logged.exit_code == 0, logged.output
    info = json.loads(logged.stdout)
    route = _expected_route(case)
    assert info["route"]["name"] == route
    local = _local(info["runs_uri"])
    conf = _section(local)
    # the bytes unchanged, the route recorded (only where one was needed)
    assert (local / "exported.bin").read_bytes() == (case / "exported.bin").read_bytes()
    assert (conf.get("route") or {"name": "direct"})["name"] == route
    if route == "expired-flag":
        assert conf["route"]["jax_version"] == info["route"]["jax_version"]
        assert conf["route"]["closes_on"]  # JAX's own date for schema < 10
        text = _cli("log", str(case / "exported.bin"), "--input-example", str(case / "inputs.npz"))
        assert text.exit_code == 0 and "Route        expired-flag" in text.output
        # the plain load still refuses, naming the route: nothing is taken silently in Python
        import mlflow

        with pytest.raises(IncompatibleError, match=r"1\. expired-flag"):
            mlflow.jaxexp.load_model(info["runs_uri"])

    verified = _cli("verify", info["runs_uri"], "--json")
    assert verified.exit_code == 0, verified.output
    report = json.loads(verified.stdout)
    assert report["ok"] is True and report["route"]["name"] == route
    refreshed = _cli("refresh", info["runs_uri"], "--json")
    assert refreshed.exit_code == 0, refreshed.output
    new = json.loads(refreshed.stdout)["runs_uri"]
    assert "route" not in _section(_local(new))  # current: no route recorded
    again = _cli("verify", new, "--json")
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["route"]["name"] == "direct"
    assert json.loads(again.stdout)["ok"] is True


@needs_corpus
def test_log_model_bytes_names_the_route(tracking_uri, caplog):
    """``mlflow.jaxexp.log_model(bytes)`` of a jax 0.6.2 blob: saved where jax >= 0.11.1 refuses
    it, the route named in a warning and in the ModelInfo's flavor; loads by that route."""
    import jax
    import mlflow

    from jaxexp_mlflow.flavors.save_route import readable

    case = CORPUS / "jax-0.6.2" / "mlp"
    _, inputs, want = load_case(case)
    data = (case / "exported.bin").read_bytes()
    args, _ = jax.tree.unflatten(readable(data).in_tree, inputs)
    with caplog.at_level(logging.WARNING), mlflow.start_run():
        info = mlflow.jaxexp.log_model(data, name="m", input_example=tuple(args))
    route = info.flavors["jaxexp"].get("route")
    if not REFUSES:
        assert route is None and "through route" not in caplog.text
        return
    assert route["name"] == "expired-flag"
    assert "through route expired-flag" in caplog.text
    assert getattr(jax.config, compat.EXPIRED_FLAG) is False  # scoped, then restored
    model = mlflow.jaxexp.load_model(info.model_uri, route="expired-flag")
    got = jax.tree.leaves(model(*args))
    np.testing.assert_allclose(np.asarray(got[0]), want[0], rtol=1e-5, atol=1e-6)
    # asked for the direct route, which does not work for it: refused, saying how to ask
    with mlflow.start_run(), pytest.raises(IncompatibleError) as err:
        mlflow.jaxexp.log_model(data, name="m2", input_example=tuple(args), route="direct")
    msg = str(err.value)
    assert "cannot read the given blob" in msg and "[expired]" in msg
    assert "1. expired-flag" in msg and "route='expired-flag'" in msg


@needs_corpus
def test_no_route_taken_unasked_is_a_typed_refusal_naming_the_routes(tracking_uri):
    """jax 0.4.35's ``linalg`` calls kernels no jaxlib of today has: with an input example, no
    route runs it in this process, so the log is refused, naming the routes that work and how
    to ask for them (on jax 0.10.2 and on jax >= 0.11.1 alike); nothing is logged."""
    import mlflow

    before = len(mlflow.search_logged_models(output_format="list"))
    result = _cli(
        "log", str(KERNELS / "exported.bin"), "--input-example", str(KERNELS / "inputs.npz")
    )
    said = _said(result.stderr)
    assert result.exit_code == 1, result.output
    assert "cannot run the given blob" in said or "cannot read the given blob" in said
    assert "blas_strsm" in said  # what was found
    assert "recorded-env" in said and "--route recorded-env" in said  # the route, how to ask
    assert "route='recorded-env'" in said
    assert len(mlflow.search_logged_models(output_format="list")) == before
    # without an input example it needs no route on jax 0.10.2 (nothing runs); the route asked
    # for on a function (not bytes) is refused by type
    with pytest.raises(UnsupportedModelError, match="blob given as bytes"):
        mlflow.jaxexp.save_model(lambda p, x: x, "unused", params={}, route="bridge")


@needs_corpus
@pytest.mark.skipif(not REFUSES, reason="jax < 0.11.1 reads HLO shardings")
def test_hlo_sharded_blob_is_refused_until_the_bridge_is_asked(tracking_uri):
    """The bridge builds a venv: never taken unasked. The refusal says how to ask for it."""
    case = CORPUS / "jax-0.8.3" / "sharded4"
    result = _cli("log", str(case / "exported.bin"), "--input-example", str(case / "inputs.npz"))
    said = _said(result.stderr)
    assert result.exit_code == 1 and "cannot read the given blob" in said
    assert "[hlo_sharding]" in said and "1. bridge" in said and "--route bridge" in said


def test_a_route_entry_that_is_no_mapping_is_refused(tmp_path):
    from jaxexp_mlflow.store.section import validate_flavor

    conf = {"exported_sha256": "0" * 64, "route": "bridge"}
    with pytest.raises(ArtifactError, match="route"):
        validate_flavor(conf)
    assert validate_flavor({**conf, "route": {"name": "bridge"}})["route"]["name"] == "bridge"


# -- the venv routes (slow: each builds a cached venv once) ----------------------------------------


def _envs() -> dict[str, str]:
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(REPO),
    }
    env.setdefault("JAXEXP_ENVS_DIR", str(REPO / ".cache" / "jaxexp" / "envs"))
    env.pop(compat.EXPIRED_ENV, None)
    return env


def _script(env: dict, *args: str) -> subprocess.CompletedProcess:
    jaxexp = Path(sys.executable).parent / "jaxexp"
    return subprocess.run(
        [str(jaxexp), *args], capture_output=True, text=True, env=env, timeout=1800, cwd=REPO
    )


@pytest.mark.slow
@needs_corpus
def test_log_an_hlo_sharded_blob_through_the_bridge(tmp_path):
    """``jaxexp log --route bridge`` (the console script, 4 CPU devices) of jax 0.6.2's
    ``sharded4`` where jax >= 0.11.1 reads it at all: logged, verified by the recorded bridge,
    refreshed into a model that verifies as it is."""
    case = CORPUS / "jax-0.6.2" / "sharded4"
    env = {**_envs(), "MLFLOW_TRACKING_URI": sqlite_uri(tmp_path / "mlflow.db")}
    args = ["log", str(case / "exported.bin"), "--input-example", str(case / "inputs.npz")]
    logged = _script(env, *args, "--route", "bridge", "--json")
    if not REFUSES:  # this jax reads it: the bridge is not a route here
        assert logged.returncode == 1 and "does not work here" in logged.stderr
        return
    assert logged.returncode == 0, logged.stderr
    info = json.loads(logged.stdout)
    assert info["route"]["name"] == "bridge" and info["route"]["jax_version"] == "0.10.2"
    verified = _script(env, "verify", info["runs_uri"], "--json")
    assert verified.returncode == 0, verified.stderr
    assert json.loads(verified.stdout)["route"]["name"] == "bridge"
    refreshed = _script(env, "refresh", info["runs_uri"], "--json")
    assert refreshed.returncode == 0, refreshed.stderr
    again = _script(env, "verify", json.loads(refreshed.stdout)["runs_uri"], "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["route"]["name"] == "direct"


@pytest.mark.slow
@needs_corpus
def test_log_a_blob_whose_kernels_are_gone_through_its_era(tmp_path):
    """``jaxexp log --route recorded-env`` of jax 0.4.35's ``linalg``: its reference computed by
    the writer's era in a cached venv, verified there (``--route recorded-env``); a refresh
    cannot help (the module keeps calling the kernels) and says so, logging nothing."""
    env = {**_envs(), "MLFLOW_TRACKING_URI": sqlite_uri(tmp_path / "mlflow.db")}
    args = ["log", str(KERNELS / "exported.bin"), "--input-example", str(KERNELS / "inputs.npz")]
    logged = _script(env, *args, "--route", "recorded-env", "--json")
    assert logged.returncode == 0, logged.stderr
    info = json.loads(logged.stdout)
    assert info["route"]["name"] == "recorded-env" and info["route"]["jax_version"]
    plain = _script(env, "verify", info["runs_uri"])
    assert plain.returncode == 1 and "--route recorded-env" in _said(plain.stderr)
    verified = _script(env, "verify", info["runs_uri"], "--route", "recorded-env", "--json")
    assert verified.returncode == 0, verified.stderr
    assert json.loads(verified.stdout)["ok"] is True
    refused = _script(env, "refresh", info["runs_uri"])
    assert refused.returncode == 1 and "blas_strsm" in refused.stderr
    assert "export the function again" in _said(refused.stderr)


@pytest.mark.slow
@needs_corpus
@pytest.mark.parametrize("case", corpus_cases(), ids=case_id)
def test_every_corpus_blob_is_logged_verified_and_refreshed(case, tmp_path):
    """The issue's goal, blob by blob, through the console script on 4 CPU devices: logged
    (default route, else ``--route auto`` after a refusal naming it), verified by its route,
    refreshed into a model that verifies as it is; 0.4.35's ``linalg`` cannot be refreshed."""
    env = {**_envs(), "MLFLOW_TRACKING_URI": sqlite_uri(tmp_path / "mlflow.db")}
    args = ["log", str(case / "exported.bin"), "--input-example", str(case / "inputs.npz")]
    logged = _script(env, *args, "--json")
    if logged.returncode != 0:
        assert "--route" in logged.stderr, logged.stderr  # the refusal says how to ask
        logged = _script(env, *args, "--route", "auto", "--json")
    assert logged.returncode == 0, logged.stderr
    info = json.loads(logged.stdout)
    extra = ["--route", "recorded-env"] if info["route"]["name"] == "recorded-env" else []
    verified = _script(env, "verify", info["runs_uri"], "--json", *extra)
    assert verified.returncode == 0, verified.stderr
    assert json.loads(verified.stdout)["ok"] is True
    refreshed = _script(env, "refresh", info["runs_uri"], "--json")
    if case == KERNELS:
        assert refreshed.returncode == 1 and "blas_strsm" in refreshed.stderr
        return
    assert refreshed.returncode == 0, refreshed.stderr
    again = _script(env, "verify", json.loads(refreshed.stdout)["runs_uri"], "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["route"]["name"] == "direct"
