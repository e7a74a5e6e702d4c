"""Every size a model states is checked before anything proportional to it is made
(zarr chunk grids, the params manifest), and every string from a model reaches stderr escaped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import yaml

import jaxexp_mlflow  # noqa: F401  (mlflow.jaxexp)
from jaxexp_mlflow.errors import ArtifactError
from jaxexp_mlflow.params import manifest as M
from tests.conftest import result_of

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def model(mlp_copy) -> Path:
    """The tests' MLP, a copy of its own for each test to alter (``conftest.mlp_copy``)."""
    return mlp_copy


def _huge_grid(model: Path) -> None:
    """``w1``'s zarr metadata claims 4e9 rows in chunks of one row; the manifest is rewritten
    to match (a consistent forgery)."""
    meta_file = next(
        p for p in (model / "params" / "w1").iterdir() if p.name in (".zarray", "zarr.json")
    )
    meta = json.loads(meta_file.read_text())
    meta["shape"][0] = 4_000_000_000
    if meta["zarr_format"] == 2:
        meta["chunks"][0] = 1
    else:
        meta["chunk_grid"]["configuration"]["chunk_shape"][0] = 1
        for codec in meta.get("codecs", []):
            if codec.get("name") == "sharding_indexed":
                codec["configuration"]["chunk_shape"][0] = 1
    meta_file.write_text(json.dumps(meta))
    M.write_manifest(model / "params")


_CHILD = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
import jaxexp_mlflow, mlflow
said = {}
for path in sys.argv[1:]:
    try:
        mlflow.jaxexp.load_model(path)
        said[path] = "LOADED"
    except BaseException as err:
        said[path] = " ".join(["RAISED", type(err).__name__, str(err)[:300]])
print("RESULT " + json.dumps(said))
"""


@pytest.fixture(scope="module")
def capped_loads(saved_mlp, tmp_path_factory) -> dict[str, str]:
    """What loading each forged model said in ONE child capped at 4 GiB of address space
    (``RAISED <type> <message>`` or ``LOADED``), by forgery name; the copies are its own."""
    import shutil

    root = tmp_path_factory.mktemp("capped")
    forged = {}
    for name, forge in (("huge_grid", _huge_grid), ("long_names", _long_names)):
        forged[name] = Path(shutil.copytree(saved_mlp, root / name, symlinks=True))
        forge(forged[name])
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, *map(str, forged.values())],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    said = result_of(proc)
    return {name: said[str(path)] for name, path in forged.items()}


def test_a_zarr_chunk_grid_is_bounded_before_chunk_names_are_made(capped_loads):
    said = capped_loads["huge_grid"]  # _huge_grid's forgery
    assert "RAISED ArtifactError" in said, said
    assert "4000000000 chunk files" in said


def _long_names(model: Path, rank: int = 250_000, files: int = 6_000) -> None:
    """``w1``'s ``.zarray`` (under 1 MiB) claims ``files`` chunk files of ``rank`` dimensions,
    each name ``"<i>" + ".0" * (rank - 1)`` half a MB long; ``files`` one-byte files beside it,
    listed in a rewritten manifest (a consistent forgery): 2.7 GiB of names if they were made."""
    directory = model / "params" / "w1"
    (directory / "zarr.json").unlink(missing_ok=True)
    meta = {
        "zarr_format": 2,
        "shape": [files] + [1] * (rank - 1),
        "chunks": [1] * rank,
        "dtype": "|u1",
        "compressor": None,
        "filters": None,
        "order": "C",
        "fill_value": None,
    }
    text = json.dumps(meta, separators=(",", ":"))
    assert len(text) < 1 << 20
    (directory / ".zarray").write_text(text)
    for i in range(files):
        (directory / f"pad{i}").write_bytes(b"\0")
    M.write_manifest(model / "params")


def test_zarr_chunk_names_are_bounded_by_rank_before_they_are_made(capped_loads):
    """Chunk names grow with the rank: the rank is bounded before a name is made, so the load
    is an ``ArtifactError`` under a 4 GiB address-space cap (it was a MemoryError)."""
    said = capped_loads["long_names"]  # _long_names's forgery
    assert "RAISED ArtifactError" in said, said
    assert "250000 dimensions" in said and "at most 32" in said, said


def test_zarr_chunk_name_bytes_are_counted_before_they_are_made():
    """Rank 32 and a million chunk files: 64 MiB of names, refused by arithmetic."""
    from jaxexp_mlflow.codec import zarr

    meta = {"zarr_format": 2, "shape": [10**6] + [1] * 31, "chunks": [1] * 32, "dtype": "|u1"}
    meta.update(compressor=None, filters=None, order="C")
    with pytest.raises(ArtifactError, match="chunk names of at most"):
        zarr.array_meta(meta, 10**6)
    assert zarr._key_bytes(1001, "c/", "/0") == 1001 * 4 + 10 + 90 * 2 + 900 * 3 + 4
    small = zarr.array_meta({**meta, "shape": [3] + [1] * 31}, 3)
    assert small.keys[2] == "2" + ".0" * 31
    with pytest.raises(zarr.NotPlain):  # another shape than the export's: before names
        zarr.array_meta({**meta, "shape": [3] + [1] * 31}, 3, expect=(3, 1))


def test_manifest_padding_is_refused_before_parsing(model):
    path = model / "params" / M.MANIFEST_FILE
    doc = path.read_text()
    pad = ",".join(["[]"] * (1 << 20))  # 3 MiB of padding, ~100 MiB once parsed
    path.write_text(doc.rstrip()[:-1] + f', "pad": [{pad}]}}')
    with pytest.raises(ArtifactError, match="reading budget"):
        mlflow.jaxexp.load_model(str(model))


def test_manifest_over_64_mib_is_refused(model):
    path = model / "params" / M.MANIFEST_FILE
    with open(path, "a") as f:
        f.write(" " * (64 << 20))
    with pytest.raises(ArtifactError, match="manifest"):
        mlflow.jaxexp.load_model(str(model))
    assert M.MAX_BYTES == 64 << 20  # what docs/security.md states


EVIL = "\x1b[2K\rVerdict ok\x1b[8m"


@pytest.mark.parametrize("command", ["check", "verify"])
def test_model_strings_reach_stderr_escaped(model, command):
    """The real command line (the verdict's reasons go to stderr through logging): no control
    character of MLmodel's reaches either stream raw."""
    doc = yaml.safe_load((model / "MLmodel").read_text())
    doc["flavors"]["jaxexp"]["jaxlib_version"] = f"0.4.1{EVIL}"
    doc["flavors"]["jaxexp"]["jax_version"] = f"0.4.1{EVIL}"
    (model / "MLmodel").write_text(yaml.safe_dump(doc))
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-c", "from jaxexp_mlflow.cli import main; main()", command, str(model)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    for stream in (proc.stdout, proc.stderr):
        assert "\x1b" not in stream and "\r" not in stream, repr(stream)
    assert "Verdict ok" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_zarr_metadata_is_read_up_to_1_mib(model):
    """64 MiB of ``[]`` in one array's metadata would be ~2 GiB once parsed."""
    meta_file = next(
        p for p in (model / "params" / "w1").iterdir() if p.name in (".zarray", "zarr.json")
    )
    meta = json.loads(meta_file.read_text())
    meta["pad"] = [[]] * 600_000
    meta_file.write_text(json.dumps(meta))
    M.write_manifest(model / "params")
    with pytest.raises(ArtifactError, match="array metadata"):
        mlflow.jaxexp.load_model(str(model))
