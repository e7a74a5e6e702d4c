"""Build a virtual environment from a requirement list the product wrote (``env_facts``), away
from any model file.

The installer (``uv``, or ``venv`` + ``pip`` for ``--env-manager virtualenv``) runs in an empty
directory under the user's cache, so the configuration it reads is the user's alone (their
``uv.toml`` / ``pip.conf``, ``UV_*`` / ``PIP_*`` variables, the user's index): a ``uv.toml`` or
``pyproject.toml [tool.uv]`` in a model is never discovered, because no model file lies in or
above that directory. The requirements are command-line arguments, never a file of the model.

An environment is cached under ``<cache>/recorded/<manager>-py<python>-<hash of the list>/``,
built in a sibling temporary directory and renamed into place once the install succeeded (a
half-built environment is never reused). ``<cache>`` is ``jax_envs.cache_dir()``. An
environment with requirements the user chose to trust (``trusted_args``) is built in the
caller's directory and never cached.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxexp_mlflow.errors import JaxExpError

MARKER = "jaxexp-recorded-env.json"
#: How long one install may take (a cold cache downloads jaxlib, mlflow and their dependencies).
INSTALL_TIMEOUT = 1800


class EnvBuildError(JaxExpError):
    """The environment could not be built (no interpreter, no index, the installer failed)."""


def cache_root() -> Path:
    """Where recorded environments are cached: ``<jax_envs cache>/recorded``."""
    from jaxexp_mlflow.archive import jax_envs

    return jax_envs.cache_dir() / "recorded"


def python_of(env: Path) -> Path:
    """The environment's interpreter."""
    return env / "bin" / "python"


def env_path(
    env_manager: str, python: str | None, requirements: list[str], root: Path | None = None
) -> Path:
    """The cache directory of the environment these arguments build (under ``root``, default
    :func:`cache_root`)."""
    key = json.dumps([env_manager, python, requirements])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return (root or cache_root()) / f"{env_manager}-py{python or 'here'}-{digest}"


def cached(
    env_manager: str, python: str | None, requirements: list[str], root: Path | None = None
) -> Path | None:
    """The interpreter of the cached environment for these arguments, if it was built whole."""
    target = env_path(env_manager, python, requirements, root)
    return python_of(target) if (target / MARKER).is_file() and python_of(target).exists() else None


def _child_env() -> dict[str, str]:
    """The user's environment without ``PYTHON*`` and ``VIRTUAL_ENV`` (the target is explicit)."""
    return {
        k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k != "VIRTUAL_ENV"
    }


def _run(cmd: list[str], cwd: Path, what: str) -> None:
    try:
        proc = subprocess.run(
            cmd,
            cwd=cwd,
            env=_child_env(),
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT,
        )
    except FileNotFoundError as err:
        raise EnvBuildError(
            f"Could not {what}: {cmd[0]} is not installed. Expected `uv` on PATH (pip install uv)."
        ) from err
    except subprocess.TimeoutExpired as err:
        raise EnvBuildError(
            f"Could not {what} within {INSTALL_TIMEOUT} s; is the package index reachable?"
        ) from err
    if proc.returncode != 0:
        tail = " ".join((proc.stderr or proc.stdout or "").split())[-800:]
        raise EnvBuildError(f"Could not {what} (exit {proc.returncode}): {tail or 'no output'}")


def _interpreter(python: str | None) -> str:
    """An interpreter of the recorded ``major.minor`` for ``venv`` (the running one if it is)."""
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    wanted = ".".join((python or here).split(".")[:2])
    if wanted == here:
        return getattr(sys, "_base_executable", None) or sys.executable
    found = shutil.which(f"python{wanted}")
    if found is None:
        raise EnvBuildError(
            f"The model was logged with Python {python}; expected a python{wanted} on PATH for "
            "--env-manager virtualenv, found none. Install it, or use --env-manager uv (uv "
            "installs the recorded Python itself)."
        )
    return found


def _install(
    env_manager: str,
    python: str | None,
    requirements: list[str],
    into: Path,
    cwd: Path,
    quiet: bool,
) -> None:
    q = ["-q"] if quiet else []
    if env_manager == "uv":
        uv = shutil.which("uv") or "uv"
        interp = ["--python", python] if python else ["--python", sys.executable]
        _run([uv, "venv", str(into), *q, *interp], cwd, f"create a Python {python} environment")
        cmd = [uv, "pip", "install", *q, "--python", str(python_of(into)), *requirements]
    else:
        _run([_interpreter(python), "-m", "venv", str(into)], cwd, "create the environment")
        pip = [str(python_of(into)), "-m", "pip", "install", "--disable-pip-version-check"]
        cmd = [*pip, *q, *requirements]
    _run(cmd, cwd, f"install {' '.join(requirements)[:400]}")


def build(
    env_manager: str,
    python: str | None,
    requirements: list[str],
    *,
    quiet: bool = True,
    trusted_args: list[str] | None = None,
    trusted_cwd: Path | None = None,
    into: Path | None = None,
    root: Path | None = None,
) -> Path:
    """The interpreter of an environment holding ``requirements`` (pins the product wrote).

    Without ``trusted_args`` the environment is cached and reused, and the installer runs in an
    empty directory. ``trusted_args`` (what the model's requirements add, which the user chose
    to trust) are installed as written, from ``trusted_cwd`` (the model directory, so that
    relative paths mean what they say), into ``into`` (not cached).
    """
    if trusted_args:
        assert into is not None and trusted_cwd is not None
        _install(env_manager, python, [*requirements, *trusted_args], into, trusted_cwd, quiet)
        return python_of(into)
    found = cached(env_manager, python, requirements, root)
    if found is not None:
        return found
    target = env_path(env_manager, python, requirements, root)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = cached(env_manager, python, requirements, root)
        if found is not None:
            return found
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        empty = Path(tempfile.mkdtemp(prefix=".cwd-", dir=target.parent))
        try:
            _install(env_manager, python, requirements, tmp / "env", empty, quiet)
            (tmp / "env" / MARKER).write_text(
                json.dumps({"python": python, "requirements": requirements})
            )
            shutil.rmtree(target, ignore_errors=True)
            os.rename(tmp / "env", target)
            cfg = target / "pyvenv.cfg"
            if cfg.exists():
                cfg.write_text(cfg.read_text().replace(str(tmp / "env"), str(target)))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(empty, ignore_errors=True)
    return python_of(target)
