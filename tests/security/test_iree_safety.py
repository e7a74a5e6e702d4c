"""A model directory and the IREE compile cache are untrusted input.

* Results: the buffers the compiled module returns are checked against the blob's out avals
  (element type and shape, symbolic dims solved from the inputs) before they are read; a
  prepared module is tied to its blob (``iree.blob_sha256``) and its interface to the blob's
  avals, and refused before it runs.
* Compile cache: every entry carries the sha256 of its bytes and of its key; a damaged or
  truncated entry is discarded and recompiled (a warning), never run. Damaged entries are loaded
  in a child process: before the fix they ended processes (SIGBUS on the mapped entry, SIGILL,
  SIGSEGV) or raised untyped errors.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("iree.runtime")
pytest.importorskip("iree.compiler")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import yaml  # noqa: E402

import jaxexp_mlflow.flavors.jaxexp as flavor  # noqa: E402
from jaxexp_mlflow.codec import blob  # noqa: E402
from jaxexp_mlflow.errors import ArtifactError  # noqa: E402
from jaxexp_mlflow.iree import compiler, loader  # noqa: E402
from jaxexp_mlflow.iree import model as iree_model  # noqa: E402
from tests.conftest import REPO, result_of  # noqa: E402

#: The blob says float32[b, 3] -> float32[b, 3]; these modules return something else.
RETURNS_I8 = """
func.func @main(%a: tensor<?x3xf32>) -> tensor<?x3xi8> {
  %0 = stablehlo.convert %a : (tensor<?x3xf32>) -> tensor<?x3xi8>
  return %0 : tensor<?x3xi8>
}
"""
RETURNS_TWICE_THE_ROWS = """
func.func @main(%a: tensor<?x3xf32>) -> tensor<?x3xf32> {
  %0 = stablehlo.concatenate %a, %a, dim = 0 : (tensor<?x3xf32>, tensor<?x3xf32>) -> tensor<?x3xf32>
  return %0 : tensor<?x3xf32>
}
"""
#: The sdy model below takes float32[b]; a prepared module returning int8 instead.
PREPARED_RETURNS_I8 = """
func.func public @main(%a: tensor<?xf32>) -> tensor<?xi8> {
  %0 = stablehlo.convert %a : (tensor<?xf32>) -> tensor<?xi8>
  return %0 : tensor<?xi8>
}
"""


def _mlmodel(path):
    return yaml.safe_load((path / "MLmodel").read_text())


def _write_mlmodel(path, mlmodel):
    (path / "MLmodel").write_text(yaml.safe_dump(mlmodel))


@pytest.fixture(scope="module")
def doubling():
    """A float32[b, 3] -> float32[b, 3] blob's description."""
    (b,) = jax.export.symbolic_shape("b")
    exp = jax.export.export(jax.jit(lambda x: x * 2))(jax.ShapeDtypeStruct((b, 3), jnp.float32))
    data = exp.serialize()
    return data, blob.describe(data, source="doubling")


def _sdy_model(path, fn):
    """Save a single-device sharded export of ``fn`` on float32[b]: save stores a prepared
    module (sdy stripped) beside the blob."""
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    jitted = jax.jit(fn, in_shardings=sharding, out_shardings=sharding)
    (b,) = jax.export.symbolic_shape("b")
    exp = jax.export.export(jitted)(jax.ShapeDtypeStruct((b,), jnp.float32))
    flavor.save_model(exp.serialize(), path)
    assert _mlmodel(path)["flavors"]["jaxexp"]["iree"]["module"]
    return exp


@pytest.fixture(scope="module")
def sdy_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sdy")
    sin = _sdy_model(root / "sin", lambda a: jnp.sin(a) * 2)
    cos = _sdy_model(root / "cos", lambda a: jnp.cos(a) * 3)
    return root, sin, cos


# -- defect 5: results read as the blob declares them ------------------------------------------


def test_result_of_another_dtype_is_refused_not_read(doubling):
    """A module returning int8 where the blob says float32: before, its 12-byte buffer was read
    as 48 bytes (a 256 MiB result crashed the process). Refused at load (the module's interface)
    or, if that is bypassed, before the buffer is read."""
    _, description = doubling
    vmfb = compiler.compile_module(RETURNS_I8.encode())
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    with pytest.raises(ArtifactError, match="int8|i8") as err:
        iree_model.IreeModel(vmfb, description, {}, [])(x)
    assert "float32" in str(err.value)


def test_result_buffer_checked_even_when_interface_check_is_bypassed(doubling, monkeypatch):
    """The call-time check stands on its own: element type read from the runtime's buffer view."""
    _, description = doubling
    monkeypatch.setattr(iree_model, "check_interface", lambda *a, **k: None, raising=False)
    vmfb = compiler.compile_module(RETURNS_I8.encode())
    model = iree_model.IreeModel(vmfb, description, {}, [])
    with pytest.raises(ArtifactError, match="element type"):
        model(np.ones((4, 3), np.float32))


def test_result_of_another_shape_is_refused(doubling):
    """Symbolic dims are solved from the inputs: b = 4 expects float32[4, 3], not [8, 3]."""
    _, description = doubling
    vmfb = compiler.compile_module(RETURNS_TWICE_THE_ROWS.encode())
    model = iree_model.IreeModel(vmfb, description, {}, [])
    with pytest.raises(ArtifactError, match=r"\(4, 3\).*\(8, 3\)|\[4, 3\].*\[8, 3\]"):
        model(np.ones((4, 3), np.float32))


def test_prepared_module_swapped_for_another_dtype_is_refused_before_running(
    sdy_models, tmp_path, monkeypatch
):
    """The prepared module replaced by one returning int8, its MLmodel checksum updated to
    match (what a hostile directory does): refused at load, before any call."""
    root, _, _ = sdy_models
    path = tmp_path / "m"
    shutil.copytree(root / "sin", path)
    mlmodel = _mlmodel(path)
    section = mlmodel["flavors"]["jaxexp"]["iree"]
    text = PREPARED_RETURNS_I8.encode()
    (path / section["module"]).write_bytes(text)
    section["module_sha256"] = hashlib.sha256(text).hexdigest()
    _write_mlmodel(path, mlmodel)

    def never_run(self, leaves):
        raise AssertionError("the swapped module was run")

    monkeypatch.setattr(iree_model.IreeModel, "call_flat", never_run)
    with pytest.raises(ArtifactError, match="prepared module") as err:
        flavor.load_model(str(path), backend="iree")(np.ones(4, np.float32))
    assert "i8" in str(err.value) and "float32" in str(err.value)


def test_prepared_module_of_another_blob_is_refused_before_compiling(
    sdy_models, tmp_path, monkeypatch
):
    """The iree section and module of another model (same avals, another function) copied in:
    before, it ran cos*3 in place of sin*2 silently. The section records its blob's sha256."""
    root, sin, _ = sdy_models
    path = tmp_path / "m"
    shutil.copytree(root / "sin", path)
    other = _mlmodel(root / "cos")["flavors"]["jaxexp"]["iree"]
    shutil.copy(root / "cos" / other["module"], path / other["module"])
    mlmodel = _mlmodel(path)
    mlmodel["flavors"]["jaxexp"]["iree"] = other
    _write_mlmodel(path, mlmodel)

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled a prepared module not tied to the blob")

    monkeypatch.setattr(compiler, "compiled", no_compile)
    with pytest.raises(ArtifactError, match="blob_sha256"):
        flavor.load_model(str(path), backend="iree")
    monkeypatch.undo()
    x = np.linspace(0, 1, 5, dtype=np.float32)  # the untouched model still runs, right
    model = flavor.load_model(str(root / "sin"), backend="iree")
    np.testing.assert_allclose(model(x), np.asarray(sin.call(x)), rtol=1e-6)


# -- defect 8: compile-cache entries verified before they are loaded ----------------------------

DAMAGED_CACHE = r"""
import json, logging, os, sys
import numpy as np
from jaxexp_mlflow.iree import loader

data = open(sys.argv[1], "rb").read()
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger("jaxexp_mlflow").addHandler(Keep())
results = {}
for kind, cache in zip(sys.argv[2::2], sys.argv[3::2]):  # each kind damages a cache of its own
    records.clear()
    entries = [os.path.join(cache, n) for n in os.listdir(cache) if not n.endswith(".tmp")]
    for entry in entries:
        raw = open(entry, "rb").read()
        if kind == "truncated":
            raw = raw[: len(raw) // 2]
        elif kind == "empty":
            raw = b""
        elif kind == "bitflip":  # a few bits in the middle of the compiled code
            mid = bytearray(raw)
            for i in range(len(mid) // 2, len(mid) // 2 + 64, 8):
                mid[i] ^= 0x10
            raw = bytes(mid)
        open(entry, "wb").write(raw)
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    model = loader.build(data, {}, source="doubling", iree_cache=cache)
    y = model(x)
    again = loader.build(data, {}, source="doubling", iree_cache=cache)(x)  # good again
    results[kind] = {
        "ok": bool(np.array_equal(y, x * 2) and np.array_equal(again, x * 2)),
        "warnings": [r for r in records if "cache" in r],
    }
print("RESULT " + json.dumps(results))
"""

DAMAGE_KINDS = ("truncated", "bitflip", "empty")


@pytest.fixture(scope="module")
def compiled_caches(doubling, tmp_path_factory) -> dict[str, Path]:
    """IREE caches compiled once under the test run's secret: ``doubling`` holds the doubling
    blob's entry, ``triple`` an x*3 module's; never altered (a test copies what it damages)."""
    data, _ = doubling
    root = tmp_path_factory.mktemp("compiled")
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    np.testing.assert_array_equal(
        loader.build(data, {}, source="doubling", iree_cache=str(root / "doubling"))(x), x * 2
    )
    triple = jax.export.export(jax.jit(lambda x: x * 3))(
        jax.ShapeDtypeStruct((jax.export.symbolic_shape("b")[0], 3), jnp.float32)
    )
    loader.build(triple.serialize(), {}, source="triple", iree_cache=str(root / "triple"))
    return {"doubling": root / "doubling", "triple": root / "triple"}


@pytest.fixture(scope="module")
def damaged_outcomes(doubling, compiled_caches, tmp_path_factory) -> dict[str, dict]:
    """By damage kind: what ONE child (a damaged entry may end a process) saw loading the
    doubling blob from a copy of a good cache damaged that way: ``ok`` (both loads doubled)
    and the cache warnings. Each kind's cache is its own copy of ``compiled_caches``'."""
    data, _ = doubling
    root = tmp_path_factory.mktemp("damaged")
    good = compiled_caches["doubling"]
    (root / "blob").write_bytes(data)
    assert [p for p in good.iterdir() if p.suffix != ".tmp"]
    args = []
    for kind in DAMAGE_KINDS:
        shutil.copytree(good, root / kind)
        args += [kind, str(root / kind)]
    proc = subprocess.run(
        [sys.executable, "-c", DAMAGED_CACHE, str(root / "blob"), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
    )
    return result_of(proc)


@pytest.mark.parametrize("kind", DAMAGE_KINDS)
def test_damaged_cache_entry_is_recompiled_never_run(damaged_outcomes, kind):
    result = damaged_outcomes[kind]
    assert result["ok"], result
    assert len(result["warnings"]) == 1, result["warnings"]  # discarded once, then good again
    assert "recompil" in result["warnings"][0]


def test_cache_entry_of_another_key_is_not_run(doubling, compiled_caches, tmp_path, caplog):
    """An intact entry stored under another module's key (renamed or copied): refused by the key
    it records, recompiled."""
    data, _ = doubling
    cache = tmp_path / "cache"
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    shutil.copytree(compiled_caches["doubling"], cache)  # what loading the doubling blob stored
    (entry,) = [p for p in cache.iterdir() if p.suffix != ".tmp"]
    shutil.copytree(compiled_caches["triple"], cache, dirs_exist_ok=True)  # and the x*3 module
    (tentry,) = [p for p in cache.iterdir() if p.suffix != ".tmp" and p != entry]
    shutil.copy(tentry, entry)  # the x*3 module under the x*2 key
    with caplog.at_level("WARNING", logger="jaxexp_mlflow"):
        y = loader.build(data, {}, source="doubling", iree_cache=str(cache))(x)
    np.testing.assert_array_equal(y, x * 2)
    assert any("recompil" in r.getMessage() for r in caplog.records)


def test_cache_entry_forged_for_another_key_is_not_run(doubling, compiled_caches, tmp_path, caplog):
    """Another module's intact entry with its header rewritten for this key (the key, size and
    sha256 all consistent, as anyone who can write the cache directory can make them): the
    HMAC under this user's secret does not verify, so it is recompiled, never run."""
    import json

    data, _ = doubling
    cache = tmp_path / "cache"
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    shutil.copytree(compiled_caches["doubling"], cache)  # what loading the doubling blob stored
    (entry,) = [p for p in cache.iterdir() if p.suffix == compiler.ENTRY_SUFFIX]
    key = entry.name[: -len(compiler.ENTRY_SUFFIX)]
    shutil.copytree(compiled_caches["triple"], cache, dirs_exist_ok=True)  # and the x*3 module
    (tentry,) = [p for p in cache.iterdir() if p.suffix == compiler.ENTRY_SUFFIX and p != entry]
    raw = tentry.read_bytes()
    end = raw.index(b"\n", len(compiler.ENTRY_MAGIC))
    header = json.loads(raw[len(compiler.ENTRY_MAGIC) : end])
    header["key"] = key  # the x*3 module, its header claiming the x*2 key
    entry.write_bytes(compiler.ENTRY_MAGIC + json.dumps(header).encode() + raw[end:])
    with caplog.at_level("WARNING", logger="jaxexp_mlflow"):
        y = loader.build(data, {}, source="doubling", iree_cache=str(cache))(x)
    np.testing.assert_array_equal(y, x * 2)
    assert any("recompil" in r.getMessage() for r in caplog.records)


def test_cache_entry_of_another_machine_is_not_run(doubling, tmp_path, monkeypatch, caplog):
    """A cache copied from another machine: its entries were signed with another secret."""
    data, _ = doubling
    cache = tmp_path / "cache"
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "other-machine"))
    loader.build(data, {}, source="doubling", iree_cache=str(cache))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "this-machine"))
    with caplog.at_level("WARNING", logger="jaxexp_mlflow"):
        y = loader.build(data, {}, source="doubling", iree_cache=str(cache))(x)
    np.testing.assert_array_equal(y, x * 2)
    assert any("HMAC" in r.getMessage() for r in caplog.records)


# -- compile fallback: speed flags by default, base flags if they fail ------


def test_failing_speed_flags_fall_back_reproduce_and_the_failure_is_cached(
    doubling, tmp_path, monkeypatch, caplog
):
    """A speed flag set iree-compile refuses (as a crash on eqx_attention would fail it): the
    model compiles with the base flags and reproduces; the failure is recorded under its key,
    so the next load neither compiles with it again nor compiles at all."""
    data, _ = doubling
    cache = tmp_path / "cache"
    monkeypatch.setattr(compiler, "SPEED_FLAGS", ("--jaxexp-no-such-iree-flag",))
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    with caplog.at_level("WARNING", logger="jaxexp_mlflow"):
        model = loader.build(data, {}, source="doubling", iree_cache=str(cache))
    np.testing.assert_array_equal(model(x), x * 2)
    np.testing.assert_array_equal(model(x[:1]), x[:1] * 2)  # the batch-1 function
    assert model._batch1 is not None
    assert any("--jaxexp-no-such-iree-flag" in r.getMessage() for r in caplog.records)
    failed = sorted(p.name for p in cache.glob(f"*{compiler.FAILED_SUFFIX}"))
    assert len(failed) == 1 and len(list(cache.glob(f"*{compiler.ENTRY_SUFFIX}"))) == 1
    calls = []
    monkeypatch.setattr(compiler, "compile_module", lambda *a, **k: calls.append(a))
    again = loader.build(data, {}, source="doubling", iree_cache=str(cache))
    np.testing.assert_array_equal(again(x), x * 2)
    assert calls == []  # the failed setting was skipped, the fallback read from the cache


def test_failing_batch1_function_falls_back_to_main_alone(doubling, tmp_path, monkeypatch):
    """When the batch-1 function cannot be added, the module compiles as before: main alone,
    called at every batch size, and still reproduces."""
    data, _ = doubling

    def refuse(text, entry):
        raise compiler.EntryError("refused by the test")

    monkeypatch.setattr(compiler, "add_entry", refuse)
    model = loader.build(data, {}, source="doubling", iree_cache=str(tmp_path / "cache"))
    assert model._batch1 is None
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    np.testing.assert_array_equal(model(x[:1]), x[:1] * 2)
    np.testing.assert_array_equal(model(x), x * 2)
    assert len(list((tmp_path / "cache").glob(f"*{compiler.FAILED_SUFFIX}"))) == 2


def test_attempts_and_opt_out(monkeypatch):
    """Speed flags with the entry, then base flags with it, then base flags alone;
    ``JAXEXP_IREE_SPEED=0`` leaves the base flags alone."""
    entry = compiler.Entry("f", ((1, 3),), ((1, 3),))
    monkeypatch.delenv(compiler.ENV_FLAGS, raising=False)
    monkeypatch.delenv(compiler.ENV_SPEED, raising=False)
    base = compiler.FLAGS
    assert compiler.attempts(None, entry) == [
        (base + compiler.SPEED_FLAGS, entry),
        (base, entry),
        (base, None),
    ]
    assert compiler.attempts(None, None) == [(base + compiler.SPEED_FLAGS, None), (base, None)]
    monkeypatch.setenv(compiler.ENV_SPEED, "0")
    assert compiler.attempts(None, entry) == [(base, None)]
    keys = {compiler.cache_key(b"m", base, e) for e in (None, entry)}
    assert len(keys) == 2  # the entry is part of the key
