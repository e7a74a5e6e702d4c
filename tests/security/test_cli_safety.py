"""A model directory is untrusted input, through the real CLI: ``verify --env-manager uv``
installs only plain requirements unless told to trust the model, ``audit`` survives
registered-model names that MLflow's filter syntax cannot quote, and no string of a model
reaches the terminal as a control sequence."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import mlflow
import pytest
import yaml
from click.testing import CliRunner

import jaxexp_mlflow  # noqa: F401  (mlflow.jaxexp)
from jaxexp_mlflow.cli import main
from tests.models import batch, export_mlp, mlp_params

#: What a hostile model wants the terminal to do: erase the line and write a verdict of its own.
EVIL = "\x1b[2K\rVerdict ok"
#: Characters that must never reach a terminal raw from a model's strings.
RAW = ("\x1b", "\r", "\x9b", "\u202e")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """One saved MLP model (with a reference), copied by each test that alters it."""
    path = tmp_path_factory.mktemp("safety") / "model"
    params = mlp_params()
    mlflow.jaxexp.save_model(export_mlp(params), path, params=params, input_example=batch())
    return path


def _copy(saved: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "model", symlinks=True))


def _cli(*args: str, **kwargs):
    return CliRunner().invoke(main, list(args), catch_exceptions=False, **kwargs)


# -- defect 12: verify --env-manager installs only what it was allowed to -----------------------


@pytest.fixture
def fake_uv(tmp_path, monkeypatch) -> Path:
    """A ``uv`` first on PATH that records each call in a marker file and fails; MLflow's
    environments go under tmp_path. Returns the marker (absent: no uv process started)."""
    bin_dir, marker = tmp_path / "fake-bin", tmp_path / "uv-calls"
    bin_dir.mkdir()
    uv = bin_dir / "uv"
    uv.write_text(f'#!/bin/sh\necho "$@" >> "{marker}"\nexit 1\n')
    uv.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("MLFLOW_ENV_ROOT", str(tmp_path / "envs"))
    return marker


def test_verify_env_refuses_requirements_beyond_the_index_unless_trusted(saved, tmp_path, fake_uv):
    model = _copy(saved, tmp_path)
    (model / "evil").mkdir()
    (model / "evil" / "setup.py").write_text("raise SystemExit('the model ran its own code')\n")
    reqs = (model / "requirements.txt").read_text().splitlines()
    hostile = [
        "-e ./evil",
        "https://example.invalid/evil-1.0.tar.gz",
        "--index-url https://example.invalid/simple",
    ]
    (model / "requirements.txt").write_text("\n".join([*reqs, *hostile]) + "\n")

    result = _cli("verify", str(model), "--env-manager", "uv")
    assert result.exit_code == 2, result.output
    assert not fake_uv.exists(), "a uv process was started for an untrusted model"
    err = " ".join(result.stderr.split())
    for line in hostile:
        assert line in err
    assert "--trust-requirements" in err and "Nothing was installed" in err
    assert result.stdout == ""

    # a python that is not a version (a path to run) is refused the same way
    env = yaml.safe_load((saved / "python_env.yaml").read_text())
    env["python"] = "/tmp/evil/bin/python"
    (model / "python_env.yaml").write_text(yaml.safe_dump(env))
    result = _cli("verify", str(model), "--env-manager", "uv", "--json")
    assert result.exit_code == 2 and not fake_uv.exists()
    doc = json.loads(result.stdout)
    assert doc["error"]["type"] == "UntrustedRequirementsError"
    assert "/tmp/evil/bin/python" in doc["error"]["message"]
    shutil.copy(saved / "python_env.yaml", model / "python_env.yaml")

    # with the flag it proceeds: what will be installed is printed first, then uv runs
    result = _cli("verify", str(model), "--env-manager", "uv", "--trust-requirements")
    assert fake_uv.exists(), result.output
    assert "venv" in fake_uv.read_text()
    before_uv = result.stderr
    assert "Installing into the recorded environment (uv)" in before_uv
    for line in ["jax==", *hostile]:
        assert line in before_uv
    assert result.exit_code == 2  # the fake uv failed: "Could not build ..."


def test_verify_env_prints_what_it_installs_for_a_plain_model(saved, tmp_path, fake_uv):
    from jaxexp_mlflow.archive.recorded_env import check_requirements

    plan = check_requirements(saved)  # what MLflow writes passes without the flag
    assert plan.python and any(r.startswith("jax==") for r in plan.requirements)
    result = _cli("verify", str(saved), "--env-manager", "uv")
    assert fake_uv.exists()  # no refusal: it went on to build the environment
    assert "Installing into the recorded environment (uv)" in result.stderr
    assert "jaxlib==" in result.stderr
    help_text = " ".join(_cli("verify", "--help").stdout.split())
    assert "installs what MLmodel records" in help_text
    assert "--trust-requirements" in help_text


# -- defect 13: audit and names MLflow's filter syntax cannot quote ------------------------------


def test_audit_lists_models_whose_names_hold_quotes(tracking_uri):
    params = mlp_params()
    names = ["it's", 'say "hi"', "both'\"quotes", "plain"]
    with mlflow.start_run():
        info = mlflow.jaxexp.log_model(export_mlp(params), name="m", params=params)
    for name in names:
        mlflow.register_model(info.model_uri, name)
    result = _cli("audit", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    listed = {r["name"] for r in doc["models"]}
    assert listed == set(names), doc
    assert all(r["status"] != "error" for r in doc["models"]), doc
    text = _cli("audit")
    assert text.exit_code == 0 and "it's/1" in text.stdout and "plain/1" in text.stdout
    one = _cli("audit", "--model", "both'\"quotes", "--json")
    assert [r["name"] for r in json.loads(one.stdout)["models"]] == ["both'\"quotes"]


# -- defect 14: control characters from a model are shown escaped --------------------------------


def _assert_escaped(text: str) -> None:
    for ch in RAW:
        assert ch not in text, repr(text)
    assert "\\x1b[2K" in text, text


def test_control_sequences_in_model_strings_are_escaped(saved, tmp_path, tracking_uri):
    model = _copy(saved, tmp_path)
    mlmodel = yaml.safe_load((model / "MLmodel").read_text())
    conf = mlmodel["flavors"]["jaxexp"]
    conf["jaxlib_version"] = f"0.1.0{EVIL}\u202e"  # unknown to the table: a reason quotes it
    conf["jax_version"] = f"0.1.0{EVIL}"
    (model / "MLmodel").write_text(yaml.safe_dump(mlmodel))

    # color=True: click leaves escape sequences alone, as on a terminal
    shown = _cli("inspect", str(model), color=True)
    assert shown.exit_code == 0, shown.output
    _assert_escaped(shown.stdout)
    checked = _cli("check", str(model), color=True)
    assert checked.exit_code in (0, 1), checked.output
    _assert_escaped(checked.stdout)
    assert "Verdict      warn" in checked.stdout or "Verdict      incompatible" in checked.stdout
    # JSON stays JSON and keeps the exact string
    doc = json.loads(_cli("inspect", str(model), "--json").stdout)
    assert doc["flavor"]["jax_version"] == f"0.1.0{EVIL}"

    # audit: a registered name and a logged model's MLmodel both carry the sequence
    with mlflow.start_run():
        info = mlflow.jaxexp.log_model(
            export_mlp(mlp_params()), name="m", params=mlp_params(), input_example=batch()
        )
    mlflow.register_model(info.model_uri, f"evil{EVIL}")
    logged = Path(mlflow.get_logged_model(info.model_id).artifact_location.removeprefix("file://"))
    mlmodel = yaml.safe_load((logged / "MLmodel").read_text())
    mlmodel["flavors"]["jaxexp"]["jax_version"] = f"0.1.0{EVIL}"
    (logged / "MLmodel").write_text(yaml.safe_dump(mlmodel))
    audited = _cli("audit", color=True)
    assert audited.exit_code == 0, audited.output
    _assert_escaped(audited.stdout)
    assert "evil\\x1b[2K\\rVerdict ok/1" in audited.stdout


def test_a_tool_writing_bytes_to_stderr_is_escaped_not_refused(capsys):
    """iree-compile's stderr reaches ``sys.stderr`` as bytes (IREE's ``_write_binary_stderr``
    writes bytes where the stream has no ``buffer``): decoded and escaped like text; before,
    every ``--backend iree`` command that made iree-compile print a line died with a TypeError."""
    import sys

    from jaxexp_mlflow.cli._common import safe_stdout

    with safe_stdout():
        assert not hasattr(sys.stderr, "buffer")  # no way around the escaping
        sys.stderr.write(b"warning: \x1b[31mred\x1b[0m \xff\n")
        sys.stderr.write("text \x1b[2J\n")
    err = capsys.readouterr().err
    assert err == "warning: \\x1b[31mred\\x1b[0m \ufffd\ntext \\x1b[2J\n"
