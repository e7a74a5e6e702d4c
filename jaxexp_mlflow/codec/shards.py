"""The chunk file TensorStore writes for an array Orbax stores uncompressed, made from the array.

Orbax stores each array (zarr3, compression off: ``codec.params``) as a ``sharding_indexed`` shard
per write chunk: the whole array on one device, each shard (or Orbax's slice of a replicated
shard) of a sharded one. When the shard holds one inner chunk, the file is the chunk's bytes,
little-endian in C order, followed by the shard index: the inner chunk's offset and length (two
little-endian uint64) and the CRC-32C of those 16 bytes (zarr3 sharding, ``index_location:
end``).

Hand-written (why): ``log_model`` through a tracking server sends such a file straight from the
array's own buffer (``codec.divert``, ``transfer.EarlyUpload``) instead of having TensorStore
write a gigabyte to a staging directory only to read it back, upload it and delete it: on a small
machine that write costs as much CPU as the upload itself (docs/remote.md). TensorStore can only
write the file to a kvstore, not hand its bytes over. :func:`plan` accepts only the layout above
and returns None for anything else (compression, several chunks per fragment, big-endian or
sub-byte dtypes), which Orbax then writes as usual. ``tests/test_shards.py`` checks the bytes
against the files TensorStore writes, dtype by dtype.
"""

from __future__ import annotations

import re
import struct
from typing import Any, NamedTuple

#: Shard index: (offset, nbytes) of the one inner chunk, then its CRC-32C (zarr3 sharding).
_INDEX = struct.Struct("<QQ")

#: numpy kinds whose in-memory bytes are zarr3's ``bytes`` codec output (little-endian hosts).
_KINDS = "biufcV"


class Chunk(NamedTuple):
    """One chunk file of an array: its key inside the array directory (``c/0/0``, as Orbax
    writes it) and the C-contiguous array whose bytes it holds."""

    key: str
    value: Any


def trailer(nbytes: int) -> bytes:
    """The shard index after ``nbytes`` of data: one inner chunk at offset 0, its CRC-32C."""
    from jaxexp_mlflow.codec.manifest import crc32c

    index = _INDEX.pack(0, nbytes)
    return index + struct.pack("<I", crc32c(index))


def parts(value: Any) -> tuple[memoryview, bytes]:
    """The chunk file of ``value`` as (its own buffer, the shard index): no copy."""
    import numpy as np

    # as bytes: ml_dtypes' types (bfloat16, float8) have no buffer format of their own
    view = memoryview(np.asarray(value).reshape(-1).view(np.uint8))
    return view, trailer(view.nbytes)


def _plain_dtype(dtype: Any) -> bool:
    import numpy as np

    dtype = np.dtype(dtype)
    if dtype.byteorder == ">" or dtype.kind not in _KINDS or dtype.itemsize == 0:
        return False
    # ml_dtypes' sub-byte types (int2, int4, float4_e2m1fn, float6_*) are packed on disk
    return re.fullmatch(r"u?int[24]|float[46]_\w+", dtype.name) is None


def plan(tspec: dict[str, Any], fragments: list[tuple[Any, Any]]) -> list[Chunk] | None:
    """The chunk files of the array Orbax is about to write with ``tspec`` (its TensorStore
    spec) from ``fragments`` (``(index, host numpy array)``), each the whole of one chunk file;
    None when the layout is not the one this module writes."""
    meta = tspec.get("metadata") or {}
    codecs = meta.get("codecs")
    if tspec.get("driver") != "zarr3" or not isinstance(codecs, list) or len(codecs) != 1:
        return None
    shard = codecs[0]
    conf = shard.get("configuration") or {}
    grid = (meta.get("chunk_grid") or {}).get("configuration", {}).get("chunk_shape")
    encoding = meta.get("chunk_key_encoding") or {"name": "default"}
    if (
        shard.get("name") != "sharding_indexed"
        or conf.get("codecs") != [{"name": "bytes", "configuration": {"endian": "little"}}]
        or conf.get("index_codecs")
        != [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
        or conf.get("index_location", "end") != "end"
        or not grid
        or tuple(conf.get("chunk_shape") or ()) != tuple(grid)
        or encoding.get("name") != "default"
        or encoding.get("configuration", {}).get("separator", "/") != "/"
        or not fragments
    ):
        return None
    grid = tuple(int(n) for n in grid)
    chunks = []
    for index, value in fragments:
        if (
            tuple(value.shape) != grid
            or not value.flags.c_contiguous
            or not _plain_dtype(value.dtype)
            or str(value.dtype) != str(tspec.get("dtype", value.dtype))
        ):
            return None
        starts = [int(s.start or 0) for s in index]
        if len(starts) != len(grid) or any(s % n for s, n in zip(starts, grid, strict=True)):
            return None
        key = "/".join(str(s // n) for s, n in zip(starts, grid, strict=True))
        chunks.append(Chunk(f"c/{key}", value))
    return chunks
