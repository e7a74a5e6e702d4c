"""The first predict of a fresh load: compiled executables are stored by what
determines them, so a warm first call loads its executable without lowering or compiling."""

from __future__ import annotations

import os

import jax
import mlflow
import numpy as np
import pytest

import jaxexp_mlflow  # noqa: F401  (installs mlflow.jaxexp)
from jaxexp_mlflow.runtime import entries, executables
from jaxexp_mlflow.serving.pyfunc import load_pyfunc
from tests.models import batch, export_mlp, mlp_params

BUCKETS = [1, 2, 4, 8]
_LOWERINGS: list[float] = []


def _count_lowerings(event: str, duration: float, **_: object) -> None:
    if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
        _LOWERINGS.append(duration)


jax.monitoring.register_event_duration_secs_listener(_count_lowerings)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "mlp"
    params = mlp_params()
    mlflow.jaxexp.save_model(export_mlp(params), path, params=params, input_example=batch(2))
    return path


def _load(path, cache_dir, monkeypatch) -> object:
    """A new implementation each time (as a fresh process would build it, once the earlier
    ones have stored what they compiled)."""
    executables.flush()
    monkeypatch.setenv("JAXEXP_PYFUNC_CACHE", "0")
    return load_pyfunc(path, {"compilation_cache": str(cache_dir), "buckets": BUCKETS})


def _entries(cache_dir) -> list:
    executables.flush()  # the store writes on its own thread
    return sorted((cache_dir / executables.EXEC_SUBDIR).glob("*.bin"))


def test_warm_first_call_loads_without_lowering(model_dir, tmp_path, monkeypatch):
    x = batch(3)  # bucket 4
    first = _load(model_dir, tmp_path / "xla", monkeypatch)
    assert isinstance(first._flat, executables.Executables)
    y1 = first.predict(x)
    assert (first._flat.compiles, first._flat.loaded) == (1, 0)
    assert len(_entries(tmp_path / "xla")) == 1

    second = _load(model_dir, tmp_path / "xla", monkeypatch)
    before = len(_LOWERINGS)
    y2 = second.predict(x)
    assert len(_LOWERINGS) == before, "the first predict lowered a function"
    assert (second._flat.compiles, second._flat.loaded) == (0, 1)
    np.testing.assert_array_equal(y1, y2)
    padded = np.concatenate([x, x[-1:]])  # what the bucket runs, through the plain jit
    direct = np.asarray(second._flat._jit(second.model.params, padded)[0])[:3]
    np.testing.assert_array_equal(y2, direct)
    assert second.predict(x) is not None and second._flat.compiles == 0


def test_each_bucket_has_its_own_entry(model_dir, tmp_path, monkeypatch):
    impl = _load(model_dir, tmp_path / "xla", monkeypatch)
    for n in (1, 3, 8):
        impl.predict(batch(n))
    assert impl._flat.compiles == 3
    assert len(_entries(tmp_path / "xla")) == 3
    again = _load(model_dir, tmp_path / "xla", monkeypatch)
    again.predict(batch(2))  # a bucket nobody compiled yet
    assert (again._flat.compiles, again._flat.loaded) == (1, 0)


def test_damaged_entry_is_compiled_again(model_dir, tmp_path, monkeypatch):
    x = batch(4)
    expected = _load(model_dir, tmp_path / "xla", monkeypatch).predict(x)
    (entry,) = _entries(tmp_path / "xla")
    data = bytearray(entry.read_bytes())
    data[-1] ^= 0xFF
    entry.write_bytes(bytes(data))
    impl = _load(model_dir, tmp_path / "xla", monkeypatch)
    np.testing.assert_array_equal(impl.predict(x), expected)
    assert (impl._flat.compiles, impl._flat.loaded) == (1, 0)


def test_symlinked_entry_is_not_read(model_dir, tmp_path, monkeypatch):
    x = batch(4)
    _load(model_dir, tmp_path / "xla", monkeypatch).predict(x)
    (entry,) = _entries(tmp_path / "xla")
    target = tmp_path / "elsewhere.bin"
    os.replace(entry, target)
    entry.symlink_to(target)
    impl = _load(model_dir, tmp_path / "xla", monkeypatch)
    impl.predict(x)
    assert (impl._flat.compiles, impl._flat.loaded) == (1, 0)


def test_other_calls_go_to_the_jitted_function(model_dir, tmp_path, monkeypatch):
    impl = _load(model_dir, tmp_path / "xla", monkeypatch)
    x = jax.numpy.asarray(batch(2))  # not numpy: the plain jit path
    out = impl._flat(impl.model.params, x)
    np.testing.assert_allclose(np.asarray(out[0]), impl.predict(batch(2)), rtol=1e-6)
    assert impl._flat.compiles == 1  # the numpy predict only


def test_no_local_cache_directory_stores_nothing(model_dir, monkeypatch):
    """Without a local cache directory the executables are still kept (bounded),
    but nothing is read from or written to a store."""
    monkeypatch.setenv("JAXEXP_PYFUNC_CACHE", "0")
    impl = load_pyfunc(model_dir, {"compilation_cache": False, "buckets": BUCKETS})
    assert isinstance(impl._flat, executables.Executables) and impl._flat._store is False
    assert impl.predict(batch(2)).shape == (2, 4)
    assert (impl._flat.compiles, impl._flat.loaded) == (1, 0)


def test_a_load_parses_the_mlmodel_once(model_dir, monkeypatch):
    from jaxexp_mlflow.codec import mlmodel

    parses = []
    real = mlmodel.load_yaml
    monkeypatch.setattr(mlmodel, "load_yaml", lambda raw: parses.append(1) or real(raw))
    monkeypatch.setattr(mlmodel, "_PARSED", type(mlmodel._PARSED)())  # as in a fresh process
    monkeypatch.setenv("JAXEXP_PYFUNC_CACHE", "0")
    load_pyfunc(model_dir, {"compilation_cache": False})
    assert len(parses) == 1  # identity, flavor section and the params binding check share it


def test_store_reads_only_intact_regular_files(tmp_path):
    entries.write_entry(tmp_path, tmp_path / "good.bin", b"payload")
    assert entries.read_entry(tmp_path / "good.bin") == (b"", b"payload")
    # a payload with a header of its own (the lite store's): both parts, each checked
    head = b'{"output": 1}'
    entries.write_entry(tmp_path, tmp_path / "headed.bin", b"exe", header=head)
    assert entries.read_entry(tmp_path / "headed.bin", headed=True) == (head, b"exe")
    data = bytearray((tmp_path / "headed.bin").read_bytes())
    data[-5] ^= 1  # inside the header: the HMAC covers it
    (tmp_path / "flipped.bin").write_bytes(bytes(data))
    assert entries.read_entry(tmp_path / "flipped.bin", headed=True) is None
    data = bytearray((tmp_path / "headed.bin").read_bytes())
    at = len(entries.MAGIC) + 64  # the magic and the hex HMAC, then the header
    data[at : at + 4] = (1 << 20).to_bytes(4, "little")  # a header longer than the file
    (tmp_path / "long.bin").write_bytes(bytes(data))
    assert entries.read_entry(tmp_path / "long.bin", headed=True) is None
    os.mkfifo(tmp_path / "fifo.bin")  # refused without blocking
    assert entries.read_entry(tmp_path / "fifo.bin") is None
    (tmp_path / "short.bin").write_bytes(entries.MAGIC + b"0" * 10)
    assert entries.read_entry(tmp_path / "short.bin") is None


def test_an_executable_from_jaxs_cache_is_stored_only_if_it_runs_reloaded(
    model_dir, tmp_path, monkeypatch
):
    """XLA:CPU serializes an executable that JAX's persistent cache handed back without its
    kernels (jax 0.10.2: "Function bitcast_bitcast_fusion not found" once reloaded); the store
    keeps only entries that run reloaded, so every later process still predicts."""
    cache = tmp_path / "xla"
    x = batch(4)
    expected = _load(model_dir, cache, monkeypatch).predict(x)  # compiled, both caches filled
    for entry in _entries(cache):
        entry.unlink()  # JAX's cache keeps its entry: the next compile is a hit there
    second = _load(model_dir, cache, monkeypatch)
    np.testing.assert_array_equal(second.predict(x), expected)
    assert second._flat.compiles == 1
    for _ in range(2):  # whatever was stored, a later process predicts the same
        later = _load(model_dir, cache, monkeypatch)
        np.testing.assert_array_equal(later.predict(x), expected)
        np.testing.assert_array_equal(later.predict(x), expected)


def test_a_stored_executable_that_fails_when_called_is_compiled_again(
    model_dir, tmp_path, monkeypatch
):
    """An entry that loads but fails when called (one written by the store before it proved
    its entries) is removed and the bucket compiled again."""
    from jax.experimental import serialize_executable

    cache = tmp_path / "xla"
    x = batch(4)
    expected = _load(model_dir, cache, monkeypatch).predict(x)
    (entry,) = _entries(cache)
    for e in _entries(cache):
        e.unlink()
    hit = _load(model_dir, cache, monkeypatch)
    hit.predict(x)  # a compile that JAX's persistent cache answered
    exe = hit._flat.executable(x)
    payload, _, _ = serialize_executable.serialize(exe)
    entries.write_entry(entry.parent, entry, payload)  # as the unproved store wrote it
    impl = _load(model_dir, cache, monkeypatch)
    np.testing.assert_array_equal(impl.predict(x), expected)
    if impl._flat.compiles == 1:  # the planted entry failed when called: dropped, compiled
        assert impl._flat.loaded == 0
        again = _load(model_dir, cache, monkeypatch)
        np.testing.assert_array_equal(again.predict(x), expected)
    else:  # this JAX serializes a cache hit whole: the entry ran
        assert impl._flat.loaded == 1


def test_the_store_writes_off_the_first_call(model_dir, tmp_path, monkeypatch):
    """Serializing, proving and writing run on the store's thread; the caller's inputs are
    copied, so a buffer reused after predict cannot reach the proof."""
    import threading

    gate = threading.Event()
    real = executables.write_executable

    def held(*args):
        gate.wait(30)
        return real(*args)

    monkeypatch.setattr(executables, "write_executable", held)
    x = np.array(batch(4))  # a writable buffer of the caller's
    impl = _load(model_dir, tmp_path / "xla", monkeypatch)
    y = impl.predict(x)  # returns while the store's thread waits
    assert not list((tmp_path / "xla" / executables.EXEC_SUBDIR).glob("*.bin"))
    x[:] = np.nan  # the caller reuses its buffer
    gate.set()
    (entry,) = _entries(tmp_path / "xla")
    again = _load(model_dir, tmp_path / "xla", monkeypatch)
    np.testing.assert_array_equal(again.predict(batch(4)), y)
    assert (again._flat.compiles, again._flat.loaded) == (0, 1)
