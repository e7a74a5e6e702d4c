"""The private name of ``internals/crc32c_private`` (google-crc32c's bundled C library through
ctypes): present in the installed wheel (named when not), the same checksums as the public
``google_crc32c.extend``, and the fallback gives them too."""

from __future__ import annotations

import os

import google_crc32c
import numpy as np
import pytest

from jaxexp_mlflow.codec.crc32c import crc32c
from jaxexp_mlflow.internals import crc32c_private


@pytest.fixture
def fresh(monkeypatch):
    crc32c_private.reset()
    yield monkeypatch
    monkeypatch.delenv("JAXEXP_CRC32C_PUBLIC", raising=False)
    crc32c_private.reset()


def _samples():
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, 3 * 2**20 + 7, dtype=np.uint8)
    return [data[:0], data[:1], data[:9], data[5:4101], data[1:], data]


def test_the_private_name_is_there(fresh):
    found = crc32c_private.releases_gil()
    if not found:
        names = ", ".join(crc32c_private.PRIVATE_NAMES)
        if os.environ.get("JAXEXP_STRICT_PRIVATE") == "1":
            pytest.fail(f"missing in this google-crc32c: {names}")
        pytest.skip(f"missing in this google-crc32c (the public fallback runs): {names}")
    assert crc32c_private.extend(0, np.frombuffer(b"123456789", np.uint8)) == 0xE3069283


@pytest.mark.parametrize("public", ["0", "1"], ids=["private", "fallback"])
def test_same_checksums_as_the_public_api(fresh, public):
    fresh.setenv("JAXEXP_CRC32C_PUBLIC", public)
    crc32c_private.reset()
    assert crc32c_private.releases_gil() is (public == "0" and crc32c_private._load() is not None)
    for data in _samples():
        want = int(google_crc32c.extend(0, data)) if data.size else 0
        assert crc32c_private.extend(0, np.ascontiguousarray(data)) == want
        assert crc32c(memoryview(data.tobytes())) == want
        # continued from a previous value, as the block-by-block readers do
        half = data.size // 2
        assert crc32c(data[half:].tobytes(), crc32c(data[:half].tobytes())) == want
