"""Bounded work per request in ``jaxexp serve``, against a real server on 127.0.0.1.

* parquet is bounded before decoding: a body of constant columns (parquet's run-length and
  dictionary encodings) whose decoded size passes the limit is a 413 read off the footer, with
  the server's RSS watched while it answers;
* a body that stalls is dropped (408) after ``JAXEXP_BODY_TIMEOUT_S`` and leaves the in-flight
  budget, so other clients are served again;
* a CSV cell nested 5000 deep is a 400;
* a request past its deadline stops its work at the next checkpoint (in-process, the real
  ``invocations`` of the server: no timing asserted).
"""

from __future__ import annotations

import contextlib
import io
import json
import socket
import time

import mlflow
import numpy as np
import pandas as pd
import psutil
import pytest
import requests

import jaxexp_mlflow  # noqa: F401
from jaxexp_mlflow.serving import serving_guard
from tests.models import batch, export_mlp, mlp_params
from tests.servers import http_status, server_env, start_jaxexp_server, stop_server, tree_rss

MAX_BODY = 256 * 1024
RSS_BOUND_MB = 64
BODY_TIMEOUT_S = 2
PARQUET = "application/vnd.apache.parquet"
FEATURES = [f"f{i}" for i in range(8)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bounds")
    params = mlp_params()
    mlflow.jaxexp.save_model(
        export_mlp(params),
        tmp / "mlp",
        params=params,
        input_example=batch(2),
        serving_config={"buckets": [1, 8], "max_request_bytes": MAX_BODY},
    )
    return tmp / "mlp"


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bounds-server")
    env = {**server_env(tmp), serving_guard.ENV_BODY_TIMEOUT: str(BODY_TIMEOUT_S)}
    proc, url = start_jaxexp_server(str(model_dir), env, tmp / "server.log")
    tree = psutil.Process(proc.pid).children(recursive=True)
    local = mlflow.pyfunc.load_model(str(model_dir))
    try:
        yield url, proc, local
    finally:
        stop_server(proc)
        for child in tree:
            with contextlib.suppress(psutil.Error):
                child.kill()


def _constant_parquet(rows_per_group: int, groups: int) -> bytes:
    """Eight constant float64 feature columns, written a row group at a time (the test process
    never holds more than one group)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({c: np.zeros(rows_per_group) for c in FEATURES})
    buf = io.BytesIO()
    options = {"data_page_size": 1 << 26, "write_statistics": False}
    with pq.ParquetWriter(buf, table.schema, **options) as writer:
        for _ in range(groups):
            writer.write_table(table)
    return buf.getvalue()


def test_parquet_bounded_before_decoding(served):
    url, proc, local = served
    body = _constant_parquet(1_000_000, 10)  # 10M rows: 640 MB of float64 once decoded
    assert len(body) < MAX_BODY
    before = tree_rss(proc.pid)
    r = requests.post(
        f"{url}/invocations", data=body, headers={"Content-Type": PARQUET}, timeout=120
    )
    grown_mb = (tree_rss(proc.pid) - before) / 2**20
    assert r.status_code == 413, (r.status_code, r.text[:500])
    assert len(r.content) < 2048 and "x: float32[-1,8]" in r.json()["message"]
    assert "10000000 rows" in r.json()["message"]
    assert grown_mb < RSS_BOUND_MB, f"server RSS grew by {grown_mb:.0f} MB"
    # a parquet body within the bound is answered as in-process predict
    x = batch(5, seed=2)
    frame = pd.DataFrame(x.astype(np.float64), columns=FEATURES)
    good = io.BytesIO()
    frame.to_parquet(good)
    r = requests.post(
        f"{url}/invocations", data=good.getvalue(), headers={"Content-Type": PARQUET}, timeout=60
    )
    assert r.status_code == 200, r.text[:500]
    np.testing.assert_allclose(
        np.asarray(r.json()["predictions"], np.float32), local.predict(x), rtol=1e-6, atol=1e-6
    )
    text = io.BytesIO()
    pd.DataFrame({"name": ["a", "b"]}).to_parquet(text)
    r = requests.post(
        f"{url}/invocations", data=text.getvalue(), headers={"Content-Type": PARQUET}, timeout=60
    )
    assert r.status_code == 400 and "BYTE_ARRAY" in r.json()["message"], r.text[:500]


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _zstd_zeros(n: int) -> bytes:
    """A zstd frame of ``n`` zero bytes made of RLE blocks: 4 bytes per 128 KiB."""
    block = 1 << 17
    out = bytearray(b"\x28\xb5\x2f\xfd")  # magic
    out += bytes([0xC0, 0x38]) + n.to_bytes(8, "little")  # 8-byte content size, 128 KiB window
    for start in range(0, n, block):
        size = min(block, n - start)
        last = int(start + size >= n)
        out += (last | 1 << 1 | size << 3).to_bytes(3, "little") + b"\0"  # RLE block of 0
    return bytes(out)


def _page_bomb(claimed: int = 1 << 30) -> bytes:
    """A real parquet file (pyarrow, zstd, one column ``f0``) whose one data page is replaced
    by a page whose header claims ``claimed`` bytes, its zstd frame decompressing to that many
    zeros (padded with a skippable frame): the page takes the same bytes as before, so the
    footer, written by pyarrow, still describes the file (a few kB of values)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from jaxexp_mlflow.serving.parquet_pages import read_page_header

    values = np.random.default_rng(0).standard_normal(4_400)  # 35 kB, incompressible
    buf = io.BytesIO()
    pq.write_table(
        pa.table({"f0": values}),
        buf,
        compression="zstd",
        use_dictionary=False,
        write_statistics=False,
    )
    body = buf.getvalue()
    chunk = pq.ParquetFile(io.BytesIO(body)).metadata.row_group(0).column(0)
    pos = chunk.data_page_offset
    page, data_at = read_page_header(body, pos, len(body))
    assert page.kind == 0 and body[pos : pos + 3] == b"\x15\x00\x15"  # type, then sizes
    after = pos + 3
    while body[after] & 0x80:  # uncompressed_page_size
        after += 1
    after += 2  # its last byte, the next field's header
    while body[after] & 0x80:  # compressed_page_size
        after += 1
    after += 1
    frame = _zstd_zeros(claimed)
    span = data_at - pos + page.compressed
    compressed = page.compressed
    for _ in range(3):  # the size's own width may change the size
        head = b"\x15\x00\x15" + _varint(2 * claimed) + b"\x15" + _varint(2 * compressed)
        head += body[after:data_at]
        compressed = span - len(head)
    pad = compressed - len(frame) - 8
    assert pad >= 0 and len(head) + compressed == span
    skippable = b"\x50\x2a\x4d\x18" + pad.to_bytes(4, "little") + b"\0" * pad
    bomb = body[:pos] + head + frame + skippable + body[pos + span :]
    assert len(bomb) == len(body) < 64 << 10
    return bomb


def test_parquet_page_claiming_1_gib_is_refused_before_decompressing(served):
    """The footer states 4400 values; the one zstd page's header claims 1 GiB (and its frame
    holds it): refused (413) off the page headers, the server's RSS flat, still serving."""
    url, proc, _ = served
    body = _page_bomb()
    before = tree_rss(proc.pid)
    r = requests.post(
        f"{url}/invocations", data=body, headers={"Content-Type": PARQUET}, timeout=120
    )
    grown_mb = (tree_rss(proc.pid) - before) / 2**20
    assert r.status_code == 413, (r.status_code, r.text[:500])
    assert len(r.content) < 2048 and "x: float32[-1,8]" in r.json()["message"], r.text[:500]
    assert grown_mb < RSS_BOUND_MB, f"server RSS grew by {grown_mb:.0f} MB"
    assert proc.poll() is None
    assert requests.get(f"{url}/ping", timeout=30).status_code == 200


@pytest.mark.parametrize(
    ("options", "kinds"),
    [
        ({}, {0, 2}),  # dictionary page, then data pages
        ({"compression": "zstd", "use_dictionary": False}, {0}),
        ({"data_page_version": "2.0"}, {2, 3}),
        ({"data_page_size": 1000, "row_group_size": 3000, "compression": "gzip"}, {0, 2}),
    ],
    ids=["dictionary", "zstd-plain", "page-v2", "many-pages"],
)
def test_page_headers_read_as_pyarrow_writes_them(options, kinds):
    """``parquet_pages`` against pyarrow's own files: every column chunk's pages hold the
    values its footer states, in the bytes it states."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from jaxexp_mlflow.serving.parquet_pages import page_sizes

    n = 10_000
    table = pa.table(
        {"a": np.arange(n, dtype=np.float64) % 7, "b": pa.array([[1.0, 2.0, 3.0]] * n)}
    )
    buf = io.BytesIO()
    pq.write_table(table, buf, **options)
    body = buf.getvalue()
    meta = pq.ParquetFile(io.BytesIO(body)).metadata
    found = set()
    for g in range(meta.num_row_groups):
        for c in range(meta.num_columns):
            chunk = meta.row_group(g).column(c)
            start = chunk.data_page_offset
            if chunk.has_dictionary_page and chunk.dictionary_page_offset:
                start = min(start, chunk.dictionary_page_offset)
            pages = page_sizes(body, start, chunk.total_compressed_size)
            found |= {p.kind for p in pages}
            data = [p for p in pages if p.kind in (0, 3)]
            assert sum(p.num_values for p in data) == chunk.num_values
            unpacked = sum(p.uncompressed for p in pages)
            assert unpacked <= chunk.total_uncompressed_size <= unpacked + 256 * len(pages)
    assert found == kinds


def test_csv_cell_nested_deep_is_400(served):
    url, proc, _ = served
    body = 'x\n"' + "[" * 5000 + "]" * 5000 + '"\n'
    r = requests.post(
        f"{url}/invocations", data=body, headers={"Content-Type": "text/csv"}, timeout=60
    )
    assert r.status_code == 400, (r.status_code, r.text[:500])
    assert "nests too deeply" in r.json()["message"] and len(r.content) < 2048
    assert proc.poll() is None


def _held(port: int, length: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(
        b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % length
    )
    s.sendall(b" " * (length - 1))  # all but the last byte, then nothing
    return s


def test_stalled_bodies_are_dropped_and_free_the_budget(served):
    url, _, _ = served
    port = int(url.rsplit(":", 1)[1])
    held = [_held(port, MAX_BODY - 10) for _ in range(4)]  # 4x the limit: the whole budget
    time.sleep(0.5)
    filler = json.dumps({"inputs": batch(2).tolist()}) + " " * 150_000
    busy = requests.post(
        f"{url}/invocations", data=filler, headers={"Content-Type": "application/json"}, timeout=60
    )
    assert busy.status_code == 503, busy.text[:300]  # the stalled bodies hold the budget
    statuses = [http_status(h) for h in held]  # answered once their time is up
    for h in held:
        h.close()
    assert statuses == [408] * 4
    ok = requests.post(
        f"{url}/invocations", data=filler, headers={"Content-Type": "application/json"}, timeout=60
    )
    assert ok.status_code == 200, ok.text[:300]


MAX_CONNECTIONS = 20
HEADER_TIMEOUT_S = 2
IDLE_SOCKETS = 50  # more than MAX_CONNECTIONS


@pytest.fixture(scope="module")
def served_few_sockets(model_dir, tmp_path_factory):
    """``jaxexp serve --max-connections 20`` with ``JAXEXP_HEADER_TIMEOUT_S=2`` (the option and
    the variable, as a user sets them)."""
    from jaxexp_mlflow.serving.connections import ENV_HEADER_TIMEOUT

    tmp = tmp_path_factory.mktemp("sockets-server")
    env = {**server_env(tmp), ENV_HEADER_TIMEOUT: str(HEADER_TIMEOUT_S)}
    extra = ("--max-connections", str(MAX_CONNECTIONS))
    proc, url = start_jaxexp_server(str(model_dir), env, tmp / "server.log", *extra)
    try:
        yield url, proc
    finally:
        stop_server(proc)


def test_idle_sockets_cannot_hold_the_server(served_few_sockets):
    """50 sockets that send nothing, and one that sends half its headers: a client beside them
    is answered, and each of them is answered 408 and closed (the oldest at once, to make
    room; the others after the header timeout) instead of being held for ever."""
    url, proc = served_few_sockets
    port = int(url.rsplit(":", 1)[1])
    wait_s = 10 * HEADER_TIMEOUT_S  # a bound on each read, never reached when the server drops
    idle: list[socket.socket] = []
    try:
        for _ in range(IDLE_SOCKETS):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=wait_s))
        slow = socket.create_connection(("127.0.0.1", port), timeout=wait_s)
        idle.append(slow)
        slow.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Ty")  # half the headers
        body = json.dumps({"inputs": batch(2).tolist()})
        json_type = {"Content-Type": "application/json"}
        r = requests.post(f"{url}/invocations", data=body, headers=json_type, timeout=60)
        assert r.status_code == 200, r.text[:300]
        statuses = []
        for s in idle:
            try:
                statuses.append(http_status(s))
            except TimeoutError:
                statuses.append(-1)  # still held
        assert statuses == [408] * len(idle), statuses
    finally:
        for s in idle:
            s.close()
    assert proc.poll() is None
    assert requests.get(f"{url}/ping", timeout=30).status_code == 200


_DEADLINE_CHILD = """
import json, sys, time
from jaxexp_mlflow.serving import server, serving_guard
_, impl = server.load(sys.argv[1], {"buckets": [1, 2], "precompile": False})
body = json.dumps({"inputs": [[0.5] * 8] * 64}).encode()
calls = []
run = impl.run
impl.run = lambda leaves: calls.append(leaves[0].shape[0]) or run(leaves)
with serving_guard.deadline(time.monotonic() - 1):
    late = server.invocations(impl, body, "application/json")
calls_late = len(calls)
with serving_guard.deadline(time.monotonic() + 600):
    text, status, _ = server.invocations(impl, body, "application/json")
print("RESULT " + json.dumps({"late": late[:2], "calls_late": calls_late, "calls": len(calls),
                              "status": status, "rows": len(json.loads(text)["predictions"])}))
"""


def test_request_past_its_deadline_stops_its_work(model_dir, tmp_path):
    """The server's own ``invocations`` under a deadline already passed: no chunk runs. In a
    child process: importing the server module makes a process a scoring server (buckets
    compiled at load), which the other tests of this process must not become."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "JAXEXP_COMPILATION_CACHE": str(tmp_path / "xla")}
    done = subprocess.run(
        [sys.executable, "-c", _DEADLINE_CHILD, str(model_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, done.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    assert out["late"][1] == 504 and "exceeded" in out["late"][0]
    assert out["calls_late"] == 0  # stopped before any work: the checkpoint after parsing
    assert out["status"] == 200 and out["rows"] == 64  # in time: answered in chunks of 2
    assert out["calls"] > 1  # the run that counts chunks did run (the count could fail)


# -- compiled shapes: least recently used evicted past JAXEXP_MAX_SHAPES --------------------------


def _bt_fn(params, x):
    import jax.numpy as jnp

    return jnp.tanh(x * params["w"]).sum(axis=1)


@pytest.fixture(scope="module")
def bt_model_dir(tmp_path_factory):
    """A ``[b, t]`` model: every new ``t`` is a new compiled shape."""
    import jax
    import jax.numpy as jnp

    b, t = jax.export.symbolic_shape("b, t")
    exported = jax.export.export(jax.jit(_bt_fn))(
        {"w": jax.ShapeDtypeStruct((), jnp.float32)}, jax.ShapeDtypeStruct((b, t), jnp.float32)
    )
    path = tmp_path_factory.mktemp("bt") / "bt"
    mlflow.jaxexp.save_model(
        exported, path, params={"w": np.float32(0.5)}, serving_config={"buckets": [1, 2]}
    )
    return path


def test_compiled_shapes_are_bounded_lru(bt_model_dir, tmp_path, monkeypatch):
    from jaxexp_mlflow.runtime import executables
    from jaxexp_mlflow.serving.pyfunc import load_pyfunc

    monkeypatch.setenv(executables.ENV_MAX_SHAPES, "4")
    monkeypatch.setenv("JAXEXP_PYFUNC_CACHE", "0")
    monkeypatch.setenv("JAXEXP_COMPILATION_CACHE", str(tmp_path / "xla"))
    impl = load_pyfunc(bt_model_dir)
    assert impl._flat.capacity == 4
    for t in range(1, 11):
        x = np.linspace(-1, 1, 2 * t, dtype=np.float32).reshape(2, t)
        np.testing.assert_allclose(impl.predict(x), np.tanh(x * 0.5).sum(axis=1), rtol=1e-5)
        assert impl._flat._cache_size() <= 4
    assert impl._flat.compiles + impl._flat.loaded == 10
    x = np.ones((2, 1), np.float32)  # t=1 was evicted: compiled (or loaded) again, same answer
    np.testing.assert_allclose(impl.predict(x), np.tanh(x * 0.5).sum(axis=1), rtol=1e-5)
    assert impl._flat.compiles + impl._flat.loaded == 11


@pytest.mark.slow  # 90 compiles in a real server: ~21 s here
def test_served_new_shapes_plateau_in_memory(bt_model_dir, tmp_path):
    """``jaxexp serve``: one-row requests of ever new ``t``; past the bound of kept shapes the
    server's RSS stops growing (each new shape still costs a compile)."""
    env = {**server_env(tmp_path), "JAXEXP_MAX_SHAPES": "16"}
    proc, url = start_jaxexp_server(str(bt_model_dir), env, tmp_path / "server.log")
    session = requests.Session()

    def ask(t: int) -> None:
        x = np.full((1, t), 0.25, np.float32)
        r = session.post(f"{url}/invocations", json={"inputs": x.tolist()}, timeout=60)
        assert r.status_code == 200, r.text[:300]
        np.testing.assert_allclose(r.json()["predictions"], np.tanh(x * 0.5).sum(1), rtol=1e-5)

    try:
        for t in range(1, 31):  # past the 16 kept shapes
            ask(t)
        before = tree_rss(proc.pid)
        for t in range(31, 91):  # 60 new shapes: ~100 MB when every executable was kept
            ask(t)
        grown_mb = (tree_rss(proc.pid) - before) / 2**20
        assert grown_mb < 40, f"server RSS grew by {grown_mb:.0f} MB over 60 new shapes"
    finally:
        stop_server(proc)


@pytest.mark.parametrize(
    "header",
    [
        b"\x1b\xff\xff\xff\xff\x0f\x11",  # a map of 2^32 boolean pairs in 2 bytes
        b"\x19\xf9\xff\xff\xff\x0f",  # a list of 2^32 structs, none there
        b"\x1c" * 40,  # structs nested 40 deep
        b"\x15\x00\x15",  # cut off
    ],
    ids=["map", "list", "nested", "truncated"],
)
def test_hostile_page_headers_are_refused_by_the_body_end(header):
    """Each element of a Thrift container takes a byte at least, so a header claiming more than
    the body holds ends at the body's end: ``BadPages``, never a loop past it."""
    from jaxexp_mlflow.serving.parquet_pages import BadPages, page_sizes

    with pytest.raises(BadPages):
        page_sizes(header, 0, len(header))
