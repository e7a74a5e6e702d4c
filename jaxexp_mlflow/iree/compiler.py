"""Compile a StableHLO module with the IREE compiler, through a per-user cache of ``.vmfb`` files.

The cache key is the sha256 of (module sha256, IREE compiler and runtime versions, target,
flags, host CPU): a ``.vmfb`` is only valid for the IREE release that wrote it and, with
``--iree-llvmcpu-target-cpu=host``, for this kind of CPU. A hit costs a file lookup and the
runtime's ``mmap``; the compiler is imported only on a miss.

Settings, first match wins (as ``runtime.cache`` for JAX's cache):

1. ``iree_cache`` in the pyfunc ``model_config`` / the ``iree_cache=`` load option (``false``
   or a directory);
2. the environment variable ``JAXEXP_IREE_CACHE`` (``0``/``off`` turns it off, else a directory);
3. ``$XDG_CACHE_HOME/jaxexp-mlflow/iree`` (``~/.cache/jaxexp-mlflow/iree``).

Flags: ``--iree-input-demote-f64-to-f32=false`` keeps float64 (IREE demotes it by default);
``--iree-llvmcpu-target-cpu=host`` uses the CPU's vector units.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

from jaxexp_mlflow.errors import IncompatibleError
from jaxexp_mlflow.runtime import cache as cache_settings

_logger = logging.getLogger(__name__)

ENV_VAR = "JAXEXP_IREE_CACHE"
#: Extra compiler flags, space-separated (e.g. ``--iree-opt-data-tiling``: see docs/longevity.md).
ENV_FLAGS = "JAXEXP_IREE_FLAGS"
TARGET = "llvm-cpu"
FLAGS = ("--iree-input-demote-f64-to-f32=false", "--iree-llvmcpu-target-cpu=host")


def active_flags() -> tuple[str, ...]:
    """The compiler flags in force: :data:`FLAGS` plus those of ``JAXEXP_IREE_FLAGS``."""
    return FLAGS + tuple(os.environ.get(ENV_FLAGS, "").split())


def versions() -> dict[str, str | None]:
    """Installed versions of the IREE compiler and runtime packages."""
    out: dict[str, str | None] = {}
    for name in ("iree-base-compiler", "iree-base-runtime"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def host_cpu() -> str:
    """The machine and a digest of its CPU feature flags (what ``target-cpu=host`` compiles for)."""
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


def cache_key(module: bytes, flags: tuple[str, ...] = FLAGS) -> str:
    """The cache key of ``module`` compiled with ``flags`` by the IREE installed here."""
    facts = {
        "module_sha256": hashlib.sha256(module).hexdigest(),
        "iree": versions(),
        "target": TARGET,
        "flags": list(flags),
        "host": host_cpu(),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def compile_module(module: bytes, flags: tuple[str, ...] = FLAGS) -> bytes:
    """Compile StableHLO (portable artifact or MLIR bytecode/text) to an IREE ``.vmfb``."""
    import iree.compiler as ic

    try:
        return bytes(
            ic.compile_str(
                module,
                target_backends=[TARGET],
                input_type="stablehlo",
                extra_args=list(flags),
            )
        )
    except ic.CompilerToolError as err:
        text = str(err)
        raise IncompatibleError(
            "The IREE compiler could not compile this model's StableHLO module: expected a "
            f"module IREE {versions()['iree-base-compiler']} supports, it said:\n"
            f"{text[:2000]}\nLoad it with the JAX backend (backend='jax')."
        ) from None


def compiled(
    module: bytes, *, cache: Any = None, flags: tuple[str, ...] | None = None
) -> bytes | Path:
    """The ``.vmfb`` for ``module``: a cache file path on a hit or after storing, else bytes.

    ``cache`` is the setting described in the module docstring (None: env var, then default);
    ``flags`` default to :func:`active_flags`.
    """
    flags = active_flags() if flags is None else flags
    directory = cache_settings.resolve(cache, env_var=ENV_VAR, kind="iree")
    path = None if directory is None else directory / f"{cache_key(module, flags)}.vmfb"
    if path is not None and path.is_file():
        return path
    vmfb = compile_module(module, flags)
    if path is None:
        return vmfb
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(vmfb)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the whole file or none
    except OSError as err:
        _logger.warning("jaxexp: IREE cache disabled, cannot write %s: %s", directory, err)
        return vmfb
    return path
