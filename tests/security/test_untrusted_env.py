"""``jaxexp verify --env-manager`` builds the recorded environment from MLmodel's
facts, in a directory holding no file of the model; nothing the model's requirements add is
installed without ``--trust-requirements``, and no fallback reads another file.

The ``uv`` first on PATH here records each call (its arguments, its working directory and what
that directory holds) and fails, so each test sees exactly what would have been installed, and
from where, without installing anything."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

import jaxexp_mlflow  # noqa: F401  (mlflow.jaxexp)
from jaxexp_mlflow.archive.recorded_env import UntrustedRequirementsError, check_requirements
from jaxexp_mlflow.cli import main


@pytest.fixture
def model(mlp_copy) -> Path:
    """The tests' MLP, a copy of its own for each test to alter (``conftest.mlp_copy``)."""
    return mlp_copy


@pytest.fixture
def uv_calls(tmp_path, monkeypatch) -> Path:
    """A ``uv`` that records each call (args, working directory, what that directory holds);
    ``uv venv DIR`` makes an empty ``DIR/bin/activate`` and succeeds, everything else fails."""
    bin_dir, log = tmp_path / "fake-bin", tmp_path / "uv-calls"
    bin_dir.mkdir()
    uv = bin_dir / "uv"
    uv.write_text(
        "#!/bin/sh\n"
        f'{{ echo "ARGS $*"; echo "CWD $(pwd -P)"; echo "LS" $(ls -A); }} >> "{log}"\n'
        'if [ "$1" = venv ]; then mkdir -p "$2/bin" && touch "$2/bin/activate"; exit 0; fi\n'
        "exit 1\n"
    )
    uv.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("JAXEXP_ENVS_DIR", str(tmp_path / "envs"))
    monkeypatch.setenv("MLFLOW_ENV_ROOT", str(tmp_path / "mlflow-envs"))
    return log


def _cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _calls(log: Path) -> list[dict[str, str]]:
    calls: list[dict[str, str]] = []
    for line in log.read_text().splitlines() if log.exists() else []:
        key, _, value = line.partition(" ")
        if key == "ARGS":
            calls.append({})
        calls[-1][key] = value
    return calls


def _versions(model: Path) -> dict:
    doc = yaml.safe_load((model / "MLmodel").read_text())
    return {
        "jax": doc["flavors"]["jaxexp"]["jax_version"],
        "python": doc["flavors"]["python_function"]["python_version"],
    }


def test_a_comment_ending_in_backslash_hides_no_line(model, uv_calls):
    reqs = (model / "requirements.txt").read_text()
    (model / "evilpkg").mkdir()
    (model / "evilpkg" / "setup.py").write_text("raise SystemExit('ran')\n")
    (model / "requirements.txt").write_text(reqs.rstrip() + "\n# pinned \\\n-e ./evilpkg\n")
    with pytest.raises(UntrustedRequirementsError, match=r"-e \./evilpkg"):
        check_requirements(model)
    result = _cli("verify", str(model), "--env-manager", "uv")
    assert result.exit_code == 2 and not uv_calls.exists(), result.output
    assert "# pinned \\" in result.stderr and "comment ending in" in result.stderr


@pytest.mark.parametrize("name", ["evil.tar.lzma", "evil.tar.lz", "evil.tlz", "evil.tar.zst"])
def test_archives_of_every_suffix_are_local_files(model, name):
    reqs = (model / "requirements.txt").read_text()
    (model / "requirements.txt").write_text(reqs.rstrip() + f"\n{name}\n")
    with pytest.raises(UntrustedRequirementsError, match="a local archive"):
        check_requirements(model)


def test_the_environment_is_written_from_mlmodel_and_built_away_from_the_model(model, uv_calls):
    """A ``uv.toml`` / ``pyproject.toml [tool.uv]`` in the model and a plain extra requirement:
    uv never runs among the model's files, and the extra is shown, not installed."""
    (model / "wheels").mkdir()
    (model / "uv.toml").write_text('[pip]\nfind-links = ["wheels"]\n')
    (model / "pyproject.toml").write_text('[tool.uv]\nindex-url = "https://example.invalid"\n')
    reqs = (model / "requirements.txt").read_text()
    (model / "requirements.txt").write_text(reqs.rstrip() + "\nevilpkg==0.1\n")
    facts = _versions(model)

    result = _cli("verify", str(model), "--env-manager", "uv")
    assert result.exit_code == 2, result.output  # the fake uv fails: "Could not build"
    calls = _calls(uv_calls)
    assert calls, result.output
    for call in calls:
        assert "evilpkg" not in call["ARGS"], call
        cwd = Path(call["CWD"])
        assert not cwd.is_relative_to(model.resolve()) and call["LS"] == "", call
    assert f"--python {facts['python']}" in calls[0]["ARGS"]
    assert "NOT installed" in result.stderr and "evilpkg==0.1" in result.stderr
    assert f"jax=={facts['jax']}" in result.stderr

    uv_calls.unlink()
    trusted = _cli("verify", str(model), "--env-manager", "uv", "--trust-requirements")
    assert trusted.exit_code == 2
    assert "installed as written because --trust-requirements" in trusted.stderr
    installs = [c for c in _calls(uv_calls) if c["ARGS"].startswith("pip install")]
    assert installs and "evilpkg==0.1" in installs[0]["ARGS"]
    assert Path(installs[0]["CWD"]) == model.resolve()  # as written: relative to the model


def test_no_fallback_reads_a_file_the_check_did_not(model, uv_calls):
    """MLmodel points MLflow's env at ``env2.yaml`` (an uninstallable requirement) while an
    unchecked ``requirements.txt`` names a local file: neither reaches the installer, in the
    first build or in the one without jaxexp-mlflow."""
    doc = yaml.safe_load((model / "MLmodel").read_text())
    doc["flavors"]["python_function"]["env"] = {"virtualenv": "env2.yaml", "conda": "conda.yaml"}
    (model / "MLmodel").write_text(yaml.safe_dump(doc))
    (model / "env2.yaml").write_text(
        yaml.safe_dump({"python": _versions(model)["python"], "dependencies": ["nosuchpkg==9.9"]})
    )
    (model / "requirements.txt").write_text("evilpkg @ file:///tmp/evilpkg\n")
    result = _cli("verify", str(model), "--env-manager", "uv")
    assert result.exit_code == 2, result.output
    calls = _calls(uv_calls)
    assert calls
    for call in calls:
        assert "evilpkg" not in call["ARGS"] and "file://" not in call["ARGS"], call
        assert "nosuchpkg" not in call["ARGS"], call
        assert call["LS"] == "", call  # no requirements file of the model's (or a copy) at hand


@pytest.mark.parametrize(
    ("where", "value"),
    [("jax_version", "0.4.1\x1b[2K\rVerdict ok"), ("jaxlib_version", "0.4 ; evil @ file:///x")],
)
def test_a_recorded_version_that_is_not_a_release_is_refused(model, uv_calls, where, value):
    doc = yaml.safe_load((model / "MLmodel").read_text())
    doc["flavors"]["jaxexp"][where] = value
    (model / "MLmodel").write_text(yaml.safe_dump(doc))
    result = _cli("verify", str(model), "--env-manager", "uv", "--json", "--trust-requirements")
    assert result.exit_code == 2 and not uv_calls.exists(), result.output
    err = json.loads(result.stdout)["error"]
    assert err["type"] == "UntrustedRequirementsError" and where in err["message"]
