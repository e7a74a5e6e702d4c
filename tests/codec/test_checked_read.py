"""CRC-32C combine and the one-pass, multi-threaded checked read of params files
(``codec.crc32c.crc32c_combine``, ``codec.checked_read``), against ``google_crc32c`` over the
whole bytes (real files, real threads)."""

from __future__ import annotations

import os
import signal

import google_crc32c
import jax
import numpy as np
import pytest

from jaxexp_mlflow import params as P
from jaxexp_mlflow.codec.checked_read import read_checked
from jaxexp_mlflow.codec.crc32c import crc32c_combine
from jaxexp_mlflow.errors import ArtifactError
from jaxexp_mlflow.params.manifest import MANIFEST_FILE

SIZES = [0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 4095, 4096, 4097, 65537]


@pytest.mark.parametrize("n", SIZES)
def test_combine_equals_the_crc_of_the_whole(n):
    rng = np.random.default_rng(n)
    data = rng.integers(0, 256, n, np.uint8).tobytes()
    for cut in sorted({0, 1 % (n + 1), n // 3, n // 2, n - 1 if n else 0, n}):
        a, b = data[:cut], data[cut:]
        got = crc32c_combine(google_crc32c.value(a), google_crc32c.value(b), len(b))
        assert got == google_crc32c.value(data), (n, cut)


def test_combine_of_many_parts_and_long_runs():
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, 3 << 20, np.uint8).tobytes()
    cuts = [0, 5, 4096, 1 << 20, (1 << 20) + 3, 3 << 20]
    value = 0
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        value = crc32c_combine(value, google_crc32c.value(data[lo:hi]), hi - lo)
    assert value == google_crc32c.value(data)
    # zeros: a long run's CRC through the combine equals google_crc32c's, even where the
    # powers x^(2^k) wrap around (period 31 for this polynomial)
    zeros = bytes(3 << 20)
    assert crc32c_combine(google_crc32c.value(b"abc"), google_crc32c.value(zeros), len(zeros)) == (
        google_crc32c.value(b"abc" + zeros)
    )
    assert crc32c_combine(123, 456, 0) == 123 ^ 456
    with pytest.raises(ValueError):
        crc32c_combine(0, 0, -1)


def _file(tmp_path, data: bytes):
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    return os.open(path, os.O_RDONLY)


LAYOUTS = [
    [],  # no region: only checksummed
    [(0, None)],  # the whole file
    [(0, 1000), (1000, 5000)],  # adjacent
    [(17, 100), (4096, 70000), (80000, None)],  # gaps before, between; the tail
    [(5, 99995)],  # a gap at both ends
]


@pytest.mark.parametrize("workers", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", range(len(LAYOUTS)))
def test_read_checked_reads_the_regions_and_checksums_every_byte(tmp_path, layout, workers):
    rng = np.random.default_rng(layout)
    data = rng.integers(0, 256, 100_000, np.uint8).tobytes()
    fd = _file(tmp_path, data)
    try:
        regions, outs = [], []
        for offset, n in LAYOUTS[layout]:
            n = len(data) - offset if n is None else n
            out = np.zeros(n, np.uint8)
            outs.append((offset, out))
            regions.append((offset, memoryview(out)))
        # parts of 4 KiB (blocks of 1 KiB): every layout is split between the threads
        got = read_checked(fd, len(data), regions, workers=workers, min_part=4096, block=1024)
    finally:
        os.close(fd)
    assert got == google_crc32c.value(data)
    for offset, out in outs:
        assert out.tobytes() == data[offset : offset + out.size]


@pytest.mark.parametrize("workers", [1, 2])
def test_read_checked_refuses_a_file_shorter_than_stated(tmp_path, workers):
    data = bytes(range(256)) * 100
    fd = _file(tmp_path, data)
    try:
        out = np.zeros(len(data) + 10, np.uint8)
        with pytest.raises(ArtifactError, match="ended early"):
            read_checked(fd, len(data) + 10, [(0, memoryview(out))], workers=workers, min_part=4096)
    finally:
        os.close(fd)


def test_a_flipped_byte_between_regions_or_inside_is_caught_on_load(tmp_path):
    """The restore reads big arrays on several threads: a byte changed anywhere in a chunk
    file (first part, last part) is still refused, and an intact checkpoint loads exact."""
    rng = np.random.default_rng(3)
    tree = {"w": rng.standard_normal((3000, 1024)).astype(np.float32)}  # 12 MiB: 2+ parts
    P.save_params(tree, tmp_path / "ok")
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)
    back = P.restore_params(tmp_path / "ok", target=target)
    assert np.array_equal(np.asarray(back["w"]), tree["w"])
    for where in (10, tree["w"].nbytes - 10):
        P.save_params(tree, tmp_path / f"bad{where}")
        chunk = tmp_path / f"bad{where}" / "w" / "0.0"
        assert (tmp_path / f"bad{where}" / MANIFEST_FILE).exists() and chunk.exists()
        with open(chunk, "r+b") as f:
            f.seek(where)
            byte = f.read(1)
            f.seek(where)
            f.write(bytes([byte[0] ^ 0x40]))
        with pytest.raises(ArtifactError, match="does not match its checksum"):
            P.restore_params(tmp_path / f"bad{where}", target=target)


def test_run_spread_runs_every_task_and_raises_the_first_failure_in_order():
    """``run_spread``: results in the tasks' order whatever thread ran them; when tasks fail,
    the others still run to the end (their buffers are in use) and the first failure in the
    tasks' order is raised."""
    import threading

    from jaxexp_mlflow.codec.checked_read import run_spread

    ran, names = [], set()

    def task(i: int):
        def run():
            ran.append(i)
            names.add(threading.current_thread().name)
            if i in (3, 5):
                raise ValueError(f"task {i}")
            return i * i

        return run

    assert run_spread([task(i) for i in (0, 1, 2, 4)], 2) == [0, 1, 4, 16]
    ran.clear()
    with pytest.raises(ValueError, match="task 3"):
        run_spread([task(i) for i in range(8)], 2)
    assert sorted(ran) == list(range(8))
    assert run_spread([], 2) == [] and run_spread([task(7)], 2) == [49]


def test_many_arrays_read_at_once_are_exact_and_a_damaged_one_is_refused(tmp_path):
    """``restore_params`` reads many arrays at once, one file to a thread, and a big one alone
    on every thread (``codec.zarr.read_all``): exact bytes either way, and a flipped byte in any
    one of them is refused after every read has finished."""
    rng = np.random.default_rng(11)
    tree = {
        f"a{i:02d}": rng.standard_normal((64 * (i + 1), 256)).astype(np.float32) for i in range(12)
    }
    tree["big"] = rng.standard_normal((4096, 1024)).astype(np.float32)  # 16 MiB: read alone
    P.save_params(tree, tmp_path / "ok")
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)
    back = P.restore_params(tmp_path / "ok", target=target)
    assert P.restore.LAST_RESTORE_STATS == {"fast": 13, "orbax": 0}
    for name, want in tree.items():
        assert np.asarray(back[name]).tobytes() == want.tobytes(), name
    for name in ("a00", "a07", "big"):
        P.save_params(tree, tmp_path / name)
        with open(tmp_path / name / name / "0.0", "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0x01]))
        with pytest.raises(ArtifactError, match=f"{name}/0.0.* does not match its checksum"):
            P.restore_params(tmp_path / name, target=target)


def test_metadata_is_parsed_as_the_manifest_check_read_it(tmp_path):
    """The checkpoint's small files are kept as their checksum read them
    (``Manifest.held``), and the restore parses those bytes: a metadata file changed on disk
    after its check is not what gets parsed."""
    from jaxexp_mlflow.params import layout
    from jaxexp_mlflow.params.manifest import HOLD_BYTES

    P.save_params({"w": np.arange(12, dtype=np.float32)}, tmp_path / "ck")
    manifest = P.verify_manifest(tmp_path / "ck")
    assert {"_METADATA", "w/.zarray"} <= set(manifest.held)
    assert all(len(b) <= HOLD_BYTES for b in manifest.held.values())
    zarray = tmp_path / "ck" / "w" / ".zarray"
    held = manifest.held["w/.zarray"]
    assert held == zarray.read_bytes()
    zarray.write_bytes(held.replace(b"12", b"13"))  # changed after the check
    meta = layout.read_metadata(tmp_path / "ck", manifest.held)
    plain = layout.plain_tree(tmp_path / "ck", meta, manifest.files, manifest.held)
    assert plain[("w",)].shape == (12,)
    assert layout.plain_tree(tmp_path / "ck", meta, manifest.files)[("w",)].shape == (13,)


def test_held_metadata_is_bounded_in_all(tmp_path, monkeypatch):
    """A checkpoint of many small files costs no more memory than ``HOLD_TOTAL_BYTES`` of held
    bytes: past it, files are checked as before and parsed from disk, and the restore is the
    same."""
    from jaxexp_mlflow.params import manifest as M

    tree = {f"a{i:02d}": np.arange(i + 1, dtype=np.float32) for i in range(30)}
    P.save_params(tree, tmp_path / "ck")
    full = P.verify_manifest(tmp_path / "ck")
    monkeypatch.setattr(M, "HOLD_TOTAL_BYTES", 2000)
    capped = P.verify_manifest(tmp_path / "ck")
    assert 0 < sum(map(len, capped.held.values())) <= 2000 < sum(map(len, full.held.values()))
    assert capped.verified == full.verified  # every file checked all the same
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)
    back = P.restore_params(tmp_path / "ck", target=target)
    assert all(np.array_equal(np.asarray(back[k]), v) for k, v in tree.items())


def test_a_file_replaced_after_the_walk_is_refused(tmp_path):
    """``verify_checkpoint`` walks the directory (every file regular and inside it); the
    checksums that follow open each file by name and must find the very file the walk saw."""
    from jaxexp_mlflow.params.manifest import verify_checkpoint

    P.save_params({"w": np.arange(12, dtype=np.float32)}, tmp_path / "ck")
    manifest = verify_checkpoint(tmp_path / "ck", checksum=False)
    assert "_METADATA" in manifest.found
    manifest.verify_files(["_METADATA"])  # the same file: checked
    meta = tmp_path / "ck" / "_METADATA"
    copy = tmp_path / "copy"
    copy.write_bytes(meta.read_bytes())  # same bytes, another file
    os.replace(copy, meta)
    manifest.verified.clear()
    with pytest.raises(ArtifactError, match="was replaced"):
        manifest.verify_files(["_METADATA"])
    assert verify_checkpoint(tmp_path / "ck").verified  # a fresh walk accepts the new file


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # the child runs no JAX
def test_a_forked_child_reads_on_threads_of_its_own(tmp_path):
    """A process forked after a load (a server's workers) gets a pool of its own: the
    parent's pool has no threads in the child, and work sent there would never run."""
    data = np.random.default_rng(5).integers(0, 256, 64 << 10, np.uint8).tobytes()
    fd = _file(tmp_path, data)
    try:
        want = google_crc32c.value(data)
        assert read_checked(fd, len(data), [], workers=2, min_part=4096) == want
        pid = os.fork()
        if pid == 0:  # the child: exit code 0 only if the threaded read completes right
            signal.alarm(60)  # a read that never completes kills the child, never the suite
            ok = read_checked(fd, len(data), [], workers=2, min_part=4096) == want
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        os.close(fd)
