"""Virtual environments holding one given jax/jaxlib, for the ``bridge`` and ``recorded-env``
routes (``runtime/routes.py``): built with ``python -m venv`` and pip from the package index,
cached under a cache directory (never inside a model directory) and reused.

An environment is ``<cache>/jax-<version>-py<major>.<minor>/``; it is built in a sibling
temporary directory and renamed into place only once pip succeeded, so a half-built environment
is never reused. ``<cache>`` is ``$JAXEXP_ENVS_DIR``, else ``$XDG_CACHE_HOME/jaxexp/envs``, else
``~/.cache/jaxexp/envs``. Nothing from a model is installed: only ``jax==V``, ``jaxlib==V``,
``flatbuffers`` and ``absl-py`` (and what pip resolves for them), so a model directory never
chooses what runs.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jaxexp_mlflow import settings
from jaxexp_mlflow.errors import JaxExpError

MARKER = "jaxexp-env.json"
#: What jax.export needs beside jax and jaxlib and some releases do not declare (jax 0.6 imports
#: absl in jax.export; flatbuffers is an optional dependency).
EXTRAS = ("flatbuffers", "absl-py")
_VERSION = re.compile(r"^\d+(\.\d+){1,3}$")


class JaxEnvError(JaxExpError):
    """An environment with the asked jax could not be built (no wheel for this Python, no
    index, pip failed)."""


def cache_dir() -> Path:
    """Where the environments live (``$JAXEXP_ENVS_DIR`` or the user cache)."""
    explicit = settings.JAXEXP_ENVS_DIR.get()
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base, "jaxexp", "envs")


def env_path(jax_version: str) -> Path:
    """The environment directory for ``jax_version`` on the running Python."""
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    return cache_dir() / f"jax-{jax_version}-py{py}"


def python_of(env: Path) -> Path:
    """The environment's interpreter."""
    return env / "bin" / "python"


def ready(jax_version: str) -> Path | None:
    """The interpreter of the cached environment for ``jax_version``, if it was built whole."""
    env = env_path(jax_version)
    return python_of(env) if (env / MARKER).is_file() and python_of(env).exists() else None


def ensure(jax_version: str, *, quiet: bool = True) -> Path:
    """The interpreter of an environment with ``jax==jax_version`` (built once, then reused).

    Raises :class:`JaxEnvError` saying what pip answered when the environment cannot be built.
    """
    if not _VERSION.match(jax_version):
        raise JaxEnvError(
            f"Expected a jax release number such as 0.10.2, found {jax_version!r}; nothing was "
            "installed."
        )
    found = ready(jax_version)
    if found is not None:
        return found
    target = env_path(jax_version)
    target.parent.mkdir(parents=True, exist_ok=True)
    # one builder per environment: a second process waits, then reuses what the first built
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = ready(jax_version)
        if found is not None:
            return found
        return _build(jax_version, target, quiet=quiet)


def _build(jax_version: str, target: Path, *, quiet: bool) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    start = time.perf_counter()
    try:
        base = getattr(sys, "_base_executable", None) or sys.executable
        _run([base, "-m", "venv", str(tmp)], "create the virtual environment")
        pins = [f"jax=={jax_version}", f"jaxlib=={jax_version}", *EXTRAS]
        pip = [str(python_of(tmp)), "-m", "pip", "install", "--disable-pip-version-check"]
        _run([*pip, *(["-q"] if quiet else []), *pins], f"pip install {' '.join(pins)}")
        # venv writes absolute paths: build in place of the target name, then rename
        (tmp / MARKER).write_text(
            json.dumps(
                {
                    "jax": jax_version,
                    "python": sys.version.split()[0],
                    "built_seconds": round(time.perf_counter() - start, 1),
                }
            )
        )
        shutil.rmtree(target, ignore_errors=True)
        os.rename(tmp, target)
        _fix_paths(target, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return python_of(target)


def _fix_paths(env: Path, old: Path) -> None:
    """A venv renamed after creation: its scripts name the old path (the interpreter itself,
    ``bin/python``, does not; only it is used)."""
    cfg = env / "pyvenv.cfg"
    if cfg.exists():
        cfg.write_text(cfg.read_text().replace(str(old), str(env)))


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = " ".join((proc.stderr or proc.stdout).split())[-800:]
        raise JaxEnvError(
            f"Could not {what} for Python {sys.version.split()[0]}: {tail}. Expected the package "
            "index to serve these wheels for this Python; check the index is reachable, or run "
            "the route with a Python the release supports."
        )
