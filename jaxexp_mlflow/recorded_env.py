"""Re-run a model's reference in the environment it was logged with.

MLflow records the exact requirements of a logged model (``requirements.txt``,
``python_env.yaml``: the exporter's jax and jaxlib among them). :func:`run_recorded` restores that
environment with MLflow's own machinery, as ``mlflow models predict --env-manager`` does
(``PyFuncBackend.prepare_env``: ``uv`` or ``virtualenv``, cached under MLflow's environment root
and reused), and runs the stored reference input there with the jaxexp-mlflow copy the model
carries in ``code/`` (``_env_runner.py``). ``jaxexp verify --env-manager`` puts that run, the
stored reference and the current environment side by side.
"""

from __future__ import annotations

import json
import os
import shlex
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jaxexp_mlflow.errors import JaxExpError

RUNNER = Path(__file__).with_name("_env_runner.py")
ENV_MANAGERS = ("uv", "virtualenv")


class RecordedEnvError(JaxExpError):
    """The recorded environment could not be built, or the model did not run in it."""


@dataclass
class RecordedRun:
    """What the model gave in its recorded environment."""

    env_manager: str
    requirements: list[str]
    python: str | None = None
    jax_version: str | None = None
    jaxlib_version: str | None = None
    outputs: list[np.ndarray] | None = None
    error: str | None = None
    seconds: float | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """``jax 0.6.2 / jaxlib 0.6.2, python 3.11.7 (uv)``."""
        return (
            f"jax {self.jax_version} / jaxlib {self.jaxlib_version}, python {self.python} "
            f"({self.env_manager} environment from the model's requirements)"
        )


def requirements(local_path: str | Path) -> list[str]:
    """The model's recorded pip requirements (``requirements.txt``), comments dropped."""
    from jaxexp_mlflow.codec import files

    if not os.path.lexists(Path(local_path, "requirements.txt")):
        return []
    text = files.read_bytes(
        local_path, "requirements.txt", what="requirements.txt", max_bytes=1 << 20
    ).decode("utf-8", "replace")
    lines = (ln.split("#")[0].strip() for ln in text.splitlines())
    return [ln for ln in lines if ln]


def run_recorded(
    local_path: str | Path,
    env_manager: str = "uv",
    *,
    env_root_dir: str | None = None,
    capture_output: bool = True,
) -> RecordedRun:
    """Build (or reuse) the model's recorded environment and run its reference input there.

    Raises :class:`RecordedEnvError` if the environment cannot be built (e.g. ``virtualenv``
    without pyenv, ``uv`` missing, a pinned version not on the index); a model that fails to
    run inside the environment is returned with ``error`` set.
    """
    from mlflow.exceptions import MlflowException
    from mlflow.pyfunc.backend import PyFuncBackend

    from jaxexp_mlflow.reproduce import decode_outputs

    if env_manager not in ENV_MANAGERS:
        raise RecordedEnvError(
            f"--env-manager must be one of {', '.join(ENV_MANAGERS)}, got {env_manager!r}."
        )
    local = Path(local_path).resolve()
    run = RecordedRun(env_manager, requirements(local))
    backend = PyFuncBackend(
        config={}, env_manager=env_manager, install_mlflow=False, env_root_dir=env_root_dir
    )
    try:
        environment = backend.prepare_env(str(local), capture_output=capture_output)
    except (MlflowException, Exception) as err:  # noqa: BLE001 - MLflow raises plain Exception
        raise RecordedEnvError(
            f"Could not build the model's recorded environment with {env_manager} "
            f"(requirements {run.requirements}): {' '.join(str(err).split())[:800]}. "
            + (
                "MLflow's virtualenv manager needs pyenv to install the recorded Python; "
                "try --env-manager uv."
                if env_manager == "virtualenv"
                else "Is `uv` installed (pip install uv) and the package index reachable?"
            )
        ) from err
    with tempfile.TemporaryDirectory(prefix="jaxexp-env-") as out:
        cmd = " ".join(shlex.quote(str(x)) for x in ("python", RUNNER, local, out))
        try:
            environment.execute(cmd, capture_output=capture_output)
        except Exception as err:  # noqa: BLE001 - the runner itself failed to start
            raise RecordedEnvError(f"The runner failed in the recorded environment: {err}") from err
        result = json.loads(Path(out, "result.json").read_text())
        run.details = result
        run.python = result.get("python")
        run.jax_version, run.jaxlib_version = (
            result.get("jax_version"),
            result.get("jaxlib_version"),
        )
        run.error, run.seconds = result.get("error"), result.get("seconds")
        if run.error is None:
            with np.load(Path(out, "outputs.npz"), allow_pickle=False) as data:
                raw = [data[f"out_{i}"] for i in range(len(result["output_dtypes"]))]
            run.outputs = decode_outputs(raw, result["output_dtypes"])
    return run
