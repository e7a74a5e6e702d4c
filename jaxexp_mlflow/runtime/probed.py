"""Blobs this user's JAX already deserialized safely: the isolated probe runs once per blob.

``runtime.isolate.probe`` starts a capped child for every ``jaxexp check`` and ``jaxexp verify``
(about a second: it imports JAX). Its outcome depends only on the blob's bytes, the pytree node
types registered for it, the Python, JAX and jaxlib that read it, what of the child's
environment JAX and Python read as they start (``JAX_*``, ``XLA_*``: the expired-blob flag
among them; ``PYTHON*``, ``LD_*``) and the child's limits, so a probe that passed is recorded
under a digest of all of these, and the next probe of the same blob under the same conditions
starts no child.

Records live in the subdirectory ``jaxexp-probed`` of the compilation cache directory
(``JAXEXP_COMPILATION_CACHE``; no records when it is off, or when it is no directory only this
user can write), in the entry format of ``runtime/entries.py``: authenticated with this user's
secret under the record's own name, so a record planted in the directory, copied from another
machine or renamed is not read and the blob is probed again. Only passes are recorded: a blob
JAX refused, crashed on or timed out on is probed anew every time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from importlib import metadata
from pathlib import Path

from jaxexp_mlflow.runtime import entries

_logger = logging.getLogger(__name__)

SUBDIR = "jaxexp-probed"
#: records kept (the newest; about 100 bytes each)
MAX_RECORDS = 4096
#: a record's payload starts with this line (a new format, a new line)
_KIND = b"jaxexp-probe-passed-1\n"
#: the child's environment variables that change how JAX or Python start
_READ_AT_START = ("JAX_", "XLA_", "TF_", "PYTHON", "LD_")


def record_name(
    data: bytes | bytearray | memoryview,
    node_types: list[str],
    *,
    memory_bytes: int,
    timeout_s: float,
    env: dict[str, str],
) -> str:
    """The file name of the record of a probe of ``data`` under these conditions."""
    facts = {
        "blob_sha256": hashlib.sha256(data).hexdigest(),
        "node_types": sorted(node_types),
        "python": sys.version,
        "jax": _version("jax"),
        "jaxlib": _version("jaxlib"),
        "memory_bytes": memory_bytes,
        "timeout_s": timeout_s,
        "env": sorted((k, v) for k, v in env.items() if k.startswith(_READ_AT_START)),
    }
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()
    return f"probe-{digest}.bin"


def passed_before(name: str) -> bool:
    """Whether an authenticated record ``name`` says this probe passed before."""
    directory = _directory()
    if directory is None:
        return False
    try:
        entry = entries.read_entry(directory / name)
    except OSError:
        return False
    return entry is not None and entry[1] == _KIND


def remember(name: str) -> None:
    """Record that the probe ``name`` passed; never fails the caller."""
    directory = _directory()
    if directory is None:
        return
    try:
        entries.write_entry(directory, directory / name, _KIND)
        entries.prune(directory, "probe-*.bin", keep=MAX_RECORDS)
    except OSError as err:
        _logger.debug("jaxexp: probe not recorded in %s: %s", directory, err)


def _directory() -> Path | None:
    from jaxexp_mlflow.runtime import cache

    try:
        base = cache.resolve(None)
    except Exception:  # an unusable setting: no records, the probe runs
        return None
    if base is None or not cache.private_dir(base):
        return None
    return base / SUBDIR


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return ""
