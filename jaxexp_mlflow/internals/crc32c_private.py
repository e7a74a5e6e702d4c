"""CRC-32C that releases the GIL on any buffer: google_crc32c's bundled C library, via ctypes.

``google_crc32c.extend`` (the public API) releases the GIL only for a ``bytes`` object of at
least 1 MiB: on a numpy array, a ``memoryview`` or a mapping it holds the GIL, so two threads
checksumming params never run at once (measured: two 256 MiB checksums on two threads take
38.6 ms where one takes 20.5 ms). The wheel of google-crc32c carries Google's crc32c library
as a shared object of its own (``google_crc32c.libs/libcrc32c-<hash>.so`` on Linux,
``google_crc32c/.dylibs/`` on macOS), whose C API ``crc32c_extend(crc, data, count)`` is
public; a ctypes call releases the GIL (the same two checksums: 18.7 ms). Where the library
sits, and that the wheel ships it apart, is the wheel's private layout: this module is the one
place that relies on it.

The public fallback: when the library is not found, does not load, or fails the self-test
against ``google_crc32c.extend`` (a known vector and a random block), :func:`extend` is
``google_crc32c.extend`` itself: every answer is the same, only slower on several threads.
``JAXEXP_CRC32C_NATIVE=0`` forces the fallback. ``tests/internals/test_crc32c_private.py`` checks
both.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from jaxexp_mlflow import settings

__all__ = ["PRIVATE_NAMES", "extend", "native"]

#: name -> (what we use it for, what happens without it)
PRIVATE_NAMES: dict[str, tuple[str, str]] = {
    "google_crc32c.libs/libcrc32c*.so* (.dylibs/libcrc32c*.dylib): crc32c_extend": (
        "CRC-32C of params buffers with the GIL released, so reading threads checksum at once",
        "google_crc32c.extend: the same values, one checksum at a time",
    ),
}

_LOCK = threading.Lock()
_CHOSEN: list[Callable[[int, Any], int]] = []


def _library_paths() -> list[str]:
    import glob

    import google_crc32c

    here = os.path.dirname(os.path.abspath(google_crc32c.__file__))
    patterns = (
        os.path.join(here, os.pardir, "google_crc32c.libs", "libcrc32c*.so*"),
        os.path.join(here, ".dylibs", "libcrc32c*.dylib"),
    )
    return sorted(p for pattern in patterns for p in glob.glob(pattern))


def _load_native() -> Callable[[int, Any], int] | None:
    """``extend`` over the bundled library, or None when it is absent or disagrees."""
    import ctypes

    import google_crc32c
    import numpy as np

    for path in _library_paths():
        try:
            fn = ctypes.CDLL(path).crc32c_extend
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_uint32
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]

        def native_extend(value: int, data: Any, _fn: Any = fn) -> int:
            arr = np.frombuffer(data, np.uint8)  # keeps the buffer alive through the call
            if not arr.size:
                return int(value)
            return int(_fn(value, arr.ctypes.data, arr.size))

        block = np.random.default_rng(0).integers(0, 256, 4099, np.uint8)
        if (
            native_extend(0, b"123456789") == 0xE3069283
            and native_extend(7, block) == int(google_crc32c.extend(7, block))
            and native_extend(5, b"") == 5
        ):
            return native_extend
    return None


def _fallback(value: int, data: Any) -> int:
    import google_crc32c
    import numpy as np

    return int(google_crc32c.extend(value, np.frombuffer(data, np.uint8)))


def _choose() -> Callable[[int, Any], int]:
    with _LOCK:
        if not _CHOSEN:
            fn = None
            if settings.JAXEXP_CRC32C_NATIVE.get():
                try:
                    fn = _load_native()
                except Exception:  # noqa: BLE001 - any surprise: the public API
                    fn = None
            _CHOSEN.append(fn or _fallback)
        return _CHOSEN[0]


def extend(value: int, data: Any) -> int:
    """CRC-32C of the bytes of ``data`` (any C-contiguous buffer) continuing from ``value``;
    releases the GIL while it runs where the bundled library is usable."""
    return (_CHOSEN[0] if _CHOSEN else _choose())(value, data)


def native() -> bool:
    """Whether :func:`extend` runs the bundled library (False: ``google_crc32c.extend``)."""
    return _choose() is not _fallback
