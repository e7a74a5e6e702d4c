"""The lite store: XLA:CPU executables of pyfunc buckets that run without importing jax.

An entry holds one batch bucket of one model, compiled with the params folded in as constants
(no params to read, and XLA specialises on them), and the output's shape and dtype. It is keyed
by what determines it without asking jax: the model's content (MLmodel, blob and params
manifest digests, and :func:`params_digest`, a sha256 of the params' files, since the entry
holds their values), model_config, ``JAXEXP_*`` variables, the padded input's shape and dtype,
the jax/jaxlib/jaxexp versions, every ``JAX_*``/``XLA_FLAGS`` variable and the host CPU. Not the
model's path: ``mlflow models serve -m runs:/...`` downloads the model into a new directory
every time, and the same files there find their entries.
jax's configuration can only come from those variables in a process that had not imported jax
before the model loaded, and only such a process writes entries (``serving/lite_pyfunc.py``).

Entries live in the subdirectory ``jaxexp-lite`` of the compilation cache directory a fresh
process would use (``JAX_COMPILATION_CACHE_DIR``, else ``runtime/cache.resolve``), in the
executable store's format (``runtime/entries.py``): authenticated with this user's secret under
the entry's name, so an entry runs only if a process of this user wrote it for this very key; a
planted, renamed or copied one is compiled again. The model directory never chooses the place.
Nothing here imports jax.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from jaxexp_mlflow import settings

LITE_SUBDIR = "jaxexp-lite"
ENV_LITE = "JAXEXP_LITE"
ENV_LITE_MAX_BYTES = "JAXEXP_LITE_MAX_PARAM_BYTES"
#: params folded into an executable at most this large (bigger models keep params as arguments)
DEFAULT_LITE_MAX_BYTES = 64 << 20
MAX_ENTRIES = 256


def enabled() -> bool:
    """``JAXEXP_LITE`` is not ``0``/``off``/``false``/``no``."""
    return settings.JAXEXP_LITE.get()


def max_param_bytes() -> int:
    """Largest params (bytes) folded into a lite executable (``JAXEXP_LITE_MAX_PARAM_BYTES``)."""
    return settings.JAXEXP_LITE_MAX_PARAM_BYTES.get(DEFAULT_LITE_MAX_BYTES)


def lite_dir(setting: Any = None) -> Path | None:
    """Where lite entries live for the pyfunc ``compilation_cache`` setting, as a process that
    has not imported jax would configure it (None: cache off, or remote)."""
    from jaxexp_mlflow.runtime.cache import private_dir, resolve

    current = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if current:  # the user's own choice for JAX, kept as configure keeps it
        directory = Path(os.path.expanduser(current))
        if "://" in current or not directory.is_absolute():
            return None
        return directory / LITE_SUBDIR
    directory = resolve(setting)
    # configure enables the cache in such a directory only (made there when absent)
    if directory is None or not private_dir(directory, create=False):
        return None
    return directory / LITE_SUBDIR


def environment() -> dict[str, Any]:
    """What of this process determines an executable besides the model, without jax."""
    from importlib import metadata

    from jaxexp_mlflow import __version__
    from jaxexp_mlflow.runtime.cache import host_cpu

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    env = sorted(
        (k, v)
        for k, v in os.environ.items()
        if k.startswith(("JAX_", "XLA_", "LIBTPU")) and k != "JAX_COMPILATION_CACHE_DIR"
    )
    return {
        "lite": 1,
        "jaxexp": __version__,
        "jax": version("jax"),
        "jaxlib": version("jaxlib"),
        "env": env,
        "cpu": host_cpu(),
    }


def params_digest(model_dir: str | os.PathLike, flavor: dict[str, Any]) -> str | None:
    """sha256 over the files of the model's params checkpoint (each file's path, size and
    bytes, in the walk's order), read through the confined walk; ``"none"`` without params.
    ``None`` when they exceed twice :func:`max_param_bytes` (no lite entry for such a model).
    The manifest's CRC-32Cs are no content identity (a forger can match a CRC-32C), so an
    entry, which holds the params' values, is keyed by this: read afresh each time, so what is
    hashed is what the directory holds now."""
    from jaxexp_mlflow.codec import files
    from jaxexp_mlflow.store import artifact

    ckpt = artifact.params_dir(model_dir, flavor)
    digest: str | None = "none"
    if ckpt is not None:
        h = hashlib.sha256()
        limit, total = 2 * max_param_bytes(), 0
        for rel, st in files.walk_files(ckpt, ".", what="params checkpoint"):
            total += st.st_size
            if total > limit:
                digest = None
                break
            data = files.read_bytes(ckpt, rel, what="params file", max_bytes=st.st_size)
            h.update(json.dumps([rel, len(data)]).encode())
            h.update(data)
        else:
            digest = h.hexdigest()
    return digest


def entry_key(identity: Any, environment: dict[str, Any], shape: tuple, dtype: Any) -> str:
    """The digest an entry is stored under."""
    text = json.dumps([identity, environment, list(shape), str(dtype)], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _path(directory: Path, key: str) -> Path:
    return directory / f"{key}.lite"


def has_entry(directory: Path, key: str) -> bool:
    """Whether an entry file exists for ``key`` (not yet read nor checked)."""
    return _path(directory, key).is_file()


def write_entry(directory: Path, key: str, header: dict[str, Any], payload: bytes) -> None:
    """Store ``payload`` (a serialized executable) and its ``header`` under ``key``."""
    from jaxexp_mlflow.runtime import entries

    head = json.dumps(header, sort_keys=True).encode()
    entries.write_entry(directory, _path(directory, key), payload, header=head)
    entries.prune(directory, "*.lite", MAX_ENTRIES)  # the oldest go first


def read_entry(directory: Path, key: str) -> tuple[dict[str, Any], bytes] | None:
    """The header and payload stored under ``key``; None when absent, not ours or damaged."""
    from jaxexp_mlflow.runtime.entries import read_entry as read_checked

    try:
        entry = read_checked(_path(directory, key), headed=True)
    except OSError:
        return None
    if entry is None:
        return None
    try:
        header = json.loads(entry[0])
    except ValueError:
        return None
    if not isinstance(header, dict):
        return None
    return header, entry[1]


def remove_entry(directory: Path, key: str) -> None:
    """Drop the entry stored under ``key`` (one that failed to load)."""
    _path(directory, key).unlink(missing_ok=True)
