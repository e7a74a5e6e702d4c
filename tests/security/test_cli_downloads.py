"""The downloads of ``jaxexp inspect``, ``check`` (and ``audit``, which fetches the
same way) and ``refresh`` stop at the listed size, refuse a listed size past the file's limit
before fetching, and leave nothing behind. The store is the hostile fake ``mlflow server`` of
tests/security/conftest.py (a real HTTP server on 127.0.0.1)."""

from __future__ import annotations

import posixpath
from pathlib import Path

import mlflow
import pytest
from click.testing import CliRunner

import jaxexp_mlflow  # noqa: F401  (mlflow.jaxexp)
from jaxexp_mlflow.cli import main
from tests.models import batch, export_mlp, mlp_params


def _cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.mark.parametrize("command", ["inspect", "check"])
def test_a_store_sending_more_than_it_listed_is_cut_off(store, command):
    handler, uri, tmp = store
    handler.tree = {"model": [("MLmodel", False, 2800), ("exported.bin", False, 4)]}
    handler.files = {"model/MLmodel": b"x" * (32 << 20), "model/exported.bin": b"abcd"}
    result = _cli(command, uri)
    assert result.exit_code == 2, result.output
    err = " ".join(result.stderr.split())
    assert "2800 bytes but sent more" in err, err
    assert not any(tmp.iterdir())  # nothing left behind


def test_a_listed_size_past_the_limit_is_refused_before_fetching(store):
    handler, uri, tmp = store
    handler.tree = {"model": [("MLmodel", False, 300 << 20)]}
    handler.files = {"model/MLmodel": b"x" * 16}
    result = _cli("inspect", uri)
    assert result.exit_code == 2, result.output
    assert "Nothing was downloaded" in " ".join(result.stderr.split())
    assert handler.requests == 1  # the listing only
    assert not any(tmp.iterdir())


def _serve(handler, root: Path) -> None:
    """The fake store serves the model directory ``root`` as ``model/...``."""
    handler.tree, handler.files = {}, {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        parent = posixpath.dirname(f"model/{rel}")
        size = 0 if path.is_dir() else path.stat().st_size
        handler.tree.setdefault(parent, []).append((path.name, path.is_dir(), size))
        if path.is_file():
            handler.files[f"model/{rel}"] = path.read_bytes()


def test_refresh_downloads_bounded_and_leaves_nothing_behind(store, tracking_uri, tmp_path):
    handler, uri, tmp = store  # tempfile's directory is tmp: every temporary copy lands there
    params = mlp_params()
    src = tmp_path / "src"
    mlflow.jaxexp.save_model(export_mlp(params), src, params=params, input_example=batch())
    _serve(handler, src)
    result = _cli("refresh", uri)
    assert result.exit_code == 0, result.output
    assert list(tmp.iterdir()) == []

    # a file sent bigger than listed: refused, and again nothing stays
    handler.files["model/MLmodel"] += b"#" * (8 << 20)
    result = _cli("refresh", uri)
    assert result.exit_code == 2, result.output
    assert "sent more" in " ".join(result.stderr.split())
    assert list(tmp.iterdir()) == []


class _Page(list):
    """A page of results as MLflow's ``search_*`` calls return it (``token``: the next)."""

    def __init__(self, items, token):
        super().__init__(items)
        self.token = token


@pytest.mark.parametrize("token", [lambda n: "same", lambda n: f"t{n}"])
def test_audit_stops_a_registry_that_pages_without_end(token, monkeypatch):
    """A tracking server answering with another page forever (or the same token again)."""
    from jaxexp_mlflow.cli._common import InputProblem
    from jaxexp_mlflow.cli.audit import _pages

    monkeypatch.setenv("JAXEXP_MAX_LIST_ENTRIES", "1000")
    calls = []

    def search_registered_models(page_token=None):
        calls.append(page_token)
        if len(calls) > 10_000:
            raise AssertionError("still paging after 10 000 pages")
        return _Page([f"m{len(calls)}"] * 10, token(len(calls)))

    with pytest.raises(InputProblem, match="JAXEXP_MAX_LIST_ENTRIES"):
        _pages(search_registered_models)
    assert len(calls) <= 101
