"""The ``jaxexp`` command line: click's runner and the installed console script."""

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

import jaxexp_mlflow  # noqa: F401  (mlflow.jaxexp)
from jaxexp_mlflow.runtime import compat
from tests.conftest import (
    CORPUS,
    active_store,
    corpus_refusals,
    load_case,
    reseal_reference,
    run_cli,
)
from tests.models import export_mlp, mlp_apply, mlp_params

JAXEXP = Path(sys.executable).with_name("jaxexp")
COMMANDS = ["inspect", "check", "predict", "verify", "log", "refresh", "audit"]


@pytest.fixture(scope="module")
def store(registered_mlp):
    """The session's sqlite MLflow store with an MLP logged, registered and aliased
    (``registered_mlp``), this module's store."""
    with active_store(registered_mlp["uri"], registered_mlp["experiment_id"]):
        yield registered_mlp


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


@pytest.fixture
def expired_env(expired_flag, monkeypatch):
    """jax's flag for expired blobs set as a user sets it for the CLI: in this process (the
    ``expired_flag`` fixture) and in the environment the CLI's child processes inherit (its
    isolated deserialization probe). Yields whether this jax has the flag (jax >= 0.11.1)."""
    if expired_flag:
        monkeypatch.setenv(compat.EXPIRED_ENV, "1")
    return expired_flag


def incompatible_codes(payload: dict) -> set[str]:
    """The codes of the blocking reasons of a ``--json`` verdict."""
    return {r["code"] for r in payload["reasons"] if r["severity"] == "incompatible"}


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
    # jax 0.4.35's LAPACK kernels are gone from every jaxlib tested; jax >= 0.11.1 also refuses
    # to read the blob at all (schema 2: "expired") unless its flag is set
    case = CORPUS / "jax-0.4.35" / "linalg"
    linalg = case / "exported.bin"
    bad = run_cli("check", str(linalg), "--json")
    assert bad.exit_code == 1
    verdict = json.loads(bad.stdout)
    assert verdict["status"] == "incompatible"
    assert incompatible_codes(verdict) == {"custom_calls"} | corpus_refusals(case)
    text = run_cli("check", str(linalg))
    assert text.exit_code == 1 and "[custom_calls]" in text.output and "blas_strsm" in text.output
    if corpus_refusals(case):  # what was found, and what to do: the flag, or an older jax
        assert "[expired]" in text.output and "serialization schema 2" in text.output
        assert f"{compat.EXPIRED_ENV}=1" in text.output and "==0.11.0" in text.output
    # jax 0.8.3's sharded4 needs 4 devices; jax >= 0.11.1 refuses its HLO shardings, flag or not
    case = CORPUS / "jax-0.8.3" / "sharded4"
    devices = run_cli("check", str(case), "--json")
    assert devices.exit_code == 1
    payload = json.loads(devices.stdout)
    assert {r["code"] for r in payload["reasons"]} == {"devices"} | corpus_refusals(case)
    for r in payload["reasons"]:
        if r["code"] == "hlo_sharding":
            assert "devices=[4" in r["message"] and "does not help" in r["message"]
            assert compat.EXPIRED_ENV not in r["action"] and "==0.11.0" in r["action"]


def test_check_expired_blobs_with_the_flag(expired_env):
    """With jax's flag for expired blobs set (jax >= 0.11.1), the 0.4.35 and 0.6.2 blobs are read
    again: only a warning to refresh them stays; 0.4.35's linalg still calls a removed kernel."""
    mlp = CORPUS / "jax-0.6.2" / "mlp"
    result = run_cli("check", str(mlp / "exported.bin"), "--json")
    assert result.exit_code == 0, result.output  # read in the isolated probe too
    payload = json.loads(result.stdout)
    assert payload["status"] == "warn" and not corpus_refusals(mlp, expired_flag=True)
    codes = {r["code"]: r for r in payload["reasons"]}
    # read outside the promised window; on jax >= 0.11.1 only thanks to the flag: refresh it
    assert set(codes) == {"window_backward"} | ({"expired"} if expired_env else set())
    if expired_env:
        assert codes["expired"]["severity"] == "warn" and "refresh" in codes["expired"]["action"]
    linalg = CORPUS / "jax-0.4.35" / "linalg"
    result = run_cli("check", str(linalg / "exported.bin"), "--json")
    assert result.exit_code == 1
    assert incompatible_codes(json.loads(result.stdout)) == {"custom_calls"}


def test_check_across_the_version_line(tmp_path):
    """Blobs written in this process, judged for the environment across the version line (jax
    0.10.2 <-> 0.12), and corpus blobs judged for jax 0.12. ``jaxexp check`` judges the running
    jax only (it has no option naming another jax/jaxlib): the other side is ``compat.assess``
    fed what ``jaxexp check`` feeds it (``blob_meta`` of the jax-free reader's description),
    against this environment with the other jax's measured facts."""
    from jaxexp_mlflow.cli.check import blob_meta
    from jaxexp_mlflow.codec.reader import read_blob_file
    from jaxexp_mlflow.store.section import package_version

    here = compat.Environment.current()
    jax_0102 = here.replace(  # measured with jax/jaxlib 0.10.2
        jax_version="0.10.2",
        jaxlib_version="0.10.2",
        calling_convention_range=(9, 10),
        max_schema=11,
        stablehlo_version="1.17.0",
        enforces_window=False,
        reads_expired=False,
    )
    jax_012 = here.replace(  # measured with jax/jaxlib 0.12.0.1
        jax_version="0.12.0.1",
        jaxlib_version="0.12.0.1",
        calling_convention_range=(9, 10),
        max_schema=12,
        stablehlo_version="1.22.0",
        enforces_window=True,
        reads_expired=False,
    )

    def judge(blob: Path, env: compat.Environment, **meta) -> compat.Verdict:
        desc = read_blob_file(blob)
        return compat.assess({**blob_meta(desc), **meta}, description=desc, env=env)

    params = mlp_params()
    poly = tmp_path / "poly.bin"  # batch-polymorphic: shape assertions in the module
    poly.write_bytes(bytes(export_mlp(params).serialize()))
    concrete = tmp_path / "concrete.bin"
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    exp = jax.export.export(jax.jit(mlp_apply))(specs, jax.ShapeDtypeStruct((4, 8), np.float32))
    concrete.write_bytes(bytes(exp.serialize()))
    for blob in (poly, concrete):  # the running jax reads what it writes
        mine = run_cli("check", str(blob), "--json")
        assert mine.exit_code == 0 and json.loads(mine.stdout)["status"] == "ok", mine.output
    recorded = {"jax_version": jax.__version__, "jaxlib_version": package_version("jaxlib")}
    schema = read_blob_file(poly).schema_generation
    assert (schema > 11) == (here.max_schema > 11)
    if schema > 11:  # written by jax 0.12 (schema 12, which records the writer's jax)
        assert read_blob_file(poly).serialization_version >= 3
        for meta in (recorded, {}):  # as logged here (jaxlib recorded), and as bare bytes
            # batch-polymorphic: its shape assertions use vhlo.custom_call_v2 (StableHLO 1.18),
            # which jaxlib 0.10.2 (1.17) cannot read: refused, naming the jax it needs
            v = judge(poly, jax_0102, **meta)
            assert v.status == "incompatible", str(v)
            (op,) = [r for r in v.reasons if r.code == "stablehlo"]
            assert op.severity == "incompatible" and "custom_call_v2" in op.message
            assert f"Upgrade jax and jaxlib to {jax.__version__} or newer" in op.action
            # concrete shapes: read and run by 0.10.2 (measured), with the newer schema named
            v = judge(concrete, jax_0102, **meta)
            assert v.status == "warn" and "stablehlo" not in v.codes(), str(v)
            (sch,) = [r for r in v.reasons if r.code == "schema"]
            assert f"schema {schema}" in sch.message and "up to 11" in sch.message
            assert f"Upgrade jax and jaxlib to {jax.__version__} or newer" in sch.action
            if meta:  # the exporter's recorded jaxlib, months newer than 0.10.2
                (fwd,) = [r for r in v.reasons if r.code == "window_forward"]
                assert package_version("jaxlib") in fwd.message and "jaxlib>=" in fwd.action
    else:  # written by jax 0.10.2: jax 0.12 reads both (within 6 months of its jaxlib)
        for blob in (poly, concrete):
            for meta in (recorded, {}):
                assert judge(blob, jax_012, **meta).status == "ok", (blob.name, meta)
    # jax 0.10.2's corpus blobs, bare, for jax 0.12: ok or a warning, nothing blocking (with
    # the 4 devices sharded4 needs)
    for case in sorted((CORPUS / "jax-0.10.2").iterdir()):
        v = judge(case / "exported.bin", jax_012.replace(device_count=4))
        assert v.status in ("ok", "warn"), (case.name, str(v))
    # jax 0.6.2's, for jax 0.12: expired (schema 2), the flag as the first thing to do
    old = CORPUS / "jax-0.6.2" / "mlp" / "exported.bin"
    v = judge(old, jax_012)
    assert v.status == "incompatible" and v.codes() == ["expired"], str(v)
    (expired,) = v.reasons
    assert "serialization schema 2" in expired.message and "0.12.0.1 refuses" in expired.message
    assert f"{compat.EXPIRED_ENV}=1" in expired.action and "`jaxexp refresh`" in expired.action
    # with the flag set there: read, with a warning to refresh it while that lasts
    v = judge(old, jax_012.replace(reads_expired=True))
    assert v.status == "warn" and set(v.codes()) == {"expired", "window_backward"}, str(v)
    # and for jax 0.10.2 (no window enforced): read, only outside the promised window
    assert judge(old, jax_0102).codes() == ["window_backward"]


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


def _predict_corpus(case: Path, tmp_path: Path, *extra: str):
    out = tmp_path / "out.npz"
    args = ["predict", str(case / "exported.bin"), "--input", str(case / "inputs.npz")]
    return run_cli(*args, "--output", str(out), *extra), out


def _assert_reproduces(case: Path, out: Path) -> None:
    _, _, outputs = load_case(case)
    with np.load(out, allow_pickle=False) as data:
        for i, want in enumerate(outputs):
            np.testing.assert_allclose(data[f"out_{i}"], want, rtol=1e-5, atol=1e-6)


def test_predict_bare_blob_with_pytrees_matches_the_corpus(tmp_path):
    case = CORPUS / "jax-0.6.2" / "pytree_io"
    result, out = _predict_corpus(case, tmp_path)
    if corpus_refusals(case):  # jax >= 0.11.1 without its flag: refused before running
        assert corpus_refusals(case) == {"expired"}
        assert result.exit_code == 1 and not out.exists()
        err = result.stderr
        assert "[expired]" in err and "serialization schema 2" in err and "refuses" in err
        assert f"{compat.EXPIRED_ENV}=1" in err and "--allow-incompatible" in err
        return
    assert result.exit_code == 0, result.stderr
    _assert_reproduces(case, out)


def test_predict_expired_blob_with_the_flag_matches_the_corpus(tmp_path, expired_env):
    """The advice works: with jax's flag for expired blobs set, jax 0.6.2's blob runs and
    reproduces on every jax (older ones read it without the flag)."""
    case = CORPUS / "jax-0.6.2" / "pytree_io"
    assert not corpus_refusals(case, expired_flag=expired_env)
    result, out = _predict_corpus(case, tmp_path)
    assert result.exit_code == 0, result.stderr
    _assert_reproduces(case, out)


def test_predict_refuses_an_incompatible_blob_with_exit_1(tmp_path):
    case = CORPUS / "jax-0.4.35" / "linalg"
    result, out = _predict_corpus(case, tmp_path)
    assert result.exit_code == 1 and not out.exists()
    assert "[custom_calls]" in result.stderr and "--allow-incompatible" in result.stderr
    refused = corpus_refusals(case)
    if refused:  # jax >= 0.11.1 also refuses to read it without its flag
        assert "[expired]" in result.stderr and f"{compat.EXPIRED_ENV}=1" in result.stderr
    forced, out = _predict_corpus(case, tmp_path, "--allow-incompatible")  # tries anyway
    assert forced.exit_code == 1 and not out.exists()
    if refused:  # jax refuses to deserialize it, as the verdict said: a "no", with the advice
        assert "failed to load here" in forced.stderr and "could not deserialize" in forced.stderr
        assert "[expired]" in forced.stderr and f"{compat.EXPIRED_ENV}=1" in forced.stderr
    else:  # deserialized, and fails when called, as the verdict said
        assert "failed to run here" in forced.stderr and "blas_strsm" in forced.stderr


def test_predict_with_the_flag_still_refuses_a_removed_kernel(tmp_path, expired_env):
    """jax 0.4.35's linalg: the flag lets jax >= 0.11.1 read it, but its kernel is gone."""
    case = CORPUS / "jax-0.4.35" / "linalg"
    assert corpus_refusals(case, expired_flag=expired_env) == set()
    result, _ = _predict_corpus(case, tmp_path)
    assert result.exit_code == 1 and "[custom_calls]" in result.stderr
    assert "[expired]" not in result.stderr.split("(warning)")[0]  # only a warning now
    forced, out = _predict_corpus(case, tmp_path, "--allow-incompatible")
    assert forced.exit_code == 1 and not out.exists()
    assert "failed to run here" in forced.stderr and "blas_strsm" in forced.stderr


def test_predict_output_into_a_missing_directory_is_refused_before_running(store, tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((2, 4), np.float32))
    out = tmp_path / "nodir" / "y.npy"
    result = run_cli("predict", str(store["local"]), "--input", str(tmp_path / "x.npy"),
                     "--output", str(out))  # fmt: skip
    assert result.exit_code == 2, result.stderr
    assert "expected an existing directory" in result.stderr and "Error" not in result.stderr
    assert not out.parent.exists()


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
    damaged = run_cli("verify", str(copy))  # the MLmodel's digest of the file: damage
    assert damaged.exit_code == 2 and "does not match its recorded checksum" in damaged.stderr
    # the same values with their digest recorded: a reference the function no longer meets
    reseal_reference(copy)
    bad = run_cli("verify", str(copy), "--json")
    assert bad.exit_code == 1
    payload = json.loads(bad.stdout)
    assert payload["ok"] is False and payload["outputs"][0]["passed"] is False
    assert payload["outputs"][0]["max_abs_err"] == pytest.approx(1e-3, rel=1e-2)
    loose = run_cli("verify", str(copy), "--atol", "1e-2")
    assert loose.exit_code == 0 and "1e-05/0.01" in loose.output


@pytest.mark.parametrize("name", ["outputs.npz", "inputs.npz"])
def test_verify_a_cut_reference_is_a_damaged_artifact(store, tmp_path, name):
    """A reference file cut short is the archive's damage (exit 2, "damaged"), never "the
    model failed to run here" (exit 1, which says to refresh a model that is fine)."""
    copy = tmp_path / "model"
    shutil.copytree(store["local"], copy)
    ref = copy / "reference" / name
    ref.write_bytes(ref.read_bytes()[: ref.stat().st_size // 2])
    result = run_cli("verify", str(copy))
    assert result.exit_code == 2, (result.exit_code, result.stderr)
    assert "damaged" in result.stderr and "failed to run" not in result.stderr


def test_verify_bare_blob_is_an_input_error():
    result = run_cli("verify", str(CORPUS / "jax-0.8.3" / "mlp" / "exported.bin"))
    assert result.exit_code == 2 and "no reference" in result.stderr


def test_verify_console_script_quiet_off_a_terminal(store):
    env = {"MLFLOW_TRACKING_URI": store["uri"]}
    result = run_script("verify", "models:/mlp@best", env=env)
    assert result.returncode == 0, result.stderr
    assert "pass" in result.stdout
    assert result.stderr == ""  # no progress, no library chatter when not a terminal
    # forced on where stderr is no terminal (click's runner, in this process)
    forced = run_cli("verify", "models:/mlp@best", "--json", env={"JAXEXP_PROGRESS": "1"})
    assert forced.exit_code == 0
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


def test_log_console_script_prints_no_library_chatter(store, tmp_path):
    """MLflow's INFO log lines (a new experiment) stay off without --debug: the command says
    what it did itself. (MLflow prints "Successfully registered model" itself, not through
    logging: that line stays.)"""
    case = CORPUS / "jax-0.8.3" / "mlp"
    env = {"MLFLOW_TRACKING_URI": store["uri"]}
    args = ("log", str(case / "exported.bin"), "--input-example", str(case / "inputs.npz"),
            "--experiment", "quiet-new", "--register", "quiet")  # fmt: skip
    result = run_script(*args, env=env)
    assert result.returncode == 0, result.stderr
    assert "models:/quiet/1" in result.stdout
    assert " INFO " not in result.stderr and "Creating" not in result.stderr, result.stderr


def test_verify_an_expired_model_with_and_without_the_flag(store, expired_env, monkeypatch):
    """A jax 0.6.2 blob logged where jax reads it (with the flag on jax >= 0.11.1) reproduces;
    without the flag jax >= 0.11.1 refuses it before running, saying to set the flag, and
    --allow-incompatible then fails as judged (exit 1), not as an input error."""
    case = CORPUS / "jax-0.6.2" / "mlp"
    args = ["--input-example", str(case / "inputs.npz"), "--experiment", "expired", "--json"]
    logged = run_cli("log", str(case / "exported.bin"), *args)
    assert logged.exit_code == 0, logged.stderr
    uri = json.loads(logged.stdout)["runs_uri"]
    ok = run_cli("verify", uri, "--json")
    assert ok.exit_code == 0, ok.stderr
    assert json.loads(ok.stdout)["outputs"][0]["passed"] is True
    if not expired_env:  # jax < 0.11.1 reads it without any flag: nothing more to refuse
        return
    jax.config.update(compat.EXPIRED_FLAG, False)  # the user without the flag
    monkeypatch.delenv(compat.EXPIRED_ENV)
    refused = run_cli("verify", uri)
    assert refused.exit_code == 1 and "[expired]" in refused.stderr
    assert f"{compat.EXPIRED_ENV}=1" in refused.stderr and "--allow-incompatible" in refused.stderr
    forced = run_cli("verify", uri, "--allow-incompatible")
    assert forced.exit_code == 1 and "failed to load here" in forced.stderr
    assert f"{compat.EXPIRED_ENV}=1" in forced.stderr


def test_log_blob_with_orbax_params_into_an_existing_run(store, tmp_path):
    from jaxexp_mlflow.params import save_params

    params = store["params"]
    blob = tmp_path / "mlp.bin"
    blob.write_bytes(bytes(export_mlp(params).serialize()))
    save_params(params, tmp_path / "ckpt")
    np.savez(tmp_path / "x.npz", in_0=store["x"])
    without = run_cli("log", str(blob), "--input-example", str(tmp_path / "x.npz"))
    assert without.exit_code == 2 and "pass them with --params ORBAX_DIR" in without.stderr
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
    assert "Route        direct" in result.output  # the help's promise: the route, every time
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


# -- serve: refusals before the model loads ------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--model-config", "{bad"], "not JSON"),
        (["--model-config", "[1]"], "found a JSON list"),
        (["--model-config", '{"buckets": "bogus"}'], "a list of positive integers"),
        (["--model-config", '{"max_batch": "big"}'], "max_batch: expected a positive integer"),
        (["--model-config", '{"bukets": "off"}'], "found 'bukets'"),
    ],
)
def test_serve_refuses_a_bad_model_config_before_loading(args, says):
    result = run_cli("serve", "-m", "/nonexistent/model", *args)
    assert result.exit_code == 2, (result.exit_code, result.stderr)
    assert says in result.stderr and "Traceback" not in result.stderr


def test_serve_refuses_a_port_in_use_before_loading():
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = run_cli("serve", "-m", "/nonexistent/model", "-p", str(port))
    assert result.exit_code == 2, (result.exit_code, result.stderr)
    assert f"127.0.0.1:{port} in use" in result.stderr


def test_refresh_refuses_what_is_no_model_in_the_words_of_the_other_commands(tmp_path):
    missing = run_cli("refresh", str(tmp_path / "nosuch"))
    assert missing.exit_code == 2 and "no such file or directory, and not a model URI" in (
        missing.stderr
    )
    blob = tmp_path / "b.bin"
    blob.write_bytes(bytes(export_mlp(mlp_params()).serialize()))
    bare = run_cli("refresh", str(blob))
    assert bare.exit_code == 2 and "log it first with `jaxexp log`" in bare.stderr


@pytest.mark.parametrize(
    ("route", "why"),
    [
        ("expired-flag", "nothing keeps this jax from loading the model as it is"),
        ("iree", "asked for with --backend iree"),
    ],
)
def test_a_route_that_does_not_work_says_why(store, tmp_path, route, why):
    np.save(tmp_path / "x.npy", store["x"])
    result = run_cli("predict", str(store["local"]), "--input", str(tmp_path / "x.npy"),
                     "--route", route)  # fmt: skip
    assert result.exit_code == 1 and why in result.stderr, result.stderr


def test_inspect_a_cut_blob_names_its_checksum(store, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(store["local"], copy)
    blob = copy / "exported.bin"
    blob.write_bytes(blob.read_bytes()[: blob.stat().st_size // 2])
    result = run_cli("inspect", str(copy))
    assert result.exit_code == 2
    assert "does not match the sha256 recorded in MLmodel" in result.stderr, result.stderr


def test_an_artifact_store_client_error_is_one_typed_line(tmp_path):
    """botocore's own errors (here: no credentials) read as "cannot fetch URI", exit 2."""
    pytest.importorskip("boto3")
    env = {
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_ACCESS_KEY_ID": None,
        "AWS_SECRET_ACCESS_KEY": None,
        "AWS_SESSION_TOKEN": None,
        "MLFLOW_S3_ENDPOINT_URL": None,
    }
    result = run_cli("inspect", "s3://no-such-bucket/model", env=env)
    assert result.exit_code == 2, result.stderr
    assert result.stderr.startswith("jaxexp inspect: error: cannot fetch s3://no-such-bucket/model")


def test_verify_refuses_options_it_would_ignore(store):
    negative = run_cli("verify", str(store["local"]), "--rtol", "-1")
    assert negative.exit_code == 2 and "--rtol" in negative.stderr
    alone = run_cli("verify", str(store["local"]), "--trust-requirements")
    assert alone.exit_code == 2 and "pass --env-manager" in alone.stderr, alone.stderr


def test_predict_and_verify_label_outputs_alike(store, tmp_path):
    np.save(tmp_path / "x.npy", store["x"])
    predicted = json.loads(
        run_cli("predict", str(store["local"]), "--input", str(tmp_path / "x.npy"), "--json").stdout
    )
    verified = json.loads(run_cli("verify", str(store["local"]), "--json").stdout)
    labels = [o["path"] for o in predicted["outputs"]]
    assert labels == [o["path"] for o in verified["outputs"]] and labels


def test_a_model_whose_upload_was_cut_says_to_log_it_again(store):
    """A logged model holding its params but no MLmodel (an upload cut off with the server):
    both the loader and the CLI say what it is and what to do, not "download again" or "no
    such model"."""
    from urllib.parse import urlparse

    from jaxexp_mlflow.errors import ArtifactError

    params = store["params"]
    info = mlflow.jaxexp.log_model(
        export_mlp(params), name="cut", params=params, input_example=store["x"]
    )
    where = Path(urlparse(mlflow.get_logged_model(info.model_id).artifact_location).path)
    for name in ("MLmodel", "exported.bin"):
        (where / name).unlink()
    uri = f"models:/{info.model_id}"
    with pytest.raises(ArtifactError, match="upload was cut off or never finished"):
        mlflow.jaxexp.load_model(uri)
    result = run_cli("inspect", uri)
    assert result.exit_code == 2 and "upload was cut off has its params" in result.stderr, (
        result.stderr
    )
