"""google-crc32c's bundled library of ``internals/crc32c_private``: found and used where the
wheel ships it (named when not), the same CRC-32C as the public ``google_crc32c.extend``, and
the fallback to that call when the library is off, missing or not the library."""

from __future__ import annotations

import os
import sys

import google_crc32c
import numpy as np
import pytest

from jaxexp_mlflow.codec.checked_read import read_checked


def _fresh_choice(monkeypatch):
    from jaxexp_mlflow.internals import crc32c_private

    monkeypatch.setattr(crc32c_private, "_CHOSEN", [])
    return crc32c_private


@pytest.mark.parametrize("n", [0, 1, 7, 4096, (1 << 20) + 3])
def test_native_crc_equals_the_public_api(monkeypatch, n):
    mod = _fresh_choice(monkeypatch)
    data = np.random.default_rng(n).integers(0, 256, n, np.uint8)
    assert mod.native() == bool(mod._library_paths())  # the wheel's library is found and used
    for start in (0, 0x1234ABCD):
        want = int(google_crc32c.extend(start, data.tobytes())) if n else start
        assert mod.extend(start, data) == want
        assert mod.extend(start, memoryview(data.tobytes())) == want  # read-only buffers too


def test_the_private_library_is_present_and_used(monkeypatch):
    mod = _fresh_choice(monkeypatch)
    if not mod._library_paths():
        if os.environ.get("JAXEXP_STRICT_PRIVATE") == "1" and sys.platform.startswith("linux"):
            pytest.fail(f"google-crc32c lacks {list(mod.PRIVATE_NAMES)}: the public extend runs")
        pytest.skip("no bundled library here: the fallback runs (test below)")
    assert mod.native()


def test_crc_falls_back_to_the_public_api(monkeypatch, tmp_path):
    data = np.arange(100_000, dtype=np.uint32).view(np.uint8)
    want = int(google_crc32c.extend(0, data.tobytes()))
    mod = _fresh_choice(monkeypatch)
    monkeypatch.setenv("JAXEXP_CRC32C_NATIVE", "0")  # asked for
    assert not mod.native() and mod.extend(0, data) == want
    mod = _fresh_choice(monkeypatch)
    monkeypatch.delenv("JAXEXP_CRC32C_NATIVE")
    monkeypatch.setattr(mod, "_library_paths", lambda: [])  # the wheel ships no library
    assert not mod.native() and mod.extend(0, data) == want
    mod = _fresh_choice(monkeypatch)
    libc = [p for p in ("/lib/x86_64-linux-gnu/libc.so.6", "/lib64/libc.so.6") if os.path.exists(p)]
    monkeypatch.setattr(mod, "_library_paths", lambda: libc)  # a library without the call
    assert not mod.native() and mod.extend(0, data) == want
    # the whole read path gives the same CRC on the fallback
    path = tmp_path / "array"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        dst = np.empty(data.size, np.uint8)
        assert read_checked(fd, data.size, [(0, memoryview(dst))], min_part=4096) == want
        assert np.array_equal(dst, data)
    finally:
        os.close(fd)
