"""Read one uncompressed zarr array of an Orbax checkpoint straight into memory (no JAX, no Orbax).

Orbax writes (``params.save``) each array as a plain zarr directory: zarr2 (``.zarray`` + chunk
files ``0.0``, what this package saves) or, in models saved by earlier jaxexp-mlflow, zarr3
(``zarr.json`` + ``sharding_indexed`` chunk files ``c.0.0`` or ``c/0/0``). Writing stays Orbax's
and TensorStore's job; this module only reads, and only the simple layouts: the ``bytes`` codec
alone (no compression), little-endian, C order, chunks split along axis 0 at most. Anything else
raises :class:`NotPlain` and the caller hands the leaf to Orbax.

Why a reader of our own (it is needed, not a copy for its own sake):

* **the IREE backend runs without JAX**, and Orbax imports JAX: ``iree.files.read_params`` and
  ``jaxexp check`` read params through this module;
* **speed**: Orbax's restore makes three passes over the bytes (``np.zeros``, TensorStore's copy
  into it, ``jax.device_put``) and reads at 0.33-0.45x of a raw ``readinto`` on this machine;
  this reads each chunk with one ``preadv`` into a 64-byte aligned buffer that ``jax.device_put``
  adopts without a copy, or maps it (``mapped``), checking each file's CRC-32C as it goes.

``tests/params/test_params.py`` checks it against Orbax's own restore, dtype by dtype and layout by
layout (``test_zarr_reader_agrees_with_orbax``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from jaxexp_mlflow.errors import ArtifactError

__all__ = [
    "META_FILES",
    "NotPlain",
    "PendingArray",
    "array_meta",
    "is_chunk_file",
    "prepare_array",
    "read_array",
    "read_meta",
]

#: The metadata file of an array directory: zarr2, zarr3.
META_FILES = (".zarray", "zarr.json")
_MISSING = 2**64 - 1  # zarr3 sharding index entry of a chunk that was never written
#: Arrays below this size are copied even when mapping is allowed: a mapping costs a page and a
#: kernel map entry (at most ``vm.max_map_count``, 65530 by default, per process).
MAP_MIN_BYTES = 1 << 20
_CAN_MAP = os.name == "posix"
_LE = [{"name": "bytes", "configuration": {"endian": "little"}}]
_INDEX_CODECS = [*_LE, {"name": "crc32c"}]


class NotPlain(Exception):
    """The array's storage is not a layout this reader reads (compressed, another order...)."""


class _Layout(NamedTuple):
    """How one array's bytes lie in its chunk files."""

    rows: int  # along axis 0, the axis chunks split
    row_bytes: int
    inner0: int  # rows per inner chunk
    n_inner: int  # inner chunks per chunk file
    sharded: bool  # zarr3 sharding_indexed: chunk index at the end of each file


class ArrayMeta(NamedTuple):
    """What an array's zarr metadata says: shape, dtype and where its bytes lie."""

    shape: tuple[int, ...]
    dtype: Any
    keys: list[str]  # chunk files, relative to the array directory, in axis-0 order
    outer0: int  # rows per chunk file
    inner0: int  # rows per inner chunk (zarr3 sharding), else outer0
    sharded: bool


def is_chunk_file(rel: str) -> bool:
    """Array data (zarr chunk files, OCDBT data files), as opposed to metadata: a file inside
    a directory of the checkpoint other than an array's metadata and Orbax's ``_`` files."""
    if "/" not in rel:
        return False
    name = rel.rsplit("/", 1)[-1]
    return name not in META_FILES and not name.startswith("_")


def read_meta(
    root: Path, rel_dir: str, listed: Any, held: dict[str, bytes] | None = None
) -> dict | None:
    """The parsed metadata of one array directory (``.zarray`` or ``zarr.json``, whichever
    ``listed`` holds: the checkpoint's file names), or None when it has neither. ``held``:
    ``{relative path: bytes}`` already read and checked (``params.manifest.Manifest.held``),
    parsed instead of reading the file again."""
    from jaxexp_mlflow.codec import files

    for name in META_FILES:
        rel = f"{rel_dir}/{name}"
        if rel in listed:
            raw = (held or {}).get(rel)
            if raw is None:
                raw = files.read_file(
                    root / rel_dir / name, what=f"array metadata {rel}", max_bytes=MAX_META_BYTES
                )
            try:
                meta = json.loads(raw)
            except (ValueError, RecursionError) as e:
                raise ArtifactError(
                    f"The params array metadata {rel_dir}/{name} is not valid JSON "
                    f"({type(e).__name__}). The checkpoint is damaged; download the model again."
                ) from None
            if not isinstance(meta, dict):
                raise NotPlain("zarr metadata")
            return meta
    return None


def _dtype(meta: dict) -> Any:
    import re

    import numpy as np

    from jaxexp_mlflow.codec.arrays import resolve_dtype

    name = meta.get("dtype") if meta.get("zarr_format") == 2 else meta.get("data_type")
    if not isinstance(name, str) or not name or name.startswith(">"):
        raise NotPlain("dtype")
    try:
        dtype = np.dtype(name) if name[0] in "<|" else resolve_dtype(name)
    except (TypeError, AttributeError, ImportError):
        raise NotPlain("dtype") from None
    if dtype.hasobject or dtype.kind not in "biufcV" or dtype.itemsize == 0:
        raise NotPlain("dtype")
    if re.fullmatch(r"u?int[24]|float[46]_\w+", dtype.name):  # sub-byte: packed on disk
        raise NotPlain("sub-byte dtype")
    return dtype


#: An array's zarr metadata is a few hundred bytes (Orbax writes no attributes there): parsed
#: JSON costs ~30x its size, so the read stops at 1 MiB rather than the 64 MiB of other JSON.
MAX_META_BYTES = 1 << 20
#: At most this many chunk files per array when the caller does not say how many files exist
#: (the params manifest's own limit).
MAX_CHUNK_FILES = 1_000_000
#: The most dimensions an array's metadata may state: the bound the flavor section puts on an
#: export's inputs and outputs (``store.section.MAX_RANK``). A chunk name has one part per
#: dimension, so the rank bounds every name's length.
MAX_RANK = 32
#: The most bytes all chunk names of one array may take together, computed before any is made.
MAX_KEY_BYTES = 64 << 20


def _forged(found: str, expected: str) -> ArtifactError:
    return ArtifactError(
        f"A params array's zarr metadata states {found}; expected {expected}. The checkpoint "
        "is damaged or forged; download the model again."
    )


def _checked_dims(value: Any, what: str) -> tuple[int, ...]:
    """A list of dimensions from the metadata, its length checked before a number is read."""
    if isinstance(value, list | tuple) and len(value) > MAX_RANK:
        raise _forged(f"{len(value)} dimensions in its {what}", f"at most {MAX_RANK}")
    return tuple(int(d) for d in value)


def _key_bytes(n_files: int, prefix: str, rest: str) -> int:
    """The bytes of the names ``f"{prefix}{i}{rest}"`` for ``i < n_files``, by arithmetic."""
    digits, width, start = 0, 1, 0
    while start < n_files:
        end = min(n_files, 10**width)
        digits += (end - start) * width
        start, width = end, width + 1
    return n_files * (len(prefix) + len(rest)) + digits


def array_meta(
    meta: dict, max_files: int | None = None, expect: tuple[int, ...] | None = None
) -> ArrayMeta:
    """Shape, dtype and chunk files of a plain array (raises :class:`NotPlain` otherwise).

    Every size is checked before any chunk name is made: more than :data:`MAX_RANK`
    dimensions, more chunk files than ``max_files`` (the checkpoint's listed files; default
    :data:`MAX_CHUNK_FILES`) or names of more than :data:`MAX_KEY_BYTES` together is an
    :class:`ArtifactError`, whatever the metadata's shape claims. ``expect``: the shape the
    caller needs (the export's); another shape is :class:`NotPlain` before names are made."""
    try:
        shape = _checked_dims(meta["shape"], "shape")
        if expect is not None and shape != tuple(expect):
            raise NotPlain("shape")
        dtype = _dtype(meta)
        if any(d < 0 for d in shape) or sys.byteorder != "little":
            raise NotPlain("shape")
        if meta.get("zarr_format") == 2:
            if meta.get("compressor") is not None or meta.get("filters"):
                raise NotPlain("codecs")
            if meta.get("order") != "C":
                raise NotPlain("codecs")
            outer = inner = _checked_dims(meta["chunks"], "chunks")
            sep, sharded = meta.get("dimension_separator", "."), False
            prefix = ""
        elif meta.get("zarr_format") == 3:
            encoding = meta.get("chunk_key_encoding", {})
            sep = encoding.get("configuration", {}).get("separator", "/")
            if (
                encoding.get("name") != "default"
                or meta.get("chunk_grid", {}).get("name") != "regular"
                or meta.get("storage_transformers")
            ):
                raise NotPlain("zarr metadata")
            outer = _checked_dims(meta["chunk_grid"]["configuration"]["chunk_shape"], "chunks")
            codecs = meta.get("codecs", [])
            raw = [_LE, [{"name": "bytes"}]] if dtype.itemsize == 1 else [_LE]
            if len(codecs) == 1 and codecs[0].get("name") == "sharding_indexed":
                conf = codecs[0]["configuration"]
                inner = _checked_dims(conf["chunk_shape"], "chunks")
                if (
                    conf.get("codecs") not in raw
                    or conf.get("index_location", "end") != "end"
                    or conf.get("index_codecs") != _INDEX_CODECS
                ):
                    raise NotPlain("codecs")
                sharded = True
            elif codecs in raw:
                inner, sharded = outer, False
            else:
                raise NotPlain("codecs")
            prefix = f"c{sep}"
        else:
            raise NotPlain("zarr format")
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise NotPlain("zarr metadata") from e  # Orbax judges (and refuses) it
    if sep not in ("/", "."):
        raise NotPlain("chunk key separator")
    if len(outer) != len(shape) or len(inner) != len(shape) or outer[1:] != shape[1:]:
        raise NotPlain("chunk shape")
    if inner[1:] != shape[1:] or (shape and (not inner[0] or outer[0] % inner[0])):
        raise NotPlain("chunk shape")
    rows = shape[0] if shape else 1
    outer0 = outer[0] if shape else 1
    n_files = -(-rows // outer0) if shape else 1
    limit = MAX_CHUNK_FILES if max_files is None else max_files
    if n_files > limit:
        raise ArtifactError(
            f"A params array's zarr metadata claims shape {list(shape)[:8]} in chunks of "
            f"{outer0} rows: {n_files} chunk files, expected at most {limit} (the files the "
            "checkpoint lists). The checkpoint is damaged or forged; download the model again."
        )
    rest = f"{sep}0" * (len(shape) - 1)
    if _key_bytes(n_files, prefix, rest) > MAX_KEY_BYTES:
        raise _forged(
            f"{n_files} chunk files of rank {len(shape)}",
            f"chunk names of at most {MAX_KEY_BYTES} bytes together",
        )
    if not shape:
        keys = ["c" if prefix else "0"]
    else:
        keys = [f"{prefix}{s}{rest}" for s in range(-(-rows // outer0))] if rows else []
    return ArrayMeta(shape, dtype, keys, outer0, inner[0] if shape else 1, sharded)


def aligned_empty(shape: tuple[int, ...], dtype: Any, align: int = 64) -> Any:
    """Uninitialised numpy array whose data is ``align``-byte aligned (``jax.device_put``
    adopts aligned host buffers on CPU without a copy)."""
    import numpy as np

    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off : off + nbytes].view(dtype).reshape(shape)


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.preadv(fd, [view[: 8 << 20]], offset)
        if n <= 0:
            raise ArtifactError(
                f"Truncated params array file: expected {len(view)} more bytes at offset "
                f"{offset}, found end of file. The artifact is damaged; re-log the model."
            )
        view = view[n:]
        offset += n


def _file_regions(
    fd: int, size: int, rel: str, row0: int, layout: _Layout
) -> list[tuple[int, int, int]]:
    """``(file offset, byte offset in the array, length)`` of every chunk one file holds,
    checked against the file's size (a chunk never written or lying past the end is an error)."""
    import numpy as np

    chunk_bytes = layout.inner0 * layout.row_bytes
    if layout.sharded:
        index_bytes = layout.n_inner * 16
        if size < index_bytes + 4:
            raise ArtifactError(
                f"Truncated params array file {rel}: expected at least {index_bytes + 4} bytes, "
                f"found {size}. Re-log the model."
            )
        index = np.frombuffer(os.pread(fd, index_bytes, size - index_bytes - 4), "<u8")
        entries = [(int(o), int(n)) for o, n in index.reshape(layout.n_inner, 2)]
    else:
        entries = [(0, chunk_bytes)]
    regions = []
    for c_idx, (offset, nb) in enumerate(entries):
        start_row = row0 + c_idx * layout.inner0
        if start_row >= layout.rows:
            break
        if offset == _MISSING and nb == _MISSING:
            raise ArtifactError(
                f"The params array file {rel} marks chunk {c_idx} as never written: expected "
                "every chunk of the array (it would read as zeros). The checkpoint is damaged; "
                "download the model again."
            )
        if nb != chunk_bytes:
            raise NotPlain("chunk size (compressed?)")
        if offset + nb > size:
            raise ArtifactError(
                f"The params array file {rel} is damaged: chunk {c_idx} lies past its end "
                f"({offset + nb} > {size} bytes). Download the model again."
            )
        valid = min(layout.inner0, layout.rows - start_row) * layout.row_bytes
        regions.append((offset, start_row * layout.row_bytes, valid))
    return regions


def read_array(
    root: Path,
    rel_dir: str,
    shape: tuple[int, ...],
    dtype: Any,
    manifest: Any,
    meta: dict | None = None,
    mapped: dict[str, int] | None = None,
) -> Any:
    """Read the array ``rel_dir`` of the checkpoint at ``root`` into an aligned numpy buffer.

    ``manifest`` (``params.manifest.Manifest``) lists the files with their sizes; each chunk
    file's CRC-32C, computed as it is read, is checked with ``manifest.check``. Every chunk file
    must be present and hold the bytes it claims (checked before the buffer is allocated): a
    missing chunk is an error, never zeros. ``mapped`` (not None): an array held whole in one
    file is mapped read-only instead of copied, with the checksums ``mapped`` already knows
    (only for a directory this process owns: a mapped file truncated by another process would
    kill it with SIGBUS). Raises :class:`NotPlain` for layouts it does not read.
    """
    found = prepare_array(root, rel_dir, shape, dtype, manifest, meta, mapped)
    return found.read() if isinstance(found, PendingArray) else found


class PendingArray:
    """An array checked against its metadata and the manifest, its buffer allocated, its chunk
    files not read yet: :meth:`read` reads them (``prepare_array``)."""

    __slots__ = ("_files", "_flat", "_manifest", "_root", "nbytes", "out")

    def __init__(self, root: Path, out: Any, files: list[tuple[str, int, _Layout]], manifest: Any):
        self._root, self.out, self._files, self._manifest = root, out, files, manifest
        self._flat = out.reshape(-1).view("u1") if out.ndim else out.reshape(1).view("u1")
        self.nbytes = int(out.nbytes)

    def read(self, workers: int | None = None) -> Any:
        """Read every chunk file into the buffer, each checked against its CRC-32C; the array.
        ``workers``: threads one file is read on (``codec.checked_read``; default: its own)."""
        from jaxexp_mlflow.codec import files
        from jaxexp_mlflow.codec.checked_read import read_checked
        from jaxexp_mlflow.codec.crc32c import file_crc32c

        flat, manifest = self._flat, self._manifest
        for rel, row0, layout in self._files:
            fd, size = files.open_regular(
                self._root / rel, what=f"params file {rel!r}", max_bytes=manifest.files[rel][0]
            )
            try:
                found = _file_regions(fd, size, rel, row0, layout)
                regions = sorted(
                    ((offset, flat[first : first + n]) for offset, first, n in found),
                    key=lambda r: r[0],
                )
                ends = [o + len(d) for o, d in regions]
                if any(end > nxt for end, (nxt, _) in zip(ends, regions[1:], strict=False)):
                    for offset, dst in regions:  # overlapping chunks: checksum the file alone
                        _pread_into(fd, memoryview(dst), offset)
                    value = file_crc32c(fd, size)
                else:  # one pass: every byte read once, checksummed by the thread that read it
                    value = read_checked(
                        fd, size, regions, what=f"The params file {rel!r}", workers=workers
                    )
                manifest.check(rel, value)
            finally:
                os.close(fd)
        return self.out


def read_all(items: Sequence[Any]) -> list[Any]:
    """``items`` with every :class:`PendingArray` among them read (``prepare_array``), in their
    order; anything else (an array already complete) is passed through.

    An array of more than a quarter of a thread's share is read alone, each of its files on
    every read thread (``codec.checked_read``); the others are read one file to a thread, the
    biggest first, all at once: twenty 25 MiB arrays pay one thread handoff, not twenty. Every
    read has finished when this returns or raises (a failure is raised once all are done).
    """
    from jaxexp_mlflow.codec.checked_read import run_spread, threads

    out = list(items)
    todo = [i for i, x in enumerate(out) if isinstance(x, PendingArray)]
    n = threads()
    total = sum(out[i].nbytes for i in todo)
    alone = [i for i in todo if out[i].nbytes * 4 * n > total]
    rest = sorted(set(todo) - set(alone), key=lambda i: -out[i].nbytes)
    if n == 1 or len(rest) < 2:
        alone, rest = todo, []
    for i in alone:
        out[i] = out[i].read()
    arrays = run_spread([lambda p=out[i]: p.read(1) for i in rest], n)
    for i, array in zip(rest, arrays, strict=True):
        out[i] = array
    return out


def prepare_array(
    root: Path,
    rel_dir: str,
    shape: tuple[int, ...],
    dtype: Any,
    manifest: Any,
    meta: dict | None = None,
    mapped: dict[str, int] | None = None,
    info: ArrayMeta | None = None,
) -> Any:
    """:func:`read_array` up to the reads: the array's metadata and chunk files checked, its
    buffer allocated. Returns a :class:`PendingArray` to read, or the array itself where
    nothing is left to read (an empty array, or a mapping). Raises as :func:`read_array`.
    ``info``: :func:`array_meta` of ``meta`` with this manifest's file count, if the caller
    has it (``params.layout.plain_tree``)."""
    import numpy as np

    if meta is None:
        meta = read_meta(root, rel_dir, manifest.files)
        if meta is None:
            raise NotPlain("no zarr metadata")
    shape, dtype = tuple(int(d) for d in shape), np.dtype(dtype)
    if info is None:
        info = array_meta(meta, len(manifest.files), expect=shape)
    if info.shape != shape or info.dtype != dtype:
        raise NotPlain("shape or dtype")
    rows = shape[0] if shape else 1
    row_bytes = (int(np.prod(shape[1:], dtype=np.int64)) if shape else 1) * dtype.itemsize
    if rows == 0 or row_bytes == 0:
        return aligned_empty(shape, dtype)
    layout = _Layout(rows, row_bytes, info.inner0, info.outer0 // info.inner0, info.sharded)
    missing = [k for k in info.keys if f"{rel_dir}/{k}" not in manifest.files]
    if missing:
        raise ArtifactError(
            f"The params array {rel_dir} lacks its chunk file {missing[0]!r} (and "
            f"{len(missing) - 1} more): expected every chunk of the array, found none, which "
            "would read as zeros. The checkpoint is incomplete; download the model again."
        )
    on_disk = sum(manifest.files[f"{rel_dir}/{k}"][0] for k in info.keys)
    nbytes = rows * row_bytes
    if on_disk < nbytes:  # before allocating: the files must hold the bytes they claim
        raise ArtifactError(
            f"The params array {rel_dir} claims {nbytes} bytes ({dtype.name}{list(shape)}) but "
            f"its chunk files hold {on_disk}. The checkpoint is damaged or forged; download the "
            "model again."
        )
    if mapped is not None and len(info.keys) == 1 and nbytes >= MAP_MIN_BYTES and _CAN_MAP:
        rel = f"{rel_dir}/{info.keys[0]}"
        host = _map(root, rel, shape, dtype, manifest, layout, mapped.get(rel))
        if host is not None:
            return host
    chunks = [(f"{rel_dir}/{key}", i * info.outer0, layout) for i, key in enumerate(info.keys)]
    return PendingArray(root, aligned_empty(shape, dtype), chunks, manifest)


def _map(
    root: Path,
    rel: str,
    shape: tuple[int, ...],
    dtype: Any,
    manifest: Any,
    layout: _Layout,
    known_crc: int | None,
) -> Any:
    """The array as a read-only private mapping of its one chunk file, checksummed whole, or
    None when its bytes are not one run at the start of the file (then it is copied).

    No anonymous memory is touched: the pages are the page cache's, which a download has just
    filled. ``known_crc``: the file's CRC-32C as this process computed it when its download
    wrote the file, checked against the manifest instead of reading the pages again.
    """
    import mmap

    import numpy as np

    from jaxexp_mlflow.codec import files
    from jaxexp_mlflow.codec.crc32c import crc32c

    nbytes = layout.rows * layout.row_bytes
    fd, size = files.open_regular(
        root / rel, what=f"params file {rel!r}", max_bytes=manifest.files[rel][0]
    )
    try:
        regions = _file_regions(fd, size, rel, 0, layout)
        if sum(n for _, _, n in regions) != nbytes or any(o != a for o, a, _ in regions):
            return None
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)
        mapping = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    manifest.check(rel, crc32c(memoryview(mapping)) if known_crc is None else known_crc)
    return np.frombuffer(mapping, dtype, count=nbytes // dtype.itemsize).reshape(shape)
