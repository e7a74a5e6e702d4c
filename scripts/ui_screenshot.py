"""Screenshot of a logged jaxexp model's page in the MLflow UI (headless Chromium).

Starts ``mlflow server`` on 127.0.0.1 (sqlite store in a temporary directory), logs the small MLP
through it, and saves the model page (where the ``jax.*`` params show) as a PNG:

    python scripts/ui_screenshot.py docs/mlflow_ui_model_page.png

Needs Debian's ``chromium`` (``apt-get install -y chromium``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(out: str) -> int:
    import jax
    import mlflow

    import jaxexp_mlflow  # noqa: F401

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.models import batch, mlp_apply, mlp_params

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        print("chromium is not installed (apt-get install -y chromium)", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="jaxexp-ui-"))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    mlflow_bin = str(Path(sys.executable).parent / "mlflow")
    server = subprocess.Popen(
        [mlflow_bin, "server", "--host", "127.0.0.1", "--port", str(port)]
        + ["--backend-store-uri", f"sqlite:///{tmp / 'mlflow.db'}"]
        + ["--default-artifact-root", (tmp / "artifacts").as_uri()],
        stdout=(tmp / "server.log").open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if requests.get(f"{url}/health", timeout=5).ok:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.5)
        mlflow.set_tracking_uri(url)
        exp_id = mlflow.create_experiment("jaxexp-ui")
        with mlflow.start_run(experiment_id=exp_id):
            info = mlflow.jaxexp.log_model(
                jax.jit(mlp_apply), name="mlp", params=mlp_params(), input_example=batch(2)
            )
        page = f"{url}/#/experiments/{exp_id}/models/{info.model_id}"
        print(page)
        subprocess.run(
            [browser, "--headless", "--no-sandbox", "--disable-gpu"]
            + ["--disable-background-networking", "--disable-component-update", "--no-first-run"]
            + ["--hide-scrollbars", "--window-size=1280,1500", "--virtual-time-budget=20000"]
            + [f"--screenshot={os.path.abspath(out)}", page],
            check=True,
            capture_output=True,
            timeout=180,
        )
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "mlflow_ui_model_page.png"))
