"""The lite pyfunc at start-up: a fresh process answers stored buckets without jax."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxexp_mlflow  # noqa: F401  (installs mlflow.jaxexp)
from jaxexp_mlflow.internals import jaxlib_private
from jaxexp_mlflow.runtime import lite
from tests.conftest import result_of
from tests.models import batch, mlp_apply

CHILD = r"""
import json, sys
import numpy as np
import mlflow.pyfunc
model = mlflow.pyfunc.load_model(sys.argv[1], model_config={"buckets": [1, 2, 4]})
impl = type(model._model_impl).__name__
out = {"impl": impl, "jax_after_load": "jax" in sys.modules}
x = np.load(sys.argv[2])
out["y"] = model.predict(x).tolist()
out["jax_after_predict"] = "jax" in sys.modules
if sys.argv[3:] == ["fork"]:  # a forked child: the parent's client is not its own
    import os
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, json.dumps(model.predict(x).tolist()).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    out["y_forked"] = json.loads(os.read(r, 1 << 20))
elif len(sys.argv) > 3:
    # float64 (what MLflow's server makes of JSON numbers): cast by the contract, still lite
    out["y64"] = model.predict(x.astype(np.float64)).tolist()
    out["jax_after_cast"] = "jax" in sys.modules
    try:  # a NaN: the contract's typed refusal, as on the JAX path
        model.predict(np.full_like(x, np.nan))
    except Exception as err:
        out["nan_error"] = type(err).__name__
    # a list: an input form the lite path leaves to the JAX path
    out["ylist"] = model.predict(x.tolist()).tolist()
    out["jax_after_list"] = "jax" in sys.modules
print("RESULT " + json.dumps(out))
"""


def child(model_dir: Path, x_file: Path, cache: Path, *extra: str, **env: str) -> dict:
    """Load and predict in a fresh process (jax not imported before the load)."""
    run_env = {**os.environ, "JAXEXP_COMPILATION_CACHE": str(cache), "JAX_PLATFORMS": "cpu"}
    run_env.pop("JAX_COMPILATION_CACHE_DIR", None)
    run_env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    run_env.update(env)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(model_dir), str(x_file), *extra],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # jaxlib loaded without jax keeps XLA's INFO lines off, as `import jax` does
    assert "pjrt_client.cc" not in proc.stderr, proc.stderr[-2000:]
    return result_of(proc)


#: jaxlib releases checked to have every name the lite path needs (docs/internals.md)
LITE_JAXLIBS = ("0.10.2", "0.12.0.1")
needs_lite = pytest.mark.skipif(
    not jaxlib_private.available(), reason="this jaxlib has no lite path (models load via jax)"
)


def test_private_names_present():
    # the public fallback (load through jax) is what runs where one is gone
    import jaxlib

    if jaxlib.__version__ in LITE_JAXLIBS:  # a newer one is judged by its names alone
        assert jaxlib_private.available()
    assert set(jaxlib_private.PRIVATE_NAMES) >= {
        "Client.deserialize_executable",
        "_jax.batched_device_put",
        "_jax.buffer_to_dlpack_managed_tensor",
    }


@needs_lite
def test_cpu_executable_runs_a_jax_executable_exactly():
    f = jax.jit(lambda w, x: jax.nn.relu(x @ w) * 2.0)
    w = np.linspace(-1, 1, 24, dtype=np.float32).reshape(8, 3)
    x = batch(5)
    compiled = f.lower(w, x).compile()
    want = np.asarray(compiled(w, x))
    exe = jaxlib_private.CpuExecutable(
        jaxlib_private.serialize(compiled), [(want.shape, want.dtype)]
    )
    (got,) = exe([w, x])
    assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    with pytest.raises(jaxlib_private.LiteUnavailable):
        jaxlib_private.CpuExecutable(b"not an executable", [(want.shape, want.dtype)])


@pytest.mark.slow
def test_fresh_process_answers_without_jax(mlp_dir, tmp_path):
    model_dir, params = mlp_dir
    cache = tmp_path / "cache"
    x = batch(3)  # bucket 4: padded, then sliced back
    x_file = tmp_path / "x.npy"
    np.save(x_file, x)
    want = np.asarray(jax.jit(mlp_apply)(params, x))

    first = child(model_dir, x_file, cache)  # through jax; stores bucket 4 for the lite path
    assert first["impl"] == "JaxExpPyfunc" and first["jax_after_load"]
    stored = list((cache / lite.LITE_SUBDIR).glob("*.lite"))
    if not jaxlib_private.available():  # the public fallback: through jax, nothing stored
        assert not stored
        again = child(model_dir, x_file, cache)
        assert again["impl"] == "JaxExpPyfunc"
        np.testing.assert_allclose(np.asarray(again["y"], np.float32), want, rtol=1e-5, atol=1e-6)
        return
    assert len(stored) == 1

    written = stored[0].stat().st_mtime_ns
    second = child(model_dir, x_file, cache, "cast")
    # its JAX path (after the list input) found bucket 4 stored: nothing compiled or written
    assert [p.stat().st_mtime_ns for p in (cache / lite.LITE_SUBDIR).glob("*.lite")] == [written]
    assert second["impl"] == "LitePyfunc"
    assert not second["jax_after_load"] and not second["jax_after_predict"]
    got = np.asarray(second["y"], np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert got.tobytes() == np.asarray(first["y"], np.float32).tobytes()
    assert not second["jax_after_cast"]
    assert np.asarray(second["y64"], np.float32).tobytes() == got.tobytes()
    assert second["nan_error"] == "InputError"
    # an input form the lite path does not take: loaded through jax, the same answer
    assert second["jax_after_list"]
    np.testing.assert_allclose(np.asarray(second["ylist"], np.float32), want, rtol=1e-5, atol=1e-6)

    # a child forked after a lite prediction answers through jax, the same
    forked = child(model_dir, x_file, cache, "fork")
    np.testing.assert_allclose(
        np.asarray(forked["y_forked"], np.float32), want, rtol=1e-5, atol=1e-6
    )

    # JAXEXP_LITE=0: through jax as before
    off = child(model_dir, x_file, cache, JAXEXP_LITE="0")
    assert off["impl"] == "JaxExpPyfunc" and off["jax_after_load"]

    # a damaged entry is not run: the load goes through jax and answers the same
    data = bytearray(stored[0].read_bytes())
    data[-1] ^= 0xFF
    stored[0].write_bytes(bytes(data))
    damaged = child(model_dir, x_file, cache)
    assert damaged["jax_after_predict"]
    np.testing.assert_allclose(np.asarray(damaged["y"], np.float32), want, rtol=1e-5, atol=1e-6)


def test_no_entry_when_jax_was_imported_first(mlp_dir, tmp_path):
    # jax imported before the load: its config may not be the environment's, so nothing is
    # stored for the lite path (and no lite path is taken)
    model_dir, _ = mlp_dir
    cache = tmp_path / "cache"
    code = (
        "import sys, jax, numpy as np, mlflow.pyfunc\n"
        "m = mlflow.pyfunc.load_model(sys.argv[1], model_config={'buckets': [2]})\n"
        "print(type(m._model_impl).__name__, m.predict(np.zeros((2, 8), np.float32)).shape)\n"
    )
    env = {**os.environ, "JAXEXP_COMPILATION_CACHE": str(cache), "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    out = subprocess.run(
        [sys.executable, "-c", code, str(model_dir)], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["JaxExpPyfunc", "(2,", "4)"]
    assert not list((cache / lite.LITE_SUBDIR).glob("*.lite"))


def _jax_loaded(pid: int) -> bool | None:
    """Whether process ``pid`` or a descendant has imported jax (jaxlib's ``utils`` module is
    loaded by ``import jax``, not by the lite path); None off Linux."""
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        return any("jaxlib/utils" in m.path for p in procs for m in p.memory_maps())
    except (psutil.Error, OSError, NotImplementedError):
        return None


@needs_lite
@pytest.mark.slow
def test_mlflow_models_serve_answers_from_the_lite_store(mlp_dir, tmp_path):
    from tests.servers import server_env, start_server, stop_server

    model_dir, params = mlp_dir
    cache = tmp_path / "cache"
    x = batch(2)
    x_file = tmp_path / "x.npy"
    np.save(x_file, x)
    child(model_dir, x_file, cache)  # stores bucket 2 (the server's buckets are 1, 2, 4, ...)
    assert list((cache / lite.LITE_SUBDIR).glob("*.lite"))
    env = {**server_env(tmp_path), "JAXEXP_COMPILATION_CACHE": str(cache), "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    proc, url = start_server(str(model_dir), "local", env, tmp_path / "server.log")
    try:
        assert _jax_loaded(proc.pid) in (False, None)  # up without importing jax
        want = np.asarray(jax.jit(mlp_apply)(params, x))
        import requests

        # JSON numbers reach predict as float64: cast by the contract, answered from the store
        got = requests.post(f"{url}/invocations", json={"inputs": x.tolist()}, timeout=60)
        assert got.status_code == 200, got.text
        np.testing.assert_allclose(got.json()["predictions"], want, rtol=1e-5, atol=1e-6)
        # a form the store does not take (a DataFrame): through jax, the same answer
        frame = {"dataframe_split": {"columns": [f"c{i}" for i in range(8)], "data": x.tolist()}}
        got = requests.post(f"{url}/invocations", json=frame, timeout=120)
        assert got.status_code == 200, got.text
        np.testing.assert_allclose(got.json()["predictions"], want, rtol=1e-5, atol=1e-6)
    finally:
        stop_server(proc)


def _same_crc_forgery(data: bytes, at: int) -> bytes:
    """``data`` with its bytes ``at``..``at+8`` changed and its CRC-32C (and length) kept: CRC
    is affine over GF(2), so a chosen change of 4 bytes is cancelled by solving for 4 more."""
    from jaxexp_mlflow.codec.crc32c import crc32c

    zero = crc32c(bytes(len(data)))

    def effect(delta: dict[int, int]) -> int:  # the CRC change a xor of these bytes makes
        buf = bytearray(len(data))
        for i, v in delta.items():
            buf[i] = v
        return crc32c(bytes(buf)) ^ zero

    want = effect({at: 0x5A, at + 1: 0xA5, at + 2: 0x3C, at + 3: 0xC3})
    cols = [effect({at + 4 + b // 8: 1 << (b % 8)}) for b in range(32)]
    # solve sum(x_b * cols[b]) = want over GF(2): Gaussian elimination on 32 bits
    rows = [(cols[b], 1 << b) for b in range(32)]
    basis: dict[int, tuple[int, int]] = {}
    for vec, comb in rows:
        for bit in reversed(range(32)):
            if not vec >> bit & 1:
                continue
            if bit in basis:
                vec, comb = vec ^ basis[bit][0], comb ^ basis[bit][1]
            else:
                basis[bit] = (vec, comb)
                break
    sol, rest = 0, want
    for bit in reversed(range(32)):
        if rest >> bit & 1:
            rest, sol = rest ^ basis[bit][0], sol ^ basis[bit][1]
    assert rest == 0
    out = bytearray(data)
    for i, v in enumerate((0x5A, 0xA5, 0x3C, 0xC3)):
        out[at + i] ^= v
    for b in range(32):
        if sol >> b & 1:
            out[at + 4 + b // 8] ^= 1 << (b % 8)
    assert crc32c(bytes(out)) == crc32c(data) and out != data
    return bytes(out)


@needs_lite
@pytest.mark.slow
def test_entries_follow_the_content_not_the_path(mlp_dir, tmp_path):
    """`mlflow models serve -m runs:/...` downloads into a new directory each time: a copy of the
    model finds the entries its original stored. A copy whose params differ with every
    CRC-32C kept (the manifest cannot tell) does not: entries are keyed by a sha256 of the
    params' files, since an entry holds their values."""
    import shutil

    from jaxexp_mlflow.codec.crc32c import crc32c

    model_dir, params = mlp_dir
    cache = tmp_path / "cache"
    x = batch(3)
    x_file = tmp_path / "x.npy"
    np.save(x_file, x)
    first = child(model_dir, x_file, cache)  # through jax; stores bucket 4
    assert first["impl"] == "JaxExpPyfunc"
    assert len(list((cache / lite.LITE_SUBDIR).glob("*.lite"))) == 1

    copy = tmp_path / "elsewhere" / "model"
    shutil.copytree(model_dir, copy)
    again = child(copy, x_file, cache)
    assert again["impl"] == "LitePyfunc" and not again["jax_after_predict"]
    assert again["y"] == first["y"]

    forged = tmp_path / "forged"
    shutil.copytree(model_dir, forged)
    chunks = [
        p for p in (forged / "params").rglob("*") if p.is_file() and p.parent.name != "params"
    ]
    target = max(chunks, key=lambda p: p.stat().st_size)  # the biggest array's data file
    data = target.read_bytes()
    target.write_bytes(_same_crc_forgery(data, len(data) // 2))
    assert crc32c(target.read_bytes()) == crc32c(data)
    got = child(forged, x_file, cache)
    assert got["impl"] == "JaxExpPyfunc"  # not the original's folded params
    assert got["y"] != first["y"]  # the forged values: checksums detect damage, not forgery


STORES_CHILD = r"""
import json, sys
import numpy as np
import mlflow.pyfunc
from jaxexp_mlflow.runtime import executables
model = mlflow.pyfunc.load_model(sys.argv[1], model_config={"buckets": [1, 2, 4]})
impl = model._model_impl
out = {"impl": type(impl).__name__, "y": model.predict(np.load(sys.argv[2])).tolist()}
out["jax_imported"] = "jax" in sys.modules
if out["impl"] != "LitePyfunc":
    executables.flush()  # the bucket's store entry and the lite entry are written
    writer = getattr(impl, "lite_writer", None)
    out["lite_written"] = None if writer is None else writer.written
    out["buckets_compiled"] = impl._flat.compiles
print("RESULT " + json.dumps(out))
"""


def _stores_child(model_dir: Path, x_file: Path, cache: Path, **env: str) -> dict:
    run_env = {**os.environ, "JAXEXP_COMPILATION_CACHE": str(cache), "JAX_PLATFORMS": "cpu"}
    run_env.pop("JAX_COMPILATION_CACHE_DIR", None)
    run_env.update(env)
    proc = subprocess.run(
        [sys.executable, "-c", STORES_CHILD, str(model_dir), str(x_file)],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return result_of(proc)


@needs_lite
def test_entries_are_stored_when_jax_cache_compiled_them_before(mlp_dir, tmp_path):
    """JAX's persistent cache keys a compile by its module; an executable it hands back
    serializes without its kernels on XLA:CPU. Without this fix a second environment (here
    ``JAX_TRACEBACK_FILTERING``, part of both stores' keys, not of JAX's) compiled the same
    modules, got them from JAX's cache and could store neither entry, in any later process:
    its fresh processes never answered without jax."""
    from jaxexp_mlflow.runtime import executables

    model_dir, params = mlp_dir
    cache = tmp_path / "cache"
    x_file = tmp_path / "x.npy"
    np.save(x_file, batch(3))
    want = np.asarray(jax.jit(mlp_apply)(params, batch(3)))
    lite_dir, exec_dir = cache / lite.LITE_SUBDIR, cache / executables.EXEC_SUBDIR

    def entries() -> tuple[int, int]:
        return len(list(lite_dir.glob("*.lite"))), len(list(exec_dir.glob("*.bin")))

    first = _stores_child(model_dir, x_file, cache)
    assert first["impl"] == "JaxExpPyfunc" and entries() == (1, 1)
    (name,) = first["lite_written"]
    assert name.startswith("jaxexp_lite_") and name.count("_") == 2  # named after its entry

    other = {"JAX_TRACEBACK_FILTERING": "off"}
    second = _stores_child(model_dir, x_file, cache, **other)
    assert second["impl"] == "JaxExpPyfunc" and entries() == (2, 2)
    assert len(second["lite_written"]) == 1 and second["lite_written"][0] != name
    third = _stores_child(model_dir, x_file, cache, **other)
    assert third["impl"] == "LitePyfunc" and not third["jax_imported"]
    for got in (first, second, third):
        np.testing.assert_allclose(np.asarray(got["y"], np.float32), want, rtol=1e-5, atol=1e-6)

    # the entries gone while JAX's cache keeps their compiles (a store interrupted, a store
    # directory cleared): each compiled once more, under a name of its own, and stored
    for path in [*lite_dir.glob("*.lite"), *exec_dir.glob("*.bin")]:
        path.unlink()
    fourth = _stores_child(model_dir, x_file, cache)
    (again,) = fourth["lite_written"]
    assert again.startswith(name + "_") and entries() == (1, 1)
    fifth = _stores_child(model_dir, x_file, cache, JAXEXP_LITE="0")
    assert fifth["impl"] == "JaxExpPyfunc" and fifth["buckets_compiled"] == 0  # read, not compiled
    assert _stores_child(model_dir, x_file, cache)["impl"] == "LitePyfunc"
