"""Compile a StableHLO module with the IREE compiler, through a per-user cache of ``.vmfb`` files.

The cache key is the sha256 of (module sha256, IREE compiler and runtime versions, target,
flags, host CPU): a ``.vmfb`` is only valid for the IREE release that wrote it and, with
``--iree-llvmcpu-target-cpu=host``, for this kind of CPU. A hit costs reading the file and a
sha256 of it; the compiler is imported only on a miss.

Each entry (``<key>.entry``) is a header line, a JSON line ``{"key", "sha256", "size"}`` and the
``.vmfb`` bytes. It is verified before the runtime sees it: its key must be the one looked up
(an entry copied or renamed from another module is refused), its size and the sha256 of its bytes
those it records. A damaged or truncated entry is discarded with a warning and the module
recompiled; it is never run (damaged ``.vmfb`` files made IREE produce wrong outputs, SIGILL,
SIGSEGV). Entries are written to a temporary file, synced, then renamed into place, so a crash
never leaves a partial entry under a key; the verified bytes are loaded from memory (never
mapped: a file rewritten under a mapping ends the process with SIGBUS).

Settings, first match wins (as ``runtime.cache`` for JAX's cache):

1. ``iree_cache`` in the pyfunc ``model_config`` / the ``iree_cache=`` load option (``false``
   or a directory);
2. the environment variable ``JAXEXP_IREE_CACHE`` (``0``/``off`` turns it off, else a directory);
3. ``$XDG_CACHE_HOME/jaxexp-mlflow/iree`` (``~/.cache/jaxexp-mlflow/iree``).

Flags: ``--iree-input-demote-f64-to-f32=false`` keeps float64 (IREE demotes it by default);
``--iree-llvmcpu-target-cpu=host`` uses the CPU's vector units. ``SPEED_FLAGS``, opt-in through
``JAXEXP_IREE_FLAGS`` (docs/longevity.md, "Speed"), make large batches ~2x faster. All flags are
part of the cache key: entries compiled with other flags are not read.
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
#: Extra compiler flags, space-separated (e.g. ``--iree-opt-level=O3``: see docs/longevity.md).
ENV_FLAGS = "JAXEXP_IREE_FLAGS"
TARGET = "llvm-cpu"
FLAGS = ("--iree-input-demote-f64-to-f32=false", "--iree-llvmcpu-target-cpu=host")
#: Opt-in (``JAXEXP_IREE_FLAGS``): a batch-1024 MLP call ~2x faster, but iree-compile 3.13
#: crashes (SIGSEGV) on some models with them (eqx_attention of tests/models_real.py).
SPEED_FLAGS = ("--iree-opt-data-tiling", "--iree-llvmcpu-enable-ukernels=all")


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


#: First line of every cache entry; a new format gets a new line (old entries are not read).
ENTRY_MAGIC = b"jaxexp-mlflow iree cache entry 1\n"
ENTRY_SUFFIX = ".entry"
_MAX_HEADER = 4096


class _Damaged(Exception):
    """A cache entry that does not verify (the message says how)."""


def pack_entry(key: str, vmfb: bytes) -> bytes:
    """The bytes of the cache entry of ``vmfb`` under ``key`` (header, then the ``.vmfb``)."""
    header = {"key": key, "sha256": hashlib.sha256(vmfb).hexdigest(), "size": len(vmfb)}
    return ENTRY_MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + bytes(vmfb)


def unpack_entry(raw: bytes, key: str) -> memoryview:
    """The ``.vmfb`` inside the cache entry ``raw``, verified; ``_Damaged`` says what is wrong."""
    if not raw.startswith(ENTRY_MAGIC):
        raise _Damaged(f"no entry header ({len(raw)} bytes)")
    end = raw.find(b"\n", len(ENTRY_MAGIC), len(ENTRY_MAGIC) + _MAX_HEADER)
    if end < 0:
        raise _Damaged("header cut short")
    try:
        header = json.loads(raw[len(ENTRY_MAGIC) : end])
    except (ValueError, RecursionError):
        raise _Damaged("unreadable header") from None
    if not isinstance(header, dict):
        raise _Damaged("unreadable header")
    if header.get("key") != key:
        raise _Damaged(f"it records the key {str(header.get('key'))[:16]}..., another module's")
    payload = memoryview(raw)[end + 1 :]
    if header.get("size") != len(payload):
        raise _Damaged(f"expected {header.get('size')} bytes of module, found {len(payload)}")
    found = hashlib.sha256(payload).hexdigest()
    if header.get("sha256") != found:
        raise _Damaged(f"expected sha256 {header.get('sha256')}, found {found}")
    return payload


def _read_entry(path: Path, key: str) -> memoryview | None:
    """The verified ``.vmfb`` stored at ``path``, or None (absent; damaged: removed, warned)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        _logger.warning("jaxexp: IREE cache entry %s unreadable (%s): recompiling", path, err)
        return None
    try:
        return unpack_entry(raw, key)
    except _Damaged as why:
        _logger.warning(
            "jaxexp: IREE cache entry %s is damaged (%s): discarded, recompiling the module",
            path,
            why,
        )
        try:
            path.unlink()
        except OSError:
            pass
        return None


def _write_entry(directory: Path, path: Path, key: str, vmfb: bytes) -> None:
    """Store ``vmfb`` at ``path`` atomically: temporary file, fsync, rename."""
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(pack_entry(key, vmfb))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: a concurrent reader sees the whole entry or none
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def compiled(
    module: bytes, *, cache: Any = None, flags: tuple[str, ...] | None = None
) -> bytes | memoryview:
    """The ``.vmfb`` for ``module``: from a verified cache entry, else compiled (and stored).

    ``cache`` is the setting described in the module docstring (None: env var, then default);
    ``flags`` default to :func:`active_flags`.
    """
    flags = active_flags() if flags is None else flags
    directory = cache_settings.resolve(cache, env_var=ENV_VAR, kind="iree")
    key = cache_key(module, flags)
    path = None if directory is None else directory / f"{key}{ENTRY_SUFFIX}"
    if path is not None:
        hit = _read_entry(path, key)
        if hit is not None:
            return hit
    vmfb = compile_module(module, flags)
    if path is not None:
        try:
            _write_entry(directory, path, key, vmfb)
        except OSError as err:
            _logger.warning("jaxexp: IREE cache disabled, cannot write %s: %s", directory, err)
    return vmfb
