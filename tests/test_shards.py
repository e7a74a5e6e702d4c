"""The chunk files ``codec.shards`` makes from memory against the files TensorStore writes.

``log_model`` through a server sends big arrays' chunk files straight from the arrays
(``codec.divert``); these tests save the same params twice, once written by Orbax/TensorStore
and once diverted, and require the same checkpoint byte for byte.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxexp_mlflow.codec import divert, params, shards
from jaxexp_mlflow.errors import ArtifactError

DTYPES = [
    np.float32,
    np.float64,
    np.float16,
    ml_dtypes.bfloat16,
    ml_dtypes.float8_e4m3fn,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint32,
    np.bool_,
    np.complex64,
]


def _tree(rng: np.random.Generator, as_jax: bool) -> dict:
    out = {}
    for i, dtype in enumerate(DTYPES):
        shape = [(7,), (3, 5), (2, 3, 4), (1,)][i % 4]
        x = rng.standard_normal(shape) * 50
        if np.dtype(dtype).kind == "c":
            x = x + 1j * rng.standard_normal(shape)
        value = (x > 0) if dtype is np.bool_ else x.astype(dtype)
        out[f"a{i}"] = jnp.asarray(value) if as_jax else np.asarray(value)
    out["zeros"] = jnp.zeros((4, 4)) if as_jax else np.zeros((4, 4), np.float32)
    out["scalar"] = np.float32(3.0)  # rank 0: written as usual
    return out


def _files(root) -> dict[str, bytes]:
    return {
        os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
        for d, _, names in os.walk(root)
        for f in names
    }


@pytest.fixture
def no_minimum(monkeypatch):
    monkeypatch.setattr(divert, "MIN_BYTES", 0)


@pytest.mark.parametrize("as_jax", [True, False], ids=["jax", "numpy"])
def test_diverted_chunk_files_are_the_files_tensorstore_writes(tmp_path, no_minimum, as_jax):
    tree = _tree(np.random.default_rng(0), as_jax)
    params.save_params(tree, tmp_path / "written")
    sent: dict[str, bytes] = {}

    def sink(rel: str, parts: tuple[memoryview, bytes]) -> int:
        data = b"".join(bytes(p) for p in parts)
        sent[rel] = data
        from jaxexp_mlflow.codec.manifest import crc32c

        return crc32c(data)

    with divert.sending(sink):
        params.save_params(tree, tmp_path / "diverted")
        params.verify_manifest(tmp_path / "diverted").verify_files()  # the read-back's check
    written, diverted = _files(tmp_path / "written"), _files(tmp_path / "diverted")
    # every array but the scalar went to the sink, and nothing of it was written
    assert len(sent) == len(DTYPES) + 1
    assert set(sent).isdisjoint(diverted)
    assert set(written) == set(diverted) | set(sent)
    for rel, data in sent.items():
        assert data == written[rel], rel
    stamped = ("_CHECKPOINT_METADATA", "commit_success.txt")  # a time, the path inside
    for rel, data in diverted.items():
        if rel not in (*stamped, params.MANIFEST_FILE):
            assert data == written[rel], rel
    manifests = [json.loads(d[params.MANIFEST_FILE])["files"] for d in (written, diverted)]
    assert [{k: v for k, v in m.items() if k not in stamped} for m in manifests][0] == {
        k: v for k, v in manifests[1].items() if k not in stamped
    }
    # outside the save's context the missing files are missing
    with pytest.raises(ArtifactError, match="no file"):
        params.verify_manifest(tmp_path / "diverted")
    # once the sent bytes are where the store puts them, it restores like the written one
    for rel, data in sent.items():
        (tmp_path / "diverted" / rel).write_bytes(data)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), tree)
    back = params.restore_params(tmp_path / "diverted", target=target)
    want = params.restore_params(tmp_path / "written", target=target)
    for key in tree:
        assert np.asarray(back[key]).tobytes() == np.asarray(want[key]).tobytes(), key


def test_only_the_layout_it_knows_is_diverted(tmp_path, no_minimum):
    tree = {
        "int4": np.arange(8, dtype=ml_dtypes.int4).reshape(2, 4),
        "big_endian": np.arange(6, dtype=">f4"),
        "strided": np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2],
        "plain": np.arange(6, dtype=np.float32),
    }
    taken = []
    with divert.sending(lambda rel, parts: taken.append(rel) or 0):
        params.save_params(tree, tmp_path / "p")
    assert taken == ["plain/c.0"]
    # zstd: Orbax's compressed layout is written as usual
    taken.clear()
    with divert.sending(lambda rel, parts: taken.append(rel) or 0):
        params.save_params({"plain": tree["plain"]}, tmp_path / "z", compression="zstd")
    assert taken == []
    assert shards.plan({"driver": "zarr3", "metadata": {"codecs": []}}, []) is None


def test_a_save_of_another_directory_is_never_diverted(tmp_path, no_minimum):
    """The jax-array hook is process-wide while a diverted save runs: other checkpoints (a
    training loop's own Orbax saves) pass through it untouched."""
    taken = []
    tree = {"w": jnp.arange(16.0)}
    with divert.diverted(tmp_path / "ours", lambda rel, parts: taken.append(rel) or 0):
        params.save_params(tree, tmp_path / "theirs")
    assert taken == []
    assert (tmp_path / "theirs" / "w" / "c.0").is_file()


def test_trailer_is_the_zarr3_shard_index():
    tail = shards.trailer(48)
    assert tail[:16] == (0).to_bytes(8, "little") + (48).to_bytes(8, "little")
    from jaxexp_mlflow.codec.manifest import crc32c

    assert int.from_bytes(tail[16:], "little") == crc32c(tail[:16])


_SHARDED = r"""
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxexp_mlflow.codec import divert, params
divert.MIN_BYTES = 0
root = sys.argv[1]
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
x = jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6)
tree = {
    "rows": jax.device_put(x, NamedSharding(mesh, P("a", None))),  # replicated over b
    "grid": jax.device_put(x, NamedSharding(mesh, P("a", "b"))),
    "full": jax.device_put(x, NamedSharding(mesh, P())),
}
params.save_params(tree, f"{root}/written")
sent = {}
def sink(rel, parts):
    from jaxexp_mlflow.codec.manifest import crc32c
    sent[rel] = b"".join(bytes(p) for p in parts)
    return crc32c(sent[rel])
with divert.sending(sink):
    params.save_params(tree, f"{root}/diverted")
same = {rel: open(f"{root}/written/{rel}", "rb").read() == data for rel, data in sent.items()}
chunks = sorted(
    os.path.relpath(os.path.join(d, f), f"{root}/written")
    for d, _, fs in os.walk(f"{root}/written") for f in fs if f.startswith("c.")
)
print("RESULT " + json.dumps({"same": same, "chunks": chunks}))
"""


def test_sharded_arrays_divert_one_file_per_shard(tmp_path):
    """On 4 devices: an array sharded over 4 devices has a chunk file per shard, each made from
    its shard's buffer byte for byte as TensorStore writes it; replicated arrays are cut as
    Orbax cuts them (its replica-parallel slices), each slice one file, byte for byte too."""
    from tests.conftest import run_on_devices

    out = run_on_devices(_SHARDED, 4, str(tmp_path))
    assert sorted(out["same"]) == out["chunks"]
    assert all(out["same"].values()), out["same"]
    assert len([c for c in out["chunks"] if c.startswith("grid/")]) == 4
    assert {c.split("/")[0] for c in out["chunks"]} == {"grid", "rows", "full"}
