"""Params codec: Orbax checkpoints written, read, compared and copied (real Orbax, real files)."""

from __future__ import annotations

import json
import os
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxexp_mlflow import params as P
from jaxexp_mlflow.codec import zarr
from jaxexp_mlflow.errors import ArtifactError, ParamsMismatchError
from jaxexp_mlflow.params import layout
from jaxexp_mlflow.params import restore as R
from jaxexp_mlflow.params.manifest import write_manifest
from tests.conftest import device_child


def sds_tree(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), tree)


def assert_tree_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert isinstance(g, jax.Array)
        assert g.dtype == np.asarray(w).dtype and g.shape == np.shape(w)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def mixed_tree():
    rng = np.random.default_rng(0)
    return {
        "dense": {
            "w": jnp.asarray(rng.standard_normal((7, 5)), jnp.bfloat16),
            "b": jnp.zeros((5,), jnp.float32),  # all zeros: still a chunk file (zarr2, no fill)
        },
        "ints": [
            np.arange(-4, 4, dtype=np.int8),
            np.array([0, 1, 2**32 - 1], np.uint32),
            (np.array([True, False, True]), None),
        ],
        "half": np.linspace(-1, 1, 6, dtype=np.float16).reshape(2, 3),
        "scalar": np.float32(3.5),
        "nothing": None,
        "empty": {},
        "i32": jnp.arange(12, dtype=jnp.int32).reshape(3, 4),
    }


def test_round_trip_many_dtypes_uses_fast_path(tmp_path):
    tree = mixed_tree()
    desc = P.save_params(tree, tmp_path / "ck")
    assert desc["format"] == "orbax-pytree"
    assert desc["compression"] == "none" and desc["use_zarr3"] is False
    assert desc["use_ocdbt"] is False
    assert desc["num_arrays"] == 8
    json.dumps(desc)  # goes into MLmodel
    target = sds_tree(tree)
    out = P.restore_params(tmp_path / "ck", target=target)
    want = dict(tree, scalar=np.asarray(tree["scalar"]))
    assert_tree_equal(out, want)
    assert out["dense"]["w"].dtype == ml_dtypes.bfloat16
    assert isinstance(out["ints"][2], tuple)  # target structure, not Orbax's lists
    assert R.LAST_RESTORE_STATS == {"fast": 8, "orbax": 0}


def test_plain_metadata_reader_agrees_with_orbax(tmp_path):
    """restore_params reads _METADATA and .zarray itself instead of Orbax's metadata call:
    differential check against Orbax on the mixed tree, and the fallback for OCDBT."""
    tree = mixed_tree()
    P.save_params(tree, tmp_path / "ck")
    path = tmp_path / "ck"
    manifest = P.verify_manifest(path)
    mine = layout.plain_tree(path, layout.read_metadata(path), manifest.files)
    assert mine is not None
    orbax = {
        tuple(layout.key_token(k) for k in kp): leaf
        for kp, leaf in jax.tree_util.tree_flatten_with_path(P.checkpoint_tree(path))[0]
    }
    assert set(mine) == set(orbax) and len(mine) == 8
    for tokens, leaf in mine.items():
        assert (leaf.shape, leaf.dtype) == (orbax[tokens].shape, orbax[tokens].dtype), tokens
    meta = layout.read_metadata(path)
    assert layout.plain_tree(path, dict(meta, use_ocdbt=True), manifest.files) is None
    entry = next(iter(meta["tree_metadata"]))
    odd = json.loads(json.dumps(meta))
    odd["tree_metadata"][entry]["value_metadata"]["value_type"] = "custom.Leaf"
    assert layout.plain_tree(path, odd, manifest.files) is None  # Orbax judges the unknown


def test_orbax_itself_restores_the_checkpoint(tmp_path):
    tree = {"a": np.arange(10, dtype=np.float32), "b": [jnp.ones((2, 2), jnp.bfloat16)]}
    P.save_params(tree, tmp_path / "ck")
    for checkpointer in (ocp.PyTreeCheckpointer(), ocp.StandardCheckpointer()):
        restored = checkpointer.restore((tmp_path / "ck").absolute())
        np.testing.assert_array_equal(np.asarray(restored["a"]), tree["a"])
        np.testing.assert_array_equal(np.asarray(restored["b"][0]), np.ones((2, 2)))
        assert np.asarray(restored["b"][0]).dtype == jnp.bfloat16


ZARR_DTYPES = [
    "float32",
    "bfloat16",
    "float16",
    "float64",
    "int8",
    "uint8",
    "int32",
    "uint32",
    "int64",
    "bool",
    "complex64",
    "float8_e4m3fn",
]


@pytest.mark.parametrize("use_zarr3", [False, True], ids=["zarr2", "zarr3"])
def test_zarr_reader_agrees_with_orbax(tmp_path, use_zarr3):
    """codec.zarr (the JAX-free reader) against Orbax's own restore, dtype by dtype, on files
    Orbax wrote: zarr2 (what save_params writes) and zarr3 (models of earlier versions), whole
    and chunked along axis 0 (last chunk partial)."""
    rng = np.random.default_rng(3)
    tree = {}
    for name in ZARR_DTYPES:
        dtype = np.dtype(getattr(ml_dtypes, name, None) or name)
        tree[name] = (rng.standard_normal((9, 5)) * 8).astype(dtype)
    tree["scalar"] = np.asarray(np.float32(2.5))
    tree["rows"] = rng.standard_normal((1000, 16)).astype(np.float32)
    save_args = jax.tree.map(lambda _: ocp.SaveArgs(), tree)
    save_args["rows"] = ocp.SaveArgs(chunk_byte_size=64 * 97 * 4)
    handler = ocp.PyTreeCheckpointHandler(
        use_ocdbt=False, use_zarr3=use_zarr3, use_compression=False
    )
    with ocp.Checkpointer(handler) as ck:
        ck.save(tmp_path / "ck", args=ocp.args.PyTreeSave(tree, save_args=save_args))
    write_manifest(tmp_path / "ck")
    orbax = ocp.PyTreeCheckpointer().restore((tmp_path / "ck").absolute())
    manifest = P.verify_manifest(tmp_path / "ck")
    chunked = len(zarr.array_meta(zarr.read_meta(tmp_path / "ck", "rows", manifest.files)).keys)
    assert chunked > 1
    for name, want in tree.items():
        got = zarr.read_array(tmp_path / "ck", name, want.shape, want.dtype, manifest)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert got.tobytes() == np.asarray(orbax[name]).tobytes() == want.tobytes(), name
    assert manifest.verified >= {r for r in manifest.files if zarr.is_chunk_file(r)}


def test_zstd_round_trip_goes_through_orbax(tmp_path):
    tree = {"w": np.zeros((256, 64), np.float32) + 1.0, "v": np.arange(5, dtype=np.int8)}
    desc = P.save_params(tree, tmp_path / "ck", compression="zstd")
    assert desc["compression"] == "zstd"
    out = P.restore_params(tmp_path / "ck", target=sds_tree(tree))
    assert_tree_equal(out, tree)
    assert R.LAST_RESTORE_STATS["orbax"] == 2
    with pytest.raises(ValueError, match="compression='lz77'"):
        P.save_params(tree, tmp_path / "ck2", compression="lz77")


def test_flax_containers_round_trip(tmp_path):
    pytest.importorskip("flax")
    from flax import nnx
    from flax.core import FrozenDict

    fd = FrozenDict({"p": {"w": jnp.arange(6.0).reshape(2, 3)}})
    P.save_params(fd, tmp_path / "fd")
    out = P.restore_params(tmp_path / "fd", target=sds_tree(fd))
    assert isinstance(out, FrozenDict)
    np.testing.assert_array_equal(np.asarray(out["p"]["w"]), np.arange(6.0).reshape(2, 3))

    state = nnx.state(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), nnx.Param)
    P.save_params(state, tmp_path / "nnx")
    out = P.restore_params(tmp_path / "nnx", target=sds_tree(state))
    assert type(out) is type(state)
    np.testing.assert_array_equal(np.asarray(out["kernel"][...]), np.asarray(state["kernel"][...]))
    assert R.LAST_RESTORE_STATS["fast"] == 2


@pytest.mark.parametrize("use_zarr3", [False, True], ids=["zarr2", "zarr3"])
def test_multi_chunk_layouts(tmp_path, use_zarr3):
    """Orbax-written arrays split into chunks: along axis 0 (fast path) and along axis 1."""
    rng = np.random.default_rng(1)
    tree = {
        "rows": rng.standard_normal((1000, 16)).astype(np.float32),
        "cols": rng.random((8, 999)),
    }
    tree["cols"] = tree["cols"].astype(np.float32)
    save_args = {
        "rows": ocp.SaveArgs(chunk_byte_size=64 * 97 * 4),  # uneven: last chunk is partial
        "cols": ocp.SaveArgs(chunk_byte_size=8 * 100 * 4),
    }
    ck = ocp.Checkpointer(
        ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=use_zarr3, use_compression=False)
    )
    ck.save(tmp_path / "ck", args=ocp.args.PyTreeSave(tree, save_args=save_args))
    listed = [p.relative_to(tmp_path / "ck").as_posix() for p in (tmp_path / "ck").rglob("*")]
    meta = zarr.read_meta(tmp_path / "ck", "rows", listed)
    assert zarr.array_meta(meta).outer0 < 1000  # really chunked
    write_manifest(tmp_path / "ck")  # restore requires the checksummed list of files
    out = P.restore_params(tmp_path / "ck", target=sds_tree(tree))
    assert_tree_equal(out, tree)
    assert R.LAST_RESTORE_STATS["fast"] >= 1


def test_mapped_restore_checks_and_falls_back(tmp_path, monkeypatch):
    """mapped=True (load_model's private download): one-file arrays come back as read-only
    mappings of their chunk file, still checked against the manifest; chunked arrays and
    arrays Orbax restores are copied as before."""
    rng = np.random.default_rng(2)
    tree = {  # 2 MiB: mapped; 20 bytes: below zarr.MAP_MIN_BYTES, copied
        "w": rng.standard_normal((1024, 512)).astype(np.float32),
        "b": np.arange(5, dtype=np.int32),
    }
    P.save_params(tree, tmp_path / "ck")
    out = P.restore_params(tmp_path / "ck", target=sds_tree(tree), mapped=True)
    assert_tree_equal(out, tree)
    assert R.LAST_RESTORE_STATS == {"fast": 2, "orbax": 0}
    # the jax array aliases a read-only private mapping of the file: no copy was made
    assert [perms[:2] for perms in maps_of(tmp_path / "ck" / "w")] == ["r-"]
    assert out["w"].unsafe_buffer_pointer() in maps_of(tmp_path / "ck" / "w", starts=True)
    assert maps_of(tmp_path / "ck" / "b") == []
    # checksums the caller computed as it wrote the files stand in for a second read: a wrong
    # one is refused like a wrong file
    want = int(
        json.loads((tmp_path / "ck" / "jaxexp_manifest.json").read_text())["files"]["w/0.0"][
            "crc32c"
        ],
        16,
    )
    P.restore_params(tmp_path / "ck", target=sds_tree(tree), mapped={"w/0.0": want})
    with pytest.raises(ArtifactError, match="does not match its checksum"):
        P.restore_params(tmp_path / "ck", target=sds_tree(tree), mapped={"w/0.0": want ^ 1})

    (chunk,) = (tmp_path / "ck" / "w").glob("0.*")
    data = bytearray(chunk.read_bytes())
    data[100:116] = bytes(16)
    chunk.write_bytes(bytes(data))  # same size, altered weights
    with pytest.raises(ArtifactError, match="does not match its checksum"):
        P.restore_params(tmp_path / "ck", target=sds_tree(tree), mapped=True)

    rows = rng.standard_normal((1000, 16)).astype(np.float32)
    monkeypatch.setattr(zarr, "MAP_MIN_BYTES", 0)
    ck = ocp.Checkpointer(
        ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=True, use_compression=False)
    )
    save_args = {"rows": ocp.SaveArgs(chunk_byte_size=64 * 97 * 4)}  # partial last chunk
    ck.save(tmp_path / "chunked", args=ocp.args.PyTreeSave({"rows": rows}, save_args=save_args))
    write_manifest(tmp_path / "chunked")
    out = P.restore_params(tmp_path / "chunked", target=sds_tree({"rows": rows}), mapped=True)
    assert_tree_equal(out, {"rows": rows})
    assert maps_of(tmp_path / "chunked") == []  # several chunk files: reassembled in memory


def maps_of(directory, starts=False):
    """This process's mappings of files under ``directory``: their permissions, or with
    ``starts`` their start addresses."""
    found = []
    with open(f"/proc/{os.getpid()}/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5].startswith(f"{directory}/"):
                found.append(int(fields[0].split("-")[0], 16) if starts else fields[1])
    return found


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("saved") / "ck"
    tree = {"params": {"w": np.ones((784, 10), np.float32), "b": np.zeros((10,), np.float32)}}
    P.save_params(tree, d)
    return d, tree


def test_shape_mismatch_message(saved):
    d, tree = saved
    target = sds_tree(tree)
    target["params"]["w"] = jax.ShapeDtypeStruct((784, 12), jnp.float32)
    with pytest.raises(ParamsMismatchError) as e:
        P.restore_params(d, target=target)
    msg = str(e.value)
    assert "params['params']['w']: expected float32[784,12], found float32[784,10]" in msg
    assert "1 difference" in msg and "Log the model again" in msg


def test_dtype_mismatch_message(saved):
    d, tree = saved
    target = sds_tree(tree)
    target["params"]["b"] = jax.ShapeDtypeStruct((10,), jnp.bfloat16)
    with pytest.raises(
        ParamsMismatchError,
        match=r"\['b'\]: expected bfloat16\[10\], found "
        r"float32\[10\]",
    ):
        P.restore_params(d, target=target)


def test_structure_mismatch_message(saved):
    d, tree = saved
    target = {
        "params": {"w": sds_tree(tree)["params"]["w"], "c": jax.ShapeDtypeStruct((3,), jnp.float32)}
    }
    with pytest.raises(ParamsMismatchError) as e:
        P.restore_params(d, target=target)
    msg = str(e.value)
    assert "params['params']['c']: expected float32[3], found no such array" in msg
    assert "params['params']['b']: expected nothing there, found float32[10]" in msg


def test_checkpoint_tree_is_metadata_only(saved):
    d, _ = saved
    tree = P.checkpoint_tree(d)
    assert tree["params"]["w"] == jax.ShapeDtypeStruct((784, 10), jnp.float32)
    assert tree["params"]["b"] == jax.ShapeDtypeStruct((10,), jnp.float32)


def test_missing_and_corrupt_checkpoints(tmp_path, saved):
    target = sds_tree(saved[1])
    with pytest.raises(ArtifactError, match="not found"):
        P.restore_params(tmp_path / "nope", target=target)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x.txt").write_text("hi")
    with pytest.raises(ArtifactError, match="Not an Orbax PyTree checkpoint"):
        P.restore_params(tmp_path / "junk", target=target)

    tree = {"w": np.arange(4096, dtype=np.float32)}
    P.save_params(tree, tmp_path / "bad_meta")
    (tmp_path / "bad_meta" / "_METADATA").write_text("{not json")
    with pytest.raises(ArtifactError):
        P.restore_params(tmp_path / "bad_meta", target=sds_tree(tree))

    P.save_params(tree, tmp_path / "trunc")
    (chunk,) = [
        p for p in (tmp_path / "trunc" / "w").rglob("*") if p.is_file() and p.name != ".zarray"
    ]
    os.truncate(chunk, 100)
    with pytest.raises(ArtifactError, match=r"(?s)incomplete .*w/0: expected \d+ bytes, found 100"):
        P.restore_params(tmp_path / "trunc", target=sds_tree(tree))
    # without the manifest nothing is read
    (tmp_path / "trunc" / P.MANIFEST_FILE).unlink()
    with pytest.raises(ArtifactError, match="Truncated|damaged"):
        P.restore_params(tmp_path / "trunc", target=sds_tree(tree))


def test_a_lost_chunk_file_is_an_error_not_zeros(tmp_path):
    # zarr reads a missing chunk as its fill value (zeros): the manifest turns that into an error
    tree = {"w": np.arange(1.0, 13.0, dtype=np.float32).reshape(3, 4)}
    P.save_params(tree, tmp_path / "ck")
    (tmp_path / "ck" / "w" / "0.0").unlink()
    with pytest.raises(ArtifactError, match=r"(?s)incomplete \(1 of \d+ files\).*w/0\.0.*no file"):
        P.restore_params(tmp_path / "ck", target=sds_tree(tree))


def test_layout_survives_mlflow_http_listing(tmp_path):
    # MLflow's HTTP artifact repo takes a directory `0` holding only a file `0` for a file and
    # skips it: Orbax's zarr2 layout keeps chunks flat beside .zarray (`w/0.0.0`), so no
    # directory holds a file of its own name, and no file is rewritten to get there.
    tree = {"w": np.ones((2, 3, 4), np.float32), "v": np.ones(5, np.float32), "0": np.ones(3)}
    P.save_params(tree, tmp_path / "ck")
    for d in (tmp_path / "ck").rglob("*"):
        if d.is_dir():
            assert [f.name for f in d.iterdir()] != [d.name], d
            assert d.parent == tmp_path / "ck", d  # no directory inside an array's
    assert (tmp_path / "ck" / "w" / "0.0.0").is_file()


def test_copy_checkpoint_leaves_the_source_untouched(tmp_path):
    import orbax.checkpoint as ocp

    tree = {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}
    ckpt = ocp.StandardCheckpointer()
    ckpt.save((tmp_path / "src").absolute(), tree)
    ckpt.wait_until_finished()
    before = {
        str(f.relative_to(tmp_path / "src")): f.read_bytes()
        for f in (tmp_path / "src").rglob("*")
        if f.is_file()
    }
    P.copy_checkpoint(tmp_path / "src", tmp_path / "dst")
    after = {
        str(f.relative_to(tmp_path / "src")): f.read_bytes()
        for f in (tmp_path / "src").rglob("*")
        if f.is_file()
    }
    assert before == after
    out = P.restore_params(tmp_path / "dst", target=sds_tree(tree))
    np.testing.assert_array_equal(out["w"], tree["w"])


def test_save_errors(tmp_path):
    (tmp_path / "exists").mkdir()
    with pytest.raises(FileExistsError):
        P.save_params({"w": np.ones(2)}, tmp_path / "exists")
    with pytest.raises(ParamsMismatchError, match=r"params\['f'\]: expected an array"):
        P.save_params({"f": "text"}, tmp_path / "x")
    with pytest.raises(
        ParamsMismatchError,
        match=r"params\['e'\]: expected a non-empty array, "
        r"found float32\[0,3\]",
    ):
        P.save_params({"e": np.zeros((0, 3), np.float32)}, tmp_path / "y")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_copy_checkpoint_from_checkpoint_manager(tmp_path):
    tree = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(4, np.int8)}
    root = tmp_path / "mgr"
    with ocp.CheckpointManager(root, item_names=("params",)) as mgr:
        mgr.save(7, args=ocp.args.Composite(params=ocp.args.StandardSave(tree)))
        mgr.wait_until_finished()

    assert P.checkpoint_tree(root / "7")["w"] == jax.ShapeDtypeStruct((3, 4), jnp.float32)
    P.check_checkpoint(root / "7", sds_tree(tree))  # metadata only, no error
    with pytest.raises(ParamsMismatchError, match=r"params\['b'\]: expected int8\[5\]"):
        P.check_checkpoint(root / "7", dict(sds_tree(tree), b=jax.ShapeDtypeStruct((5,), "int8")))
    desc = P.copy_checkpoint(root / "7", tmp_path / "copy1")  # step dir: item found
    assert desc["num_arrays"] == 2 and desc["use_ocdbt"] is True
    out = P.restore_params(tmp_path / "copy1", target=sds_tree(tree))
    assert_tree_equal(out, tree)

    P.copy_checkpoint(root / "7" / "params", tmp_path / "copy2")  # item dir
    assert_tree_equal(P.restore_params(tmp_path / "copy2", target=sds_tree(tree)), tree)

    with pytest.raises(ArtifactError, match="pass a step"):
        P.copy_checkpoint(root, tmp_path / "copy3")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "a.npy").write_bytes(b"x")
    with pytest.raises(ArtifactError, match="Not an Orbax PyTree checkpoint"):
        P.copy_checkpoint(tmp_path / "plain", tmp_path / "copy4")


def test_copy_checkpoint_of_saved_params_links_files(tmp_path):
    tree = {"w": np.arange(1000, dtype=np.float32)}
    P.save_params(tree, tmp_path / "src")
    P.copy_checkpoint(tmp_path / "src", tmp_path / "dst")
    src_files = sorted(
        p.relative_to(tmp_path / "src") for p in (tmp_path / "src").rglob("*") if p.is_file()
    )
    manifest = (tmp_path / "src" / P.MANIFEST_FILE).read_bytes()
    for rel in src_files:
        linked = os.path.samefile(tmp_path / "src" / rel, tmp_path / "dst" / rel)
        assert linked is (rel.name != P.MANIFEST_FILE)  # the manifest is written anew, not
    assert (tmp_path / "src" / P.MANIFEST_FILE).read_bytes() == manifest  # through the link
    assert_tree_equal(P.restore_params(tmp_path / "dst", target=sds_tree(tree)), tree)


def test_restore_into_named_sharding_on_4_devices(tmp_path):
    code = textwrap.dedent(
        f"""
        import jax, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as PS
        from jaxexp_mlflow import params as P
        from jaxexp_mlflow.params import restore as R
        assert jax.device_count() == 4
        tree = {{"w": np.arange(32 * 6, dtype=np.float32).reshape(32, 6),
                 "b": np.arange(6, dtype=np.float32)}}
        P.save_params(tree, {str(tmp_path / "ck")!r})
        mesh = Mesh(np.array(jax.devices()), ("x",))
        target = {{"w": jax.ShapeDtypeStruct((32, 6), np.float32,
                                            sharding=NamedSharding(mesh, PS("x", None))),
                   "b": jax.ShapeDtypeStruct((6,), np.float32,
                                            sharding=NamedSharding(mesh, PS()))}}
        out = P.restore_params({str(tmp_path / "ck")!r}, target=target)
        assert out["w"].sharding == target["w"].sharding, out["w"].sharding
        assert len(out["w"].addressable_shards) == 4
        assert out["w"].addressable_shards[1].data.shape == (8, 6)
        np.testing.assert_array_equal(np.asarray(out["w"]), tree["w"])
        assert out["b"].sharding.is_fully_replicated
        np.testing.assert_array_equal(np.asarray(out["b"]), tree["b"])
        print("OK", R.LAST_RESTORE_STATS)
        """
    )
    r = device_child(code, 4, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "OK" in r.stdout and "'orbax': 2" in r.stdout


def test_numpy_leaves_are_written_without_a_copy_and_orbax_stays_quiet(tmp_path, caplog):
    import logging

    absl_logger = logging.getLogger("absl")
    filters = list(absl_logger.filters)
    leaves = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(4, np.int8)}
    with caplog.at_level(logging.INFO):
        P.save_params(leaves, tmp_path / "ck")
    assert "Skipping merge of OCDBT" not in caplog.text
    assert absl_logger.filters == filters  # silenced for this save only, not for Orbax users
    handler = P.checkpoint_handler(copy_host_arrays=False)
    registry = handler._handler_impl._type_handler_registry  # noqa: SLF001 - what Orbax uses
    if "deepcopy_host_arrays" in ocp.type_handlers.NumpyHandler.__init__.__code__.co_varnames:
        assert registry.get(np.ndarray)._deepcopy_host_arrays is False  # noqa: SLF001
    assert ocp.type_handlers.get_type_handler(np.ndarray) is not registry.get(np.ndarray)
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), leaves)
    back = P.restore_params(tmp_path / "ck", target=target)
    for k in leaves:
        np.testing.assert_array_equal(back[k], leaves[k])


def test_crc32c_through_google_crc32c_public_api(tmp_path):
    """codec.crc32c: google_crc32c's public ``extend`` on a view of any buffer (bytes,
    bytearray, memoryview slices, a mapping), continued across blocks; no ctypes."""
    import mmap

    import google_crc32c

    from jaxexp_mlflow.codec import crc32c as C

    data = np.random.default_rng(4).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    want = google_crc32c.value(data)
    assert C.crc32c(data) == want
    assert C.crc32c(bytearray(data)) == want
    view = memoryview(bytearray(data))
    assert C.crc32c(view[1000:], C.crc32c(view[:1000])) == want
    assert C.crc32c(np.frombuffer(data, np.uint32).reshape(-1, 4)) == want  # any shape
    assert C.crc32c(b"") == 0 and C.crc32c(b"", 7) == 7
    (tmp_path / "f").write_bytes(data)
    assert C.path_crc32c(tmp_path / "f") == want
    with open(tmp_path / "f", "rb") as f:
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            assert C.crc32c(memoryview(m)) == want
    assert "ctypes" not in open(C.__file__).read()
