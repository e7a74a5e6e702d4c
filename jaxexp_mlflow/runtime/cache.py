"""JAX's persistent compilation cache, on by default for loaded models.

A shape-polymorphic model compiles once per distinct input shape (78-135 ms each for a small MLP
here). With the cache on, a second process (a restarted server, a second worker) reads those
executables from disk instead of compiling them again.

Settings, first match wins:

1. ``compilation_cache`` in the pyfunc ``model_config`` (``false`` or a directory);
2. the environment variable ``JAXEXP_COMPILATION_CACHE``: ``0``/``off``/``false`` turns it off,
   ``1``/``on``/``true`` uses the default directory, anything else is a directory;
3. the default directory ``$XDG_CACHE_HOME/jaxexp-mlflow/xla`` (``~/.cache/jaxexp-mlflow/xla``).

A cache directory the user already gave JAX (``jax.config.update("jax_compilation_cache_dir",
...)`` or ``JAX_COMPILATION_CACHE_DIR``) is always kept. Nothing happens at import time: the
loader calls ``configure`` before it compiles anything.

Next to JAX's entries, ``runtime/executables.py`` keeps each compiled bucket of a pyfunc model
under a key of what determines it (subdirectory ``jaxexp-executables``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

_logger = logging.getLogger(__name__)

ENV_VAR = "JAXEXP_COMPILATION_CACHE"
ENV_MAX_BYTES = "JAXEXP_COMPILATION_CACHE_MAX_BYTES"
DEFAULT_MAX_BYTES = 2 << 30
_OFF = {"0", "off", "false", "no", "none", ""}
_ON = {"1", "on", "true", "yes"}

_configured: str | None = None  # the directory we set up, "" when disabled, None not yet


def default_cache_dir(kind: str = "xla") -> Path:
    """The per-user default directory of a compilation cache (``xla``, ``iree``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base, "jaxexp-mlflow", kind)


def resolve(setting: Any = None, *, env_var: str = ENV_VAR, kind: str = "xla") -> Path | None:
    """The cache directory to use (None when off) for a model_config value and the env."""
    if setting is None:
        setting = os.environ.get(env_var)
    if setting is None or setting is True:
        return default_cache_dir(kind)
    if setting is False:
        return None
    text = str(setting).strip()
    if text.lower() in _OFF:
        return None
    if text.lower() in _ON:
        return default_cache_dir(kind)
    return Path(os.path.expanduser(text))


def configure(setting: Any = None) -> str | None:
    """Turn JAX's persistent compilation cache on for this process (idempotent).

    Returns the cache directory in use, or None when the cache is off. Call it before the
    first compilation of the process; a cache JAX already initialised without a directory is
    reset so the directory takes effect.
    """
    global _configured
    import jax

    current = jax.config.values.get("jax_compilation_cache_dir")
    if current and current != _configured:
        return current  # the user's own choice
    directory = resolve(setting)
    if directory is None:
        if _configured:
            jax.config.update("jax_compilation_cache_dir", None)
            _reset()
        _configured = ""
        return None
    if _configured == str(directory):
        return _configured
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        _logger.warning("jaxexp: compilation cache disabled, cannot create %s: %s", directory, err)
        _configured = ""
        return None
    jax.config.update("jax_compilation_cache_dir", str(directory))
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ and _max_size(jax) < 0:
        # JAX's default is no limit: a model compiled for every new shape would fill the disk;
        # JAX evicts its least recently used entries past this size, with `filelock` only
        # (jax 0.10.2 without it fails every cache read and write once a size is set)
        import importlib.util

        if importlib.util.find_spec("filelock") is not None:
            jax.config.update("jax_compilation_cache_max_size", max_cache_bytes())
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        # JAX only caches compilations over 1 s by default; ours take ~0.1 s each
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    _reset()
    _configured = str(directory)
    return _configured


def max_cache_bytes() -> int:
    """The size past which JAX evicts entries of the cache we set up
    (``JAXEXP_COMPILATION_CACHE_MAX_BYTES``, default 2 GiB)."""
    return int(os.environ.get(ENV_MAX_BYTES, DEFAULT_MAX_BYTES))


def _max_size(jax: Any) -> int:
    return int(jax.config.values.get("jax_compilation_cache_max_size", -1))


def _reset() -> None:
    try:
        from jax.experimental.compilation_cache import compilation_cache as cc

        cc.reset_cache()
    except Exception as err:  # private-ish API: never fail a load over it
        _logger.debug("jaxexp: could not reset the compilation cache: %s", err)


def host_cpu() -> str:
    """The machine and a digest of its CPU feature flags: part of every key of compiled code
    (an executable compiled for AVX-512 must not run elsewhere; IREE's ``target-cpu=host``)."""
    import hashlib
    import platform

    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = line
                    break
    except OSError:
        pass
    return f"{platform.machine()}-{hashlib.sha256(flags.encode()).hexdigest()[:16]}"
