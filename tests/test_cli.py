"""The ``jaxexp`` command line (issue 6): click's runner and the installed console script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import mlflow
import numpy as np
import pytest
import yaml
from click.testing import CliRunner

import jaxexp_mlflow  # noqa: F401  (mlflow.jaxexp)
from jaxexp_mlflow.cli import main
from tests.conftest import CORPUS, load_case
from tests.models import batch, export_mlp, mlp_apply, mlp_params

JAXEXP = Path(sys.executable).with_name("jaxexp")
COMMANDS = ["inspect", "check", "predict", "verify", "log", "refresh", "audit"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One sqlite MLflow store for the module, with an MLP logged, registered and aliased."""
    root = tmp_path_factory.mktemp("cli")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mlflow.set_tracking_uri(uri)
        exp_id = mlflow.create_experiment("cli", artifact_location=(root / "art").as_uri())
        mlflow.set_experiment(experiment_id=exp_id)
        params = mlp_params()
        x = batch()
        with mlflow.start_run() as run:
            info = mlflow.jaxexp.log_model(
                export_mlp(params),
                name="model",
                params=params,
                input_example=x,
                registered_model_name="mlp",
            )
        client = mlflow.MlflowClient()
        client.set_registered_model_alias("mlp", "best", info.registered_model_version)
        local = Path(mlflow.artifacts.download_artifacts(f"runs:/{run.info.run_id}/model"))
        yield {
            "uri": uri,
            "root": root,
            "run_id": run.info.run_id,
            "model_id": info.model_id,
            "runs_uri": f"runs:/{run.info.run_id}/model",
            "local": local,
            "x": x,
            "want": np.asarray(mlp_apply(params, x)),
            "params": params,
        }
        mlflow.set_tracking_uri(None)
        os.environ.pop("MLFLOW_EXPERIMENT_ID", None)  # left behind by mlflow.set_experiment


def run_cli(*args: str, env: dict | None = None):
    """click's runner; stdout and stderr kept apart."""
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


def run_script(*args: str, env: dict | None = None, python_flags: tuple = ()):
    """The installed console script in a fresh process (stdout/stderr are pipes, not a TTY)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_EXPERIMENT")}
    full_env.update(env or {})
    cmd = [str(JAXEXP), *args]
    if python_flags:
        cmd = [sys.executable, *python_flags, *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=120)


def sha_of(result) -> str:
    return json.loads(result.stdout)["blob"]["sha256"]


# -- help, errors, exit codes ------------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_example_and_json(command):
    result = run_cli(command, "--help")
    assert result.exit_code == 0
    assert "Example" in result.output and f"jaxexp {command}" in result.output
    assert "--json" in result.output and "--debug" in result.output


def test_usage_and_input_errors_exit_2_on_one_line(tmp_path):
    result = run_cli("inspect", str(tmp_path / "missing.bin"))
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no such file or directory" in lines[0]
    assert "Traceback" not in result.stderr
    assert run_cli("verify").exit_code == 2  # missing argument: click usage error
    assert run_cli("predict", "x", "--input", str(tmp_path / "a.csv")).exit_code == 2


def test_debug_shows_the_traceback(tmp_path):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"not a flatbuffer at all")
    plain = run_cli("inspect", str(bad))
    assert plain.exit_code == 2 and "Traceback" not in plain.stderr
    assert "not a valid jax.export serialization" in plain.stderr
    debug = run_cli("inspect", str(bad), "--debug")
    assert debug.exit_code == 2 and "Traceback (most recent call last)" in debug.stderr


def test_json_errors_are_json_on_stdout(tmp_path):
    result = run_cli("check", str(tmp_path / "nope"), "--json")
    assert result.exit_code == 2
    payload = json.loads(result.stdout)
    assert payload["ok"] is False and payload["exit_code"] == 2
    assert "no such file" in payload["error"]["message"]


# -- inspect -----------------------------------------------------------------------------------


def test_inspect_local_model_summary(store):
    result = run_cli("inspect", str(store["local"]))
    assert result.exit_code == 0, result.stderr
    out = result.output
    for text in (
        "mlp_apply",
        "jax " + jax.__version__,
        "params.w1",
        "float32[b,8]",
        "float32[b,4]",
        "(matches MLmodel)",
        "in 4 arrays",
        store["run_id"],
    ):
        assert text in out, text
    rows = [line.split() for line in out.splitlines()]
    assert ["4", "input", "x", "args[1]", "float32[b,8]"] in rows  # with the signature name
    assert ["0", "param", "params.b1", "float32[16]"] in rows


def test_inspect_json_matches_the_blob(store):
    result = run_cli("inspect", str(store["local"]), "--json")
    report = json.loads(result.stdout)
    blob = (store["local"] / "exported.bin").read_bytes()
    import hashlib

    assert report["blob"]["sha256"] == hashlib.sha256(blob).hexdigest()
    assert report["checksum"]["ok"] is True
    assert [r["role"] for r in report["inputs"]] == ["param"] * 4 + ["input"]
    assert report["blob"]["platforms"] == ["cpu"] and report["blob"]["nr_devices"] == 1
    assert report["params"]["num_arrays"] == 4


def test_inspect_every_kind_of_model_uri(store):
    want = sha_of(run_cli("inspect", str(store["local"]), "--json"))
    uris = [
        store["runs_uri"],
        "models:/mlp/1",
        "models:/mlp@best",
        f"models:/{store['model_id']}",
        store["local"].as_uri(),
        str(store["local"] / "MLmodel"),
        f"{store['runs_uri']}/exported.bin",  # a bare blob inside a run
    ]
    for uri in uris:
        result = run_cli("inspect", uri, "--json")
        assert result.exit_code == 0, (uri, result.stderr)
        assert sha_of(result) == want, uri
    missing = run_cli("inspect", "models:/mlp/7")
    assert missing.exit_code == 2 and "not found" in missing.stderr


def test_inspect_bare_blobs_of_old_jax_with_pytrees_and_shardings():
    result = run_cli("inspect", str(CORPUS / "jax-0.6.2" / "pytree_io" / "exported.bin"))
    assert result.exit_code == 0
    assert "(bare blob)" in result.output and "calling convention v9" in result.output
    assert "out[0]['fsum']" in result.output and "out[1][2]" in result.output
    sharded = run_cli("inspect", str(CORPUS / "jax-0.8.3" / "sharded4"), "--json")
    report = json.loads(sharded.stdout)
    assert report["blob"]["nr_devices"] == 4
    assert report["inputs"][0]["sharding"] == "{devices=[4,1]<=[4]}"


def test_inspect_reports_a_tampered_blob(store, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(store["local"], copy)
    data = bytearray((copy / "exported.bin").read_bytes())
    data[-1] ^= 0xFF
    (copy / "exported.bin").write_bytes(bytes(data))
    result = run_cli("inspect", str(copy))
    assert result.exit_code == 2
    assert "MISMATCH" in result.stdout and "altered" in result.stderr


def test_inspect_never_imports_jax_console_script(store):
    """The console script, on a runs:/ URI (MLflow imported), must not import jax."""
    result = run_script(
        "inspect",
        store["runs_uri"],
        env={"MLFLOW_TRACKING_URI": store["uri"]},
        python_flags=("-X", "importtime"),
    )
    assert result.returncode == 0, result.stderr
    assert "mlp_apply" in result.stdout
    modules = [
        line.rsplit("|", 1)[-1].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:")
    ]
    assert "mlflow" in modules and "jaxexp_mlflow.codec.reader" in modules
    jaxish = [m for m in modules if m in ("jax", "jaxlib") or m.startswith(("jax.", "jaxlib."))]
    assert jaxish == []


# -- check -------------------------------------------------------------------------------------


def test_check_ok_and_incompatible(store):
    ok = run_cli("check", str(store["local"]))
    assert ok.exit_code == 0 and "Verdict      ok" in ok.output
    linalg = CORPUS / "jax-0.4.35" / "linalg" / "exported.bin"
    bad = run_cli("check", str(linalg), "--json")
    assert bad.exit_code == 1
    verdict = json.loads(bad.stdout)
    assert verdict["status"] == "incompatible"
    assert "custom_calls" in [r["code"] for r in verdict["reasons"]]
    text = run_cli("check", str(linalg))
    assert text.exit_code == 1 and "[custom_calls]" in text.output
    devices = run_cli("check", str(CORPUS / "jax-0.8.3" / "sharded4"), "--json")
    assert devices.exit_code == 1
    assert [r["code"] for r in json.loads(devices.stdout)["reasons"]] == ["devices"]


# -- predict -----------------------------------------------------------------------------------


def test_predict_files_in_and_out(store, tmp_path):
    x, want = store["x"], store["want"]
    np.save(tmp_path / "x.npy", x)
    np.savez(tmp_path / "x.npz", in_0=x)
    (tmp_path / "x.json").write_text(json.dumps({"inputs": x.tolist()}))
    for src in ("x.npy", "x.npz", "x.json"):
        for dst in ("y.npz", "y.npy", "y.json"):
            out = tmp_path / f"{src}-{dst}"
            result = run_cli(
                "predict",
                str(store["local"]),
                "--input",
                str(tmp_path / src),
                "--output",
                str(out),
            )
            assert result.exit_code == 0, result.stderr
            if dst.endswith(".npz"):
                with np.load(out, allow_pickle=False) as data:
                    got = data["out_0"]
            elif dst.endswith(".npy"):
                got = np.load(out, allow_pickle=False)
            else:
                got = np.asarray(json.loads(out.read_text())["out_0"], np.float32)
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"{src}->{dst}")
    summary = run_cli("predict", store["runs_uri"], "--input", str(tmp_path / "x.npy"), "--json")
    payload = json.loads(summary.stdout)
    assert payload["outputs"][0]["shape"] == [5, 4]
    np.testing.assert_allclose(payload["outputs"][0]["values"], want, rtol=1e-6, atol=1e-6)


def test_predict_bare_blob_with_pytrees_matches_the_corpus(tmp_path):
    case = CORPUS / "jax-0.6.2" / "pytree_io"
    _, _, outputs = load_case(case)
    out = tmp_path / "out.npz"
    result = run_cli(
        "predict",
        str(case / "exported.bin"),
        "--input",
        str(case / "inputs.npz"),
        "--output",
        str(out),
    )
    assert result.exit_code == 0, result.stderr
    with np.load(out, allow_pickle=False) as data:
        for i, want in enumerate(outputs):
            np.testing.assert_allclose(data[f"out_{i}"], want, rtol=1e-5, atol=1e-6)


def test_predict_refuses_an_incompatible_blob_with_exit_1():
    case = CORPUS / "jax-0.4.35" / "linalg"
    args = ["predict", str(case / "exported.bin"), "--input", str(case / "inputs.npz")]
    result = run_cli(*args)
    assert result.exit_code == 1
    assert "custom_calls" in result.stderr and "--allow-incompatible" in result.stderr
    forced = run_cli(*args, "--allow-incompatible")  # tries, and fails when called
    assert forced.exit_code == 1 and "failed to run here" in forced.stderr


def test_predict_wrong_input_is_an_input_error(store, tmp_path):
    np.save(tmp_path / "bad.npy", np.zeros((5, 3), np.float32))
    result = run_cli("predict", str(store["local"]), "--input", str(tmp_path / "bad.npy"))
    assert result.exit_code == 2
    assert "expected" in result.stderr and len(result.stderr.strip().splitlines()) == 1


# -- verify ------------------------------------------------------------------------------------


def test_verify_reproduces_and_detects_a_mismatch(store, tmp_path):
    ok = run_cli("verify", store["runs_uri"])
    assert ok.exit_code == 0, ok.stderr
    assert "pass" in ok.output and "Reproduced: all 1 output(s) match." in ok.output
    # a model whose stored reference outputs no longer match what the function computes
    copy = tmp_path / "model"
    shutil.copytree(store["local"], copy)
    with np.load(copy / "reference" / "outputs.npz", allow_pickle=False) as data:
        ref = data["out_0"]
    np.savez(copy / "reference" / "outputs.npz", out_0=ref + np.float32(1e-3))
    bad = run_cli("verify", str(copy), "--json")
    assert bad.exit_code == 1
    payload = json.loads(bad.stdout)
    assert payload["ok"] is False and payload["outputs"][0]["passed"] is False
    assert payload["outputs"][0]["max_abs_err"] == pytest.approx(1e-3, rel=1e-2)
    loose = run_cli("verify", str(copy), "--atol", "1e-2")
    assert loose.exit_code == 0 and "1e-05/0.01" in loose.output


def test_verify_bare_blob_is_an_input_error():
    result = run_cli("verify", str(CORPUS / "jax-0.8.3" / "mlp" / "exported.bin"))
    assert result.exit_code == 2 and "no reference" in result.stderr


def test_verify_console_script_quiet_off_a_terminal(store):
    env = {"MLFLOW_TRACKING_URI": store["uri"]}
    result = run_script("verify", "models:/mlp@best", env=env)
    assert result.returncode == 0, result.stderr
    assert "pass" in result.stdout
    assert result.stderr == ""  # no progress, no library chatter when not a terminal
    forced = run_script("verify", "models:/mlp@best", "--json", env={**env, "JAXEXP_PROGRESS": "1"})
    assert forced.returncode == 0
    assert "Loading the model" in forced.stderr and "done (" in forced.stderr
    assert json.loads(forced.stdout)["ok"] is True


# -- log and refresh ---------------------------------------------------------------------------


def test_log_an_archived_blob_then_verify(store, tmp_path):
    case = CORPUS / "jax-0.8.3" / "mlp"
    result = run_cli(
        "log",
        str(case / "exported.bin"),
        "--input-example",
        str(case / "inputs.npz"),
        "--experiment",
        "archive",
        "--register",
        "archived",
        "--json",
    )
    assert result.exit_code == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["registered_model_version"] in ("1", 1)
    run = mlflow.get_run(info["run_id"])
    assert mlflow.get_experiment(run.info.experiment_id).name == "archive"
    verify = run_cli("verify", info["runs_uri"], "--json")
    assert verify.exit_code == 0, verify.stderr
    assert json.loads(verify.stdout)["outputs"][0]["passed"] is True
    same = run_cli("verify", "models:/archived/1")
    assert same.exit_code == 0


def test_log_blob_with_orbax_params_into_an_existing_run(store, tmp_path):
    from jaxexp_mlflow.codec.params import save_params

    params = store["params"]
    blob = tmp_path / "mlp.bin"
    blob.write_bytes(bytes(export_mlp(params).serialize()))
    save_params(params, tmp_path / "ckpt")
    np.savez(tmp_path / "x.npz", in_0=store["x"])
    with mlflow.start_run() as run:
        pass
    result = run_cli(
        "log",
        str(blob),
        "--params",
        str(tmp_path / "ckpt"),
        "--input-example",
        str(tmp_path / "x.npz"),
        "--run-id",
        run.info.run_id,
        "--name",
        "mlp2",
    )
    assert result.exit_code == 0, result.stderr
    assert f"runs:/{run.info.run_id}/mlp2" in result.output
    inspect = json.loads(run_cli("inspect", f"runs:/{run.info.run_id}/mlp2", "--json").stdout)
    assert inspect["params"]["num_arrays"] == 4
    assert run_cli("verify", f"runs:/{run.info.run_id}/mlp2").exit_code == 0
    both = run_cli("log", str(blob), "--experiment", "e", "--run-id", run.info.run_id)
    assert both.exit_code == 2


def test_refresh_logs_a_new_model_that_verifies(store):
    result = run_cli("refresh", store["runs_uri"], "--register", "mlp-refreshed", "--json")
    assert result.exit_code == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["model_id"] != store["model_id"]
    assert run_cli("verify", "models:/mlp-refreshed/1").exit_code == 0


def test_flavor_yaml_is_what_inspect_shows(store):
    """inspect reads MLmodel itself (no MLflow): every flavor key comes through unchanged."""
    conf = yaml.safe_load((store["local"] / "MLmodel").read_text())["flavors"]["jaxexp"]
    report = json.loads(run_cli("inspect", str(store["local"]), "--json").stdout)
    assert report["flavor"] == conf
