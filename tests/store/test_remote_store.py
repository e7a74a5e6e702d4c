"""Log to and load from a real remote tracking server (`mlflow server`, artifacts proxied).

The server runs with a sqlite backend and, where PostgreSQL 15 is installed (Debian's
postgresql-15: the tests start their own cluster in a temp dir), with a PostgreSQL backend
reached through psycopg 3.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import mlflow
import numpy as np
import pytest

import jaxexp_mlflow  # noqa: F401
from jaxexp_mlflow.codec import zarr
from tests.conftest import free_port
from tests.models import batch, export_mlp, mlp_apply, mlp_params
from tests.servers import mlflow_server

PG_BIN = Path("/usr/lib/postgresql/15/bin")
REPO = Path(__file__).resolve().parents[2]


def _as_postgres(*cmd: str) -> list[str]:
    """Run a PostgreSQL tool as the ``postgres`` user when we are root (initdb refuses root)."""
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else list(cmd)


@pytest.fixture(scope="module")
def postgres(tmp_path_factory):
    """A throwaway PostgreSQL cluster on 127.0.0.1; yields its SQLAlchemy URI."""
    pytest.importorskip("psycopg")
    if not (PG_BIN / "initdb").exists() or (os.geteuid() == 0 and not shutil.which("runuser")):
        pytest.skip("PostgreSQL 15 binaries not installed")
    # not under pytest's tmp dir: the postgres user cannot enter root's private directories
    root = Path(tempfile.mkdtemp(prefix="jaxexp-pg-"))
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
    data, port = root / "data", free_port()
    run = lambda *c: subprocess.run(_as_postgres(*c), check=True, capture_output=True)  # noqa: E731
    run(str(PG_BIN / "initdb"), "-D", str(data), "-A", "trust", "-U", "mlflow")
    run(
        str(PG_BIN / "pg_ctl"),
        "-D",
        str(data),
        "-l",
        str(root / "log"),
        "-w",
        "start",
        "-o",
        f"-k {root} -p {port} -c listen_addresses=127.0.0.1",
    )
    try:
        run(str(PG_BIN / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "mlflow", "mlflow")
        yield f"postgresql+psycopg://mlflow@127.0.0.1:{port}/mlflow"
    finally:
        run(str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "fast", "stop")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server(request, tmp_path_factory):
    """A real ``mlflow server`` on 127.0.0.1 with a sqlite (the session's, tests/conftest.py) or
    PostgreSQL backend and proxied artifacts; ``(url, artifacts_dir)``."""
    if request.param == "sqlite":
        yield request.getfixturevalue("tracking_server")
        return
    root = tmp_path_factory.mktemp("server")
    with mlflow_server(root, backend=request.getfixturevalue("postgres")) as (url, _):
        yield url, root / "artifacts"


def test_log_and_load_through_a_remote_server(server, tmp_path, monkeypatch):
    server, artifacts = server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    mlflow.set_tracking_uri(server)
    try:
        mlflow.set_experiment("remote")
        params = mlp_params()
        x = batch(3)
        with mlflow.start_run() as run:
            info = mlflow.jaxexp.log_model(
                export_mlp(params),
                name="model",
                params=params,
                input_example=x,
                registered_model_name="remote-mlp",
            )
        # the artifacts went through the server into its own artifact store
        assert len([p for p in artifacts.rglob("exported.bin") if info.model_id in str(p)]) == 1
        runs_uri = f"runs:/{run.info.run_id}/model"  # the logged model, found by its run
        for i, uri in enumerate((info.model_uri, "models:/remote-mlp/1", runs_uri)):
            (tmp_path / str(i)).mkdir()
            model = mlflow.jaxexp.load_model(uri, dst_path=str(tmp_path / str(i)))
            np.testing.assert_allclose(model(x), mlp_apply(params, x), rtol=1e-6)
        # into load_model's private download the params are mapped, not copied, and the
        # download's params files are gone once the model holds them
        monkeypatch.setattr(zarr, "MAP_MIN_BYTES", 0)
        before = _deleted_params_mappings()  # other tests' models, not yet collected
        model = mlflow.jaxexp.load_model("models:/remote-mlp/1")
        np.testing.assert_allclose(model(x), mlp_apply(params, x), rtol=1e-6)
        assert len(_deleted_params_mappings() - before) == len(jax.tree.leaves(params))
        # a fresh process that only knows the server URI reproduces the result
        code = (
            "import sys, mlflow\n"
            "from jaxexp_mlflow.archive.reproduce import verify_directory\n"
            "from mlflow.artifacts import download_artifacts\n"
            "d = download_artifacts(sys.argv[1])\n"
            "m = mlflow.jaxexp.load_model(d)\n"
            "print(all(c.passed for c in verify_directory(m, d)))\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, "models:/remote-mlp/1"],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "MLFLOW_TRACKING_URI": server},
        )
        assert out.stdout.strip().splitlines()[-1] == "True"
    finally:
        mlflow.set_tracking_uri(None)


def _deleted_params_mappings() -> set[str]:
    """The unlinked params files this process maps (their paths)."""
    with open(f"/proc/{os.getpid()}/maps") as maps:
        return {
            line.split(None, 5)[-1].strip()
            for line in maps
            if "/params/" in line and "(deleted)" in line
        }


_LOAD_CHILD = """
import json, os, sys
import mlflow
import jaxexp_mlflow
from click.testing import CliRunner
from jaxexp_mlflow.cli import main
from jaxexp_mlflow.errors import ArtifactError
out = {}
for name, uri in (("hostile", sys.argv[1]), ("clean", sys.argv[2])):
    try:
        mlflow.jaxexp.load_model(uri)
        out[name] = "loaded"
    except ArtifactError as err:
        out[name] = "ArtifactError: " + str(err)[:600]
    out[name + " leaves"] = sorted(os.listdir(os.environ["TMPDIR"]))
verify = CliRunner().invoke(main, ["verify", sys.argv[1]])
out["verify code"] = verify.exit_code
out["verify output"] = (verify.stdout + verify.stderr)[-4000:]
out["verify leaves"] = sorted(os.listdir(os.environ["TMPDIR"]))
print("RESULT " + json.dumps(out))
"""

JUNK_BYTES = 1 << 30  # sparse: no disk on the server's side


def test_files_no_array_uses_are_refused_before_download(tracking_server, tmp_path):
    """A store adds a 1 GiB (sparse) file to a logged model's params, named like a chunk of
    ``w1`` (which has one chunk), and re-seals the manifest so that its sizes, checksums and
    binding all agree: the load through ``mlflow server`` refuses the file by name before
    downloading it, and the loader's TMPDIR is empty once it returns (refused or loaded).

    The altered model is this test's own, in the session's server; one fresh process (its
    TMPDIR the test's) loads both models and runs ``jaxexp verify`` on the hostile one."""
    import yaml

    from jaxexp_mlflow.params import manifest as M

    url, artifacts = tracking_server
    mlflow.set_tracking_uri(url)
    try:
        mlflow.set_experiment("hostile-store")
        params = mlp_params()
        infos = []
        for _ in range(2):
            with mlflow.start_run():
                infos.append(
                    mlflow.jaxexp.log_model(
                        export_mlp(params), name="model", params=params, input_example=batch(2)
                    )
                )
    finally:
        mlflow.set_tracking_uri(None)
    hostile, clean = infos
    found = [
        p.parent for p in artifacts.rglob("jaxexp_manifest.json") if hostile.model_id in str(p)
    ]
    assert len(found) == 1, found
    ckpt = found[0]
    with open(ckpt / "w1" / "1.0", "wb") as f:
        f.truncate(JUNK_BYTES)
    M.write_manifest(ckpt)
    mlmodel = yaml.safe_load((ckpt.parent / "MLmodel").read_text())
    M.bind_manifest(ckpt, M.model_identity(mlmodel))
    M.verify_checkpoint(ckpt, mlmodel=mlmodel).same_save()  # a consistent store
    tmp = tmp_path / "loader-tmp"
    tmp.mkdir()
    env = {**os.environ, "MLFLOW_TRACKING_URI": url, "TMPDIR": str(tmp)}
    env.pop("MLFLOW_EXPERIMENT_ID", None)
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD_CHILD, hostile.model_uri, clean.model_uri],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    assert out["verify code"] != 0 and "w1/1.0" in out["verify output"], out
    assert out["verify leaves"] == [], "jaxexp verify left files in TMPDIR"
    assert out["hostile"].startswith("ArtifactError"), out
    assert "'w1/1.0'" in out["hostile"] and "Nothing of it was downloaded" in out["hostile"], out
    assert out["hostile leaves"] == [], out
    assert out["clean"] == "loaded", out
    assert out["clean leaves"] == [], out


@pytest.mark.parametrize("which", ["saved", "zarr3-0.1.0"])
def test_used_files_of_real_checkpoints(which, saved_mlp, tmp_path):
    """``store.used_files`` on real checkpoints: what this package saves now (zarr2) and what
    0.1.0 saved (zarr3) use every file their manifest lists; an added file, a chunk file longer
    than its chunk and a chunk the metadata does not state are refused by name."""
    from jaxexp_mlflow.params import manifest as M
    from jaxexp_mlflow.store import used_files

    source = saved_mlp if which == "saved" else REPO / "tests/data/models/jaxexp-0.1.0-mlp"
    ckpt = Path(shutil.copytree(source, tmp_path / "m")) / "params"
    entries = M.read_manifest(ckpt).files

    def judge(found: dict) -> list:
        return used_files.refused(found, lambda d: zarr.read_meta(ckpt, d, found), False)

    assert judge(entries) == []
    chunk = next(r for r in entries if r.startswith("w") and "/" in r and "zarr" not in r)
    size, crc = entries[chunk]
    extra_chunk = chunk.rsplit("/", 1)[0] + "/" + ("9.0" if which == "saved" else "c.9.0")
    bad = {
        **entries,
        "junk/big": (1 << 31, 0),
        chunk: (size + 1, crc),
        extra_chunk: (size, crc),
    }
    found = {rel: why for rel, _, why in judge(bad)}
    assert set(found) == {"junk/big", chunk, extra_chunk}, found
    assert "no array" in found["junk/big"] and "bytes of a chunk" in found[chunk]
    assert "chunk files" in found[extra_chunk]
    ocdbt = {"manifest.ocdbt": (10, 0), "d/0a1b": (10, 0), "ocdbt.process_0/d/ff": (10, 0)}
    assert judge({**entries, **ocdbt}) != []  # not an OCDBT checkpoint: refused
    with_ocdbt = {**entries, **ocdbt}
    reader = lambda d: zarr.read_meta(ckpt, d, with_ocdbt)  # noqa: E731
    assert used_files.refused(with_ocdbt, reader, True) == []
