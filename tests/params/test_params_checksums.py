"""The params manifest's checksums taken from memory while Orbax writes (``params.memory_crc``),
and the proof that keeps "never log what cannot load": the read-back reads every file against
them (real Orbax, real files, real MLflow save)."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import mlflow
import numpy as np
import pytest

import jaxexp_mlflow  # noqa: F401  (registers mlflow.jaxexp)
from jaxexp_mlflow import params as P
from jaxexp_mlflow.codec.zarr import is_chunk_file
from jaxexp_mlflow.errors import ArtifactError
from jaxexp_mlflow.params import orbax_io
from jaxexp_mlflow.params.manifest import MANIFEST_FILE
from jaxexp_mlflow.params.memory_crc import MemoryChecksums
from tests.conftest import device_child


def _tree():
    rng = np.random.default_rng(1)
    big = np.asarray(rng.standard_normal((1300, 1024)), np.float32)  # 5.1 MiB: several blocks
    return {
        "big": big,
        "jax_bf16": jnp.asarray(rng.standard_normal((33, 7)), jnp.bfloat16),
        "transposed": big[:64, :48].T,  # not C-contiguous: checksummed from the file
        "ints": np.arange(-5, 5, dtype=np.int8),
        "flags": np.array([True, False, True]),
        "c64": (rng.standard_normal(6) + 1j).astype(np.complex64),
        "scalar": np.asarray(2.5, np.float64),  # 0-d: chunk file "0"
        "zeros": jnp.zeros((4, 4), jnp.float32),
    }


def _entries(path: Path) -> dict:
    return json.loads((path / MANIFEST_FILE).read_text())["files"]


def test_memory_checksums_equal_the_files_checksums(tmp_path):
    tree = _tree()
    P.save_params(tree, tmp_path / "files", checksums="files")
    P.save_params(tree, tmp_path / "memory", checksums="memory")
    mem, disk = _entries(tmp_path / "memory"), _entries(tmp_path / "files")
    assert mem.keys() == disk.keys()
    chunks = [rel for rel in mem if is_chunk_file(rel)]  # the others hold timestamps
    chunks = [rel for rel in chunks if not rel.startswith("array_metadatas/")]
    assert len(chunks) == 8 and all(mem[rel] == disk[rel] for rel in chunks)
    # which files came from memory: every C-contiguous array, not the transposed view
    listed = {rel: v["size"] for rel, v in _entries(tmp_path / "memory").items()}
    known = MemoryChecksums(tree).start().files(tmp_path / "memory", listed)
    assert set(known) == set(chunks) - {"transposed/0.0"}
    assert not any(rel.startswith("transposed/") for rel in known)
    assert all(
        _entries(tmp_path / "files")[rel]["crc32c"] == f"{c:08x}" for rel, (_, c) in known.items()
    )
    out = P.restore_params(tmp_path / "memory", target=P.checkpoint_tree(tmp_path / "memory"))
    np.testing.assert_array_equal(np.asarray(out["big"]), tree["big"])
    np.testing.assert_array_equal(np.asarray(out["transposed"]), tree["transposed"])


def test_unknown_checksum_source_is_refused(tmp_path):
    with pytest.raises(ValueError, match="checksums='disk' is not supported"):
        P.save_params({"w": np.ones(3, np.float32)}, tmp_path / "ck", checksums="disk")
    assert not (tmp_path / "ck").exists()


def test_a_byte_changed_after_the_write_is_caught(tmp_path):
    tree = _tree()
    ck = tmp_path / "ck"
    P.save_params(tree, ck, checksums="memory")
    chunk = ck / "big" / "0.0"
    with open(chunk, "r+b") as f:
        f.seek(4097)
        byte = f.read(1)
        f.seek(4097)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(ArtifactError, match="does not match its checksum"):
        P.verify_manifest(ck).verify_files()
    with pytest.raises(ArtifactError, match="does not match its checksum"):
        P.restore_params(ck, target=P.checkpoint_tree(ck))


def test_a_truncated_file_is_refused_before_allocating(tmp_path):
    ck = tmp_path / "ck"
    P.save_params(_tree(), ck, checksums="memory")
    size = (ck / "big" / "0.0").stat().st_size
    os.truncate(ck / "big" / "0.0", size - 1)
    with pytest.raises(ArtifactError, match=rf"big/0.0: expected {size} bytes, found {size - 1}"):
        P.restore_params(ck, target=P.checkpoint_tree(ck))


def _fn(p, x):
    return x * jnp.sum(p["w"][:1])


@pytest.mark.parametrize("bind", [False, True], ids=["proven-from-memory", "over-the-limit"])
def test_save_model_refuses_params_files_that_differ_from_the_params(tmp_path, monkeypatch, bind):
    """A file whose bytes differ from the params given (a byte flipped between TensorStore's
    write and the read-back: the fault is injected there) is refused by the read-back, which
    binds the given params (their checksums were taken from memory; or over the restore limit)
    rather than restore a second copy: nothing is left at the path. The compressed path, which
    restores, is in tests/flavors/test_save_runs.py."""
    if bind:
        monkeypatch.setenv("JAXEXP_READBACK_RESTORE_MAX_BYTES", "0")
    real_save = orbax_io.save

    def save_then_damage(params, path, **kw):
        real_save(params, path, **kw)
        chunk = Path(path) / "w" / "0.0"
        data = bytearray(chunk.read_bytes())
        data[100] ^= 0x01
        chunk.write_bytes(bytes(data))

    monkeypatch.setattr(orbax_io, "save", save_then_damage)
    params = {"w": np.random.default_rng(2).standard_normal((64, 32)).astype(np.float32)}
    target = tmp_path / "model"
    with pytest.raises(ArtifactError, match="does not load back.*does not match its checksum"):
        mlflow.jaxexp.save_model(jax.jit(_fn), target, params=params, input_example=np.ones(2))
    assert not target.exists()
    assert not [p for p in tmp_path.iterdir() if ".jaxexp-tmp-" in p.name]
    monkeypatch.setattr(orbax_io, "save", real_save)  # the same save, undamaged, succeeds
    mlflow.jaxexp.save_model(jax.jit(_fn), target, params=params, input_example=np.ones(2))
    model = mlflow.jaxexp.load_model(str(target))
    np.testing.assert_array_equal(np.asarray(model.params["w"]), params["w"])


def test_sharded_leaves_are_checksummed_from_their_files(tmp_path):
    """A leaf spread over several devices is not one host buffer: its files are read for the
    manifest, and the manifests from memory and from files agree (4 CPU devices)."""
    code = textwrap.dedent(
        f"""
        import json, jax, numpy as np
        from pathlib import Path
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as PS
        from jaxexp_mlflow import params as P
        from jaxexp_mlflow.params.memory_crc import MemoryChecksums
        assert jax.device_count() == 4
        mesh = Mesh(np.array(jax.devices()), ("x",))
        w = np.arange(64 * 6, dtype=np.float32).reshape(64, 6)
        tree = {{"sharded": jax.device_put(w, NamedSharding(mesh, PS("x", None))),
                 "one": jax.device_put(w[:8], jax.devices()[2])}}
        root = {str(tmp_path)!r}
        P.save_params(tree, root + "/memory", checksums="memory")
        P.save_params(tree, root + "/files", checksums="files")
        mem = json.load(open(root + "/memory/jaxexp_manifest.json"))["files"]
        disk = json.load(open(root + "/files/jaxexp_manifest.json"))["files"]
        data = [r for r in mem if r.startswith(("sharded/", "one/")) and "zarray" not in r]
        assert data and all(mem[r] == disk[r] for r in data), (mem, disk)
        listed = {{r: v["size"] for r, v in mem.items()}}
        known = MemoryChecksums(tree).start().files(Path(root + "/memory"), listed)
        assert set(known) == {{"one/0.0"}}, known
        out = P.restore_params(root + "/memory", target=P.checkpoint_tree(root + "/memory"))
        np.testing.assert_array_equal(np.asarray(out["sharded"]), w)
        print("OK")
        """
    )
    r = device_child(code, 4, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "OK" in r.stdout
