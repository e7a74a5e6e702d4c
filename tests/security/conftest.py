"""Fixtures of the hostile-input tests: a hostile artifact store.

The store is a real HTTP server on 127.0.0.1 imitating ``mlflow server``'s artifact endpoints
(``GET /api/2.0/mlflow-artifacts/artifacts?path=...`` lists a directory,
``GET /api/2.0/mlflow-artifacts/artifacts/<path>`` sends a file); each test sets what it lists
and sends. Used by test_transfer_safety.py and test_cli_downloads.py.
"""

from __future__ import annotations

import json
import posixpath
import tempfile
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

ENDPOINT = "/api/2.0/mlflow-artifacts/artifacts"


class _Store(BaseHTTPRequestHandler):
    """``tree``: {directory path: [(name, is_dir, size)]} or a callable of the path;
    ``files``: {file path: bytes}."""

    tree = None
    files: dict[str, bytes] = {}
    requests = 0

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):  # noqa: N802 - http.server's name
        type(self).requests += 1
        url = urllib.parse.urlparse(self.path)
        if url.path == ENDPOINT:
            path = urllib.parse.parse_qs(url.query).get("path", [""])[0]
            tree = self.tree
            path = posixpath.normpath(path) if path else path
            entries = tree(path) if callable(tree) else tree.get(path, [])
            body = json.dumps(
                {
                    "files": [
                        {"path": n, "is_dir": d, **({} if d else {"file_size": s})}
                        for n, d, s in entries
                    ]
                }
            ).encode()
            self._send(200, [body], len(body), "application/json")
            return
        rel = urllib.parse.unquote(url.path[len(ENDPOINT) + 1 :])
        data = self.files.get(rel)
        if data is None:
            self._send(500, [b"no"], 2, "text/plain")
        else:
            parts = [data[i : i + (1 << 20)] for i in range(0, len(data), 1 << 20)]
            self._send(200, parts, len(data), "application/octet-stream")

    def _send(self, code, parts, length, ctype):
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(length))
        self.end_headers()
        try:
            for p in parts:
                self.wfile.write(p)
        except OSError:  # the client hung up (what a bounded download does)
            pass


@pytest.fixture
def store(monkeypatch, tmp_path):
    """A fake artifact store; yields (handler class, model URI). Downloads land in tmp."""
    handler = type("Store", (_Store,), {"tree": {}, "files": {}, "requests": 0})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    try:
        yield handler, f"http://127.0.0.1:{server.server_address[1]}{ENDPOINT}/model", tmp
    finally:
        server.shutdown()
        server.server_close()
