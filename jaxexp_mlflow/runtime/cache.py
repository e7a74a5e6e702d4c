"""JAX's persistent compilation cache, on by default for loaded models.

A shape-polymorphic model compiles once per distinct input shape (78-135 ms each for a small MLP
here). With the cache on, a second process (a restarted server, a second worker) reads those
executables from disk instead of compiling them again.

Settings, first match wins:

1. ``compilation_cache`` in the pyfunc ``model_config`` (``false`` or a directory);
2. the environment variable ``JAXEXP_COMPILATION_CACHE``: ``0``/``off``/``false`` turns it off,
   ``1``/``on``/``true`` uses the default directory, anything else is a directory;
3. the default directory ``$XDG_CACHE_HOME/jaxexp-mlflow/xla`` (``~/.cache/jaxexp-mlflow/xla``).

A directory must be absolute (``~`` is expanded): a relative one is refused, never resolved
against the working directory. A model directory can only turn the cache off (MLmodel
``serving.compilation_cache: false``), never point it somewhere (``store/section.py``).

JAX reads the executables of its persistent cache without authenticating them, so we enable it
only in a directory that only this user can write: made with mode 0700 when absent, else owned
by this user and neither group- nor other-writable; any other directory turns the cache off with
a warning. A cache directory the user already gave JAX (``jax.config.update(
"jax_compilation_cache_dir", ...)`` or ``JAX_COMPILATION_CACHE_DIR``) is always kept: JAX
trusts it because the user chose it. Nothing happens at import time: the loader calls
``configure`` before it compiles anything.

Next to JAX's entries, ``runtime/executables.py`` keeps each compiled bucket of a pyfunc model
under a key of what determines it (subdirectory ``jaxexp-executables``), authenticated with this
user's secret (``runtime/cache_auth.py``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

from jaxexp_mlflow import settings
from jaxexp_mlflow.errors import JaxExpError

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


class CacheSettingError(JaxExpError):
    """A compilation cache setting that names no usable directory (a relative path, a number)."""

    default_code = INVALID_PARAMETER_VALUE


def resolve(setting: Any = None, *, env_var: str = ENV_VAR, kind: str = "xla") -> Path | None:
    """The cache directory to use (None when off) for a model_config value and the env.

    Only typed values are taken: ``None`` (the env var, else the default), ``True``/``False``,
    or a string (``0``/``off``/... and ``1``/``on``/... as in the module docstring, else a
    directory). A directory must be absolute once ``~`` is expanded: a relative one would be
    resolved against the working directory, which may be a model directory.

    Raises:
        CacheSettingError: another type, or a relative directory.
    """
    option = "iree_cache" if kind == "iree" else "compilation_cache"
    where = f"model_config {option}" if setting is not None else env_var
    if setting is None:
        setting = settings.lookup(env_var).get()
    if setting is None or setting is True:
        return default_cache_dir(kind)
    if setting is False:
        return None
    if not isinstance(setting, (str, os.PathLike)):
        raise CacheSettingError(
            f"{where}: expected false, true or an absolute directory, found a "
            f"{type(setting).__name__} ({setting!r:.40}). Pass a directory as a string, or false."
        )
    text = os.fspath(setting).strip()
    if text.lower() in _OFF:
        return None
    if text.lower() in _ON:
        return default_cache_dir(kind)
    directory = Path(os.path.expanduser(text))
    if not directory.is_absolute():
        raise CacheSettingError(
            f"{where}: expected an absolute directory, found the relative path {text!r:.200}, "
            "which would be resolved against the working directory (a model directory, it may "
            "be). Give an absolute path (or ~/...), or 0/off to turn the cache off."
        )
    return directory


def private_dir(directory: Path, *, create: bool = True) -> bool:
    """Whether ``directory`` is one only this user can write: a real directory (no symbolic
    link) owned by this user, neither group- nor other-writable; ``create``: made (mode 0700)
    when absent. JAX's persistent cache reads executables from it without authenticating
    them, so it is enabled only in such a directory."""
    import stat

    if create and not os.path.lexists(directory):
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            return False
    try:
        st = os.lstat(directory)
    except OSError:
        return False
    mine = not hasattr(os, "getuid") or st.st_uid == os.getuid()
    return stat.S_ISDIR(st.st_mode) and mine and not st.st_mode & 0o022


def configure(setting: Any = None) -> str | None:
    """Turn JAX's persistent compilation cache on for this process (idempotent).

    Returns the cache directory in use, or None when the cache is off. Call it before the
    first compilation of the process; a cache JAX already initialised without a directory is
    reset so the directory takes effect. A directory others could write (:func:`private_dir`)
    leaves the cache off, with a warning.

    Raises:
        CacheSettingError: ``setting`` (or the env var) is a relative directory or no flag.
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
    if not private_dir(directory):
        _logger.warning(
            "jaxexp: compilation cache off: %s is not a directory of this user that only this "
            "user can write (JAX would run executables others put there); chmod 700 it, or "
            "choose another directory",
            directory,
        )
        if _configured:
            jax.config.update("jax_compilation_cache_dir", None)
            _reset()
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
    return settings.JAXEXP_COMPILATION_CACHE_MAX_BYTES.get(DEFAULT_MAX_BYTES)


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
