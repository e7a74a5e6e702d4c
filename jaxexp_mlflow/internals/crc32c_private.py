"""The one private thing of google-crc32c the package uses: its bundled C library, called
through ctypes so that the CRC-32C runs **without the GIL**.

``google_crc32c.extend`` (the public API) holds the GIL while it checksums: a helper thread that
checksums what the main thread has just read (``codec.zarr``'s restore, ``params.memory_crc``
while Orbax writes) then takes turns with it instead of running beside it on another core
(measured on this 2-core VM: two threads 4.6-7.9 GB/s together, one 7.5-8.3 GB/s). ctypes
releases the GIL around a foreign call, so the same function of the same library, reached
through ``ctypes``, lets the two overlap.

The name: ``crc32c_extend(uint32_t crc, const uint8_t* data, size_t count)``, the C API of
Google's crc32c library, in the copy google-crc32c's wheels bundle (``google_crc32c.libs/
libcrc32c-<hash>.so*``, the library its own extension module links to). It is checked on a known
vector when first loaded; where it is absent or gives another answer (a build linked otherwise,
another platform), :func:`extend` falls back to ``google_crc32c.extend``: the same checksum,
with the GIL held. ``JAXEXP_CRC32C_PUBLIC=1`` forces the fallback. See docs/internals.md.
"""

from __future__ import annotations

import os
from typing import Any

#: name -> (where it is used, why, fallback): the row of docs/internals.md
PRIVATE_NAMES: dict[str, tuple[str, str, str]] = {
    "google_crc32c.libs/libcrc32c-*.so:crc32c_extend": (
        "codec/crc32c.py (every CRC-32C of params bytes)",
        "the same CRC-32C without the GIL, so helper threads checksum beside the main thread",
        "public google_crc32c.extend (GIL held)",
    ),
}

_UNSET = object()
_FN: Any = _UNSET
#: CRC-32C of b"123456789" (the standard check value of the Castagnoli polynomial)
_CHECK = 0xE3069283


def _load() -> Any:
    """The ctypes function, or None where the bundled library or its symbol is missing."""
    import ctypes
    import glob
    import importlib.util

    if os.environ.get("JAXEXP_CRC32C_PUBLIC") == "1":
        return None
    spec = importlib.util.find_spec("google_crc32c")
    if spec is None or not spec.origin:
        return None
    site = os.path.dirname(os.path.dirname(spec.origin))
    for path in sorted(glob.glob(os.path.join(site, "google_crc32c.libs", "libcrc32c*.so*"))):
        try:
            fn = ctypes.CDLL(path).crc32c_extend
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        fn.restype = ctypes.c_uint32
        probe = ctypes.create_string_buffer(b"123456789", 9)
        if fn(0, ctypes.addressof(probe), 9) == _CHECK:
            return fn
    return None


def releases_gil() -> bool:
    """Whether :func:`extend` runs without the GIL (the bundled library was found)."""
    global _FN
    if _FN is _UNSET:
        _FN = _load()
    return _FN is not None


def extend(value: int, data: Any) -> int:
    """CRC-32C of ``data`` (a C-contiguous numpy uint8 array) continuing from ``value``."""
    if releases_gil():
        return int(_FN(value, data.ctypes.data, data.nbytes))
    import google_crc32c

    return int(google_crc32c.extend(value, data))


def reset() -> None:
    """Forget the loaded function (tests: after changing ``JAXEXP_CRC32C_PUBLIC``)."""
    global _FN
    _FN = _UNSET
