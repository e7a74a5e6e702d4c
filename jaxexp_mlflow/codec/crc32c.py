"""CRC-32C of buffers and files through ``google_crc32c``'s public API (no JAX, no copies).

``google_crc32c.extend`` takes any read-only buffer that has no release hook; a numpy view of
the bytes is one, so a ``memoryview``, ``bytearray`` or mapping is checksummed in place, in
hardware (SSE4.2 / ARMv8 CRC) at several GB/s (``benchmarks/bench_params.py``).
"""

from __future__ import annotations

import os

__all__ = ["crc32c", "file_crc32c", "path_crc32c"]

_BLOCK = 8 << 20  # file streaming block: stays in the CPU caches


def crc32c(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC-32C of ``data`` continuing from ``value``."""
    import google_crc32c
    import numpy as np

    view = memoryview(data)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    if not view.nbytes:
        return value
    return int(google_crc32c.extend(value, np.frombuffer(view, np.uint8)))


def file_crc32c(fd: int, size: int, offset: int = 0, value: int = 0) -> int:
    """CRC-32C of ``size`` bytes of an open file from ``offset``, streamed in 8 MiB blocks."""
    from jaxexp_mlflow.codec.files import fail

    buf = bytearray(min(_BLOCK, max(size, 1)))
    view = memoryview(buf)
    while size > 0:
        n = os.preadv(fd, [view[: min(size, len(buf))]], offset)
        if n <= 0:
            raise fail(
                f"A params file ended {size} bytes early while it was checksummed. The checkpoint "
                "is damaged; download the model again."
            )
        value = crc32c(view[:n], value)
        size -= n
        offset += n
    return value


def path_crc32c(path: str | os.PathLike) -> int:
    """CRC-32C of a whole regular file, read in 8 MiB blocks (a mapping would count the whole
    file in the RSS while it lasts)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        return file_crc32c(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
