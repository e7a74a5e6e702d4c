"""Which files of a params checkpoint its arrays use, judged before any of them is downloaded.

A remote load fetches the files a checkpoint's manifest (``jaxexp_manifest.json``) names in
its subdirectories. A store can add any file to the manifest (and re-seal it), so naming is
not enough: a 2 GiB file beside a model of 144 bytes would fill the loader's temporary
directory before the load could refuse it. :func:`refused` tells, from the manifest's entries
and the arrays' zarr metadata alone (small files, fetched first), which listed files no array
uses, or uses fewer bytes of than listed:

* an array directory is one holding zarr metadata (``.zarray``, ``zarr.json``); its chunk
  files are exactly those its metadata names (``codec.zarr.array_meta``: the chunk grid), each
  at most the bytes of its chunk (plus the shard index of zarr3 sharding). Where the layout is
  not one ``codec.zarr`` reads (compressed, for Orbax to read), the chunk files are those
  named like chunk keys (``0.0``, ``c/0/0``), of any size;
* Orbax's own metadata files (``_METADATA``, ``_sharding``, ``array_metadatas/*``...; 64 MiB
  each at most), in the checkpoint or an item directory of it, and, in OCDBT checkpoints (a
  ``manifest.ocdbt`` listed), the files under ``d/`` and ``ocdbt.process_*/``, which only
  Orbax can attribute;
* any other file is refused.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable
from typing import Any

from jaxexp_mlflow.codec import zarr

__all__ = ["META_MAX_BYTES", "metadata_files", "refused"]

META_MAX_BYTES = zarr.MAX_META_BYTES
#: Orbax's per-process array metadata: ~100 bytes an array; the params manifest's own bound.
ORBAX_META_MAX_BYTES = 64 << 20
_CHUNK_KEY = re.compile(r"^(c([/.]\d+)*|\d+([/.]\d+)*)$")
_ORBAX_NAMES = ("commit_success.txt",)


def metadata_files(entries: dict[str, tuple[int, Any]]) -> list[str]:
    """The zarr metadata files among the manifest's ``entries`` (relative paths)."""
    return [rel for rel in entries if "/" in rel and posixpath.basename(rel) in zarr.META_FILES]


def _chunk_bound(info: Any) -> int:
    """The most bytes one chunk file of ``info`` (``zarr.ArrayMeta``) holds."""
    import numpy as np

    rest = int(np.prod(info.shape[1:], dtype=np.int64)) if info.shape else 1
    row_bytes = rest * info.dtype.itemsize
    if not info.sharded:
        return info.outer0 * row_bytes
    n_inner = info.outer0 // info.inner0
    return info.outer0 * row_bytes + 16 * n_inner + 4


def refused(
    entries: dict[str, tuple[int, Any]],
    read_meta: Callable[[str], dict | None],
    ocdbt: bool,
) -> list[tuple[str, int, str]]:
    """``(file, listed size, reason)`` of each subdirectory file of ``entries`` (the manifest:
    ``{relative path: (size, crc)}``) that no array uses, or uses fewer bytes of than listed.

    ``read_meta(array_dir)``: the parsed zarr metadata of an array directory (its metadata
    file already fetched and size-checked); ``ocdbt``: the checkpoint keeps OCDBT files.
    Raises ``ArtifactError`` for metadata no reader can take (``codec.zarr.array_meta``).
    """
    arrays: dict[str, tuple[set[str] | None, int | None]] = {}
    for rel in metadata_files(entries):
        base = posixpath.dirname(rel)
        meta = read_meta(base)
        if meta is None:
            continue
        try:
            info = zarr.array_meta(meta, len(entries))
        except zarr.NotPlain:
            arrays[base] = (None, None)  # Orbax's layout: chunk keys by their form
            continue
        arrays[base] = ({f"{base}/{k}" for k in info.keys}, _chunk_bound(info))
    out: list[tuple[str, int, str]] = []
    for rel, (size, _) in entries.items():
        if "/" not in rel or posixpath.basename(rel) in zarr.META_FILES:
            continue
        owner = max((b for b in arrays if rel.startswith(b + "/")), key=len, default=None)
        if owner is not None:
            keys, bound = arrays[owner]
            inner = rel[len(owner) + 1 :]
            if keys is None:
                if not _CHUNK_KEY.match(inner):
                    out.append((rel, size, f"not a chunk file of the array {owner!r}"))
            elif rel not in keys:
                out.append((rel, size, f"not one of the chunk files {owner!r} states"))
            elif bound is not None and size > bound:
                out.append((rel, size, f"more than the {bound} bytes of a chunk of {owner!r}"))
        elif ocdbt and _in_ocdbt(rel):
            continue
        elif _orbax_meta(rel):
            if size > ORBAX_META_MAX_BYTES:
                out.append((rel, size, f"more than the {ORBAX_META_MAX_BYTES} bytes allowed"))
        else:
            out.append((rel, size, "in no array's directory"))
    return out


def _orbax_meta(rel: str) -> bool:
    """Orbax's metadata files, in the checkpoint or an item directory of it: ``_METADATA``,
    ``_sharding``, ``commit_success.txt``, ``array_metadatas/process_<n>``."""
    parts = rel.split("/")
    name = parts[-1]
    return (
        name.startswith("_")
        or name in _ORBAX_NAMES
        or (len(parts) >= 2 and parts[-2] == "array_metadatas")
    )


def _in_ocdbt(rel: str) -> bool:
    """A file of an OCDBT database: under a ``d/`` or ``ocdbt.process_<n>/`` directory, or
    its ``manifest.ocdbt``."""
    parts = rel.split("/")
    return parts[-1] == "manifest.ocdbt" or any(
        p == "d" or p.startswith("ocdbt.process_") for p in parts[:-1]
    )
