"""CRC-32C of buffers and files through ``google_crc32c`` (no JAX, no copies).

A ``memoryview``, ``bytearray`` or mapping is checksummed in place, in hardware (SSE4.2 / ARMv8
CRC) at several GB/s (``benchmarks/bench_params.py``), with the GIL released where
``internals.crc32c_private`` finds google_crc32c's bundled library (else through its public
``google_crc32c.extend``).
"""

from __future__ import annotations

import os

__all__ = ["crc32c", "crc32c_combine", "file_crc32c", "path_crc32c"]

_BLOCK = 8 << 20  # file streaming block: stays in the CPU caches

#: The CRC-32C (Castagnoli) polynomial, bit-reversed, as the reflected CRC uses it.
_POLY = 0x82F63B78
_ONE = 1 << 31  # the polynomial 1 (x^0) in the reflected representation


def _mult_mod_p(a: int, b: int) -> int:
    """``a * b`` modulo the CRC-32C polynomial, both reflected (zlib's ``multmodp``)."""
    m, p = _ONE, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _powers() -> list[int]:
    """``x^(2^k)`` modulo the polynomial for k in 0..66 (bit lengths up to 2^67: any file)."""
    table = [_ONE >> 1]  # x^1
    for _ in range(66):
        table.append(_mult_mod_p(table[-1], table[-1]))
    return table


_X2N = _powers()


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32C of ``A + B`` from ``crc1`` (of A), ``crc2`` (of B) and ``len(B)``, without
    the bytes: ``crc1`` times ``x^(8 * len2)`` modulo the polynomial, plus ``crc2``
    (zlib's ``crc32_combine`` with the Castagnoli polynomial; ~0.1 ms in Python).

    Lets parts of a file be checksummed on several threads, each from 0, and joined in order.
    """
    if not 0 <= len2 < 1 << 64:
        raise ValueError(f"len2 must be in [0, 2**64), found {len2}")
    op, k, n = _ONE, 3, len2  # x^(8 * len2) = x^(len2 * 2^3)
    while n:
        if n & 1:
            op = _mult_mod_p(_X2N[k], op)
        n >>= 1
        k += 1
    return _mult_mod_p(op, crc1) ^ crc2


def crc32c(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC-32C of ``data`` continuing from ``value``."""
    from jaxexp_mlflow.internals.crc32c_private import extend

    view = memoryview(data)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    if not view.nbytes:
        return value
    return extend(value, view)


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
