"""``jaxexp verify --env-manager``: a model logged under jax 0.6.2 (in its own venv), verified
from the running jax in an environment MLflow restores from the model's requirements."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest
from click.testing import CliRunner

from jaxexp_mlflow.archive.recorded_env import RecordedEnvError, requirements, run_recorded
from jaxexp_mlflow.cli import main
from tests.conftest import result_of, sqlite_uri

REPO = Path(__file__).resolve().parents[2]
UV = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))

LOG_UNDER_OLD_JAX = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, mlflow, numpy as np
    import jaxexp_mlflow
    sys.path.insert(0, sys.argv[2])
    from tests.models import batch, export_mlp, mlp_params

    mlflow.set_tracking_uri(sys.argv[1])
    params = mlp_params()
    with mlflow.start_run():
        info = mlflow.jaxexp.log_model(
            export_mlp(params), name="m", params=params, input_example=batch(3)
        )
    print("RESULT " + json.dumps({"uri": info.model_uri, "jax": jax.__version__}))
    """
)


@pytest.mark.slow
def test_model_logged_under_jax_0_6_2_verified_in_its_recorded_env(tmp_path, monkeypatch):
    if not Path(UV).exists():
        pytest.skip("uv is not installed (pip install uv)")
    venv = tmp_path / "venv-0.6.2"
    subprocess.run([UV, "venv", "-q", str(venv), "--python", sys.executable], check=True)
    py = venv / "bin" / "python"
    pins = ["jax==0.6.2", "jaxlib==0.6.2", "mlflow==3.17.2", "orbax-checkpoint==0.12.8"]
    subprocess.run(
        [UV, "pip", "install", "-q", "-p", str(py), *pins, str(REPO)], check=True, timeout=900
    )
    uri = sqlite_uri(tmp_path / "mlflow.db")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    proc = subprocess.run(
        [str(py), "-c", LOG_UNDER_OLD_JAX, uri, str(REPO)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    logged = result_of(proc)
    assert logged["jax"] == "0.6.2"

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    result = CliRunner().invoke(
        main, ["verify", logged["uri"], "--env-manager", "uv", "--json"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["saved_with"]["jax_version"] == "0.6.2"
    rec = doc["recorded_environment"]
    assert rec["jax_version"] == "0.6.2" and rec["jaxlib_version"] == "0.6.2"
    assert "jax==0.6.2" in rec["requirements"] and rec["reproduces"] is True
    assert doc["environment"]["jax_version"] == jax.__version__ and doc["ok"] is True
    # the stored reference was computed by jax 0.6.2 itself: the old env reproduces it bit for
    # bit; this jax within tolerance
    assert doc["recorded_vs_stored"][0]["max_abs_err"] == 0.0
    assert doc["here_vs_stored"][0]["passed"] and doc["here_vs_recorded"][0]["passed"]

    text = CliRunner().invoke(main, ["verify", logged["uri"], "--env-manager", "uv"])
    assert "Recorded  jax 0.6.2 / jaxlib 0.6.2" in text.stdout
    assert "recorded env vs stored" in text.stdout and "Reproduced in the recorded" in text.stdout


def test_recorded_env_errors_are_typed(tmp_path):
    (tmp_path / "requirements.txt").write_text(
        "# pinned\njax==0.6.2  # exporter\n\njaxlib==0.6.2\n"
    )
    assert requirements(tmp_path) == ["jax==0.6.2", "jaxlib==0.6.2"]
    with pytest.raises(RecordedEnvError, match="must be one of uv, virtualenv"):
        run_recorded(tmp_path, "conda")
    with pytest.raises(RecordedEnvError, match="Could not build the model's recorded environment"):
        run_recorded(tmp_path / "missing", "uv")


def test_a_child_without_a_result_is_a_typed_refusal_quoting_its_stderr(tmp_path):
    """Both routes into another environment (the recorded one, a jax bridge) read the child's
    result.json the same way: present, it is the result; absent, the refusal says the exit code
    and the end of the child's stderr."""
    import subprocess
    import sys

    from jaxexp_mlflow.archive.recorded_env import RecordedEnvError, read_child_result

    code = "import sys; sys.stderr.write('x' * 5000 + ' the child broke here'); sys.exit(3)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    with pytest.raises(RecordedEnvError) as err:
        read_child_result(tmp_path, proc, who="The runner", advice=" Do this.")
    message = str(err.value)
    assert "exited with code 3" in message and message.endswith("Expected result.json. Do this.")
    assert "the child broke here" in message and len(message) < 1000
    (tmp_path / "result.json").write_text('{"python": "3.11"}')
    assert read_child_result(tmp_path, proc, who="The runner") == {"python": "3.11"}
