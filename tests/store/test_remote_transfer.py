"""How models travel through a real ``mlflow server``: progress on a terminal only (the
``jaxexp`` CLI and the API), and an upload cut by a killed server leaves nothing that loads."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import mlflow
import numpy as np
import pytest
from mlflow.exceptions import MlflowException

import jaxexp_mlflow  # noqa: F401
from jaxexp_mlflow.params import save_params
from tests.conftest import REPO, run_cli, sqlite_uri
from tests.models import log_registered
from tests.servers import free_port, kill_group, mlflow_server

MiB = 2**20


def apply(params, x):
    return x @ params["w"][:4] + params["b"]


def make_params(nbytes: int, n: int = 1) -> dict:
    rng = np.random.default_rng(0)
    rows = nbytes // n // 16
    out = {f"w{i or ''}": rng.standard_normal((rows, 4), np.float32) for i in range(n)}
    return {**{k: jnp.asarray(v) for k, v in out.items()}, "b": jnp.ones(4, jnp.float32)}


@pytest.fixture(scope="module")
def server(tracking_server):
    """The session's ``mlflow server`` (tests/conftest.py), its URL."""
    return tracking_server[0]


def _env(url: str, **extra: str) -> dict[str, str]:
    env = {**os.environ, "MLFLOW_TRACKING_URI": url, "PYTHONPATH": str(REPO), **extra}
    for name in (
        "JAXEXP_PROGRESS",
        "MLFLOW_EXPERIMENT_ID",
        "MLFLOW_EXPERIMENT_NAME",
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR",
    ):
        env.pop(name, None)
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    return env


def run_in_pty(cmd: list[str], env: dict[str, str], timeout: float = 300) -> tuple[int, str]:
    """Run ``cmd`` with a pseudo-terminal as stdin/stdout/stderr; return (code, output)."""
    master, slave = pty.openpty()
    # a real terminal has a size; tqdm draws nothing on a 0-column one
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    out, deadline = b"", time.time() + timeout
    try:
        while time.time() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return proc.wait(timeout=30), out.decode(errors="replace")


@pytest.fixture(scope="module")
def blob_and_params(tmp_path_factory):
    """A serialized export, its params as an Orbax checkpoint (8 MiB) and an input example."""
    root = tmp_path_factory.mktemp("cli")
    params = make_params(8 * MiB)
    x = np.ones((2, 4), np.float32)
    sds = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    exp = jax.export.export(jax.jit(apply))(sds, jax.ShapeDtypeStruct(x.shape, x.dtype))
    (root / "exported.bin").write_bytes(exp.serialize())
    save_params(params, root / "ckpt")
    np.save(root / "x.npy", x)
    return root


def test_progress_on_a_terminal_and_silence_elsewhere(server, blob_and_params, monkeypatch):
    """``jaxexp log`` and ``jaxexp verify`` against the server show bytes, rate and ETA on a
    terminal, and nothing of it when their output goes elsewhere (click's runner here: no
    terminal, the stderr it captures also holds MLflow's own bars)."""
    d = blob_and_params
    log = ["log", str(d / "exported.bin"), "--params", str(d / "ckpt")]
    log += ["--input-example", str(d / "x.npy"), "--register", "progress"]
    code, out = run_in_pty(["jaxexp", *log], _env(server))
    assert code == 0, out
    assert "Uploading params" in out and "B/s" in out, out
    code, out = run_in_pty(["jaxexp", "verify", "models:/progress/1"], _env(server))
    assert code == 0, out
    assert "Downloading" in out and "B/s" in out and "PASS" in out.upper(), out

    env = {"MLFLOW_TRACKING_URI": server, "MLFLOW_EXPERIMENT_NAME": None}
    env |= {"JAXEXP_PROGRESS": None, "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": None}
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)  # set_experiment sets it: undone
    mlflow.set_tracking_uri(server)
    try:
        mlflow.set_experiment("Default")  # where the console script logs
        piped = run_cli(*log, env=env)
        assert piped.exit_code == 0, piped.stderr
        piped2 = run_cli("verify", "models:/progress/2", env=env)
        assert piped2.exit_code == 0, piped2.stderr
    finally:
        mlflow.set_tracking_uri(None)
    for text in (piped.stderr, piped2.stderr):
        assert "B/s" not in text and "Uploading" not in text and "Downloading" not in text


_CHILD = """
import mlflow, numpy as np
from tests.models import log_registered
from tests.store.test_remote_transfer import apply, make_params
mlflow.set_experiment("retry")
log_registered(apply, make_params(128 * 2**20, 16), np.ones((2, 4), np.float32), "retry")
"""


def test_upload_cut_by_a_killed_server_leaves_nothing_that_loads(tmp_path, monkeypatch):
    """Kill the server (and its workers) while the params go up: what reached the store does not
    load, nothing was registered, and logging again once the server is back succeeds."""
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)  # set_experiment sets it: undone
    root, port = tmp_path / "server", free_port()
    root.mkdir()
    backend = sqlite_uri(root / "db.sqlite")
    with mlflow_server(root, backend=backend, port=port) as (url, proc):
        env = _env(
            url,
            MLFLOW_HTTP_REQUEST_MAX_RETRIES="0",
            JAXEXP_TRANSFER_WORKERS="1",
            JAXEXP_READBACK_RESTORE_MAX_BYTES=str(64 * MiB),  # big: bound by the read-back
        )
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        deadline, started = time.time() + 300, False
        while time.time() < deadline and child.poll() is None and not started:
            started = any((root / "artifacts").rglob("params/w*/0.0"))
            time.sleep(0.002)
        kill_group(proc)
        _, err = child.communicate(timeout=300)
        assert started, err.decode()[-2000:]
        assert child.returncode != 0, "the upload finished before the server was killed"
    with mlflow_server(root, backend=backend, port=port) as (url, _):
        mlflow.set_tracking_uri(url)
        try:
            client = mlflow.MlflowClient()
            exp = client.get_experiment_by_name("retry")
            cut = client.search_logged_models([exp.experiment_id])
            assert len(cut) == 1
            with pytest.raises(MlflowException):
                mlflow.jaxexp.load_model(f"models:/{cut[0].model_id}")
            assert not client.search_model_versions("name='retry'")
            # the retry
            mlflow.set_experiment("retry")
            params = make_params(128 * MiB, 16)
            x = np.ones((2, 4), np.float32)
            log_registered(apply, params, x, "retry")
            model = mlflow.jaxexp.load_model("models:/retry/1")
            np.testing.assert_allclose(model(x), apply(params, x), rtol=1e-6)
        finally:
            mlflow.set_tracking_uri(None)


@pytest.mark.slow
@pytest.mark.parametrize("gib", [4, 8])
def test_big_params_through_the_server_in_bounded_memory(gib, tmp_path):
    """4 and 8 GiB of params logged and loaded (every byte touched) through the server, each in
    a fresh process: peak RSS above the interpreter stays below 1.25x the params size."""
    psutil = pytest.importorskip("psutil")
    if psutil.virtual_memory().available < 2.5 * gib * 2**30:
        pytest.skip(f"needs ~{2.5 * gib:g} GiB of free memory")
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_remote import bench_scale

    root = tmp_path / "server"
    root.mkdir()
    with mlflow_server(root, backend=sqlite_uri(root / "db.sqlite")) as (url, _):
        rows = bench_scale(url, [float(gib)])
    for row in rows:
        print(row)  # the figures, with -s
        assert row["ratio"] < 1.25, row


def test_download_matches_mlflows_own_and_skips_what_it_is_told(
    tracking_server, tmp_path, monkeypatch
):
    """``download.download_model`` lists and downloads on one pool; the files it brings back
    are byte for byte those of MLflow's ``download_artifacts``, minus the skipped directory;
    a listing the server fails to give is raised, not a silently partial download (the model
    damaged in the session's server is this test's own)."""
    from mlflow.artifacts import download_artifacts
    from mlflow.store.artifact.http_artifact_repo import HttpArtifactRepository

    from jaxexp_mlflow.store import transfer
    from jaxexp_mlflow.store.download import download_model

    url, artifacts = tracking_server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    mlflow.set_tracking_uri(url)
    try:
        mlflow.set_experiment("download")
        info = log_registered(
            apply,
            make_params(6 * MiB, 3),
            np.ones((2, 4), np.float32),
            "dl",
            include_package=True,  # a code/ tree to skip
        )
        theirs = Path(download_artifacts("models:/dl/1", dst_path=str(tmp_path / "mlflow")))
        monkeypatch.setenv("JAXEXP_TRANSFER_WORKERS", "3")  # fewer workers than dirs
        listed = []
        list_artifacts = HttpArtifactRepository.list_artifacts

        def counting(self, path=None):
            listed.append(path)
            return list_artifacts(self, path)

        monkeypatch.setattr(HttpArtifactRepository, "list_artifacts", counting)
        ours = download_model("models:/dl/1", str(tmp_path / "ours"), skip=("code/jaxexp_mlflow",))
        monkeypatch.setattr(HttpArtifactRepository, "list_artifacts", list_artifacts)
        assert ours.ours
        # the params manifest named the files of the array directories: none was listed
        assert any(p and p.split("/")[-1] == "params" for p in listed), listed
        assert not any(p and "params/" in p for p in listed), listed
        mine, want = _files(Path(ours.path)), _files(theirs)
        skipped = {k for k in want if k.startswith("code/jaxexp_mlflow/")}
        assert skipped and len(mine) > 20  # params arrays, each in its own directory
        assert mine == {k: v for k, v in want.items() if k not in skipped}
        # the big files were checksummed as they landed: the manifest's CRC-32C values
        manifest = json.loads(mine["params/jaxexp_manifest.json"])["files"]
        big = {k for k, v in mine.items() if len(v) >= transfer.CHECKSUM_MIN_BYTES}
        assert big and set(ours.crc32c) == big
        for rel, value in ours.crc32c.items():
            assert int(manifest[rel.removeprefix("params/")]["crc32c"], 16) == value, rel

        # a chunk file in the server's store turned into a dangling link: a typed error
        (chunk,) = [p for p in artifacts.rglob("w1/0.0") if info.model_id in str(p)]
        chunk.unlink()
        chunk.symlink_to(tmp_path / "nowhere")
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        with pytest.raises(MlflowException):
            download_model("models:/dl/1", str(tmp_path / "cut"))
    finally:
        mlflow.set_tracking_uri(None)


def test_early_upload_sends_the_checkpoint_and_its_manifest_last(server, tmp_path):
    """``EarlyUpload.send_tree`` of a finished checkpoint: every file goes up under its name,
    byte for byte, the manifest only by ``finish`` (last); the store's copy restores."""
    from mlflow.artifacts import download_artifacts

    from jaxexp_mlflow.params import restore_params
    from jaxexp_mlflow.params.manifest import MANIFEST_FILE
    from jaxexp_mlflow.store.upload import EarlyUpload

    mlflow.set_tracking_uri(server)
    try:
        mlflow.set_experiment("early")
        with mlflow.start_run():
            uri = mlflow.get_artifact_uri("early")
        early = EarlyUpload(uri, "params")
        assert early.enabled
        params = make_params(8 * MiB, 4)
        ck = tmp_path / "ck"
        try:
            save_params(params, ck, durable=False)
            early.send_tree(ck, "params")
            assert early.manifest == ck / MANIFEST_FILE  # held back until finish()
            early.finish(ck)
        finally:
            early.close()
        files = _files(ck)
        assert early.skipped("params") == set(files)
        got = Path(download_artifacts(f"{uri}/params", dst_path=str(tmp_path / "dl")))
        assert _files(got) == files
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
        back = restore_params(got, target=target)
        for k in params:
            np.testing.assert_array_equal(back[k], params[k])
    finally:
        mlflow.set_tracking_uri(None)


def _files(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


@pytest.mark.parametrize("early", ["1", "0"])
def test_log_through_the_server_stores_what_a_local_save_writes(
    early, server, tmp_path, monkeypatch
):
    """``log_model`` sends code/, the params checkpoint and the top-level files ahead of
    ``Model.log`` (``EarlyUpload``; with ``JAXEXP_EARLY_UPLOAD=0`` after the save): the store
    ends up with exactly the files a local ``save_model`` of the same model writes, code/, the
    export and the arrays' chunk files byte for byte; a log that fails after they went up takes
    them back."""
    from mlflow.artifacts import download_artifacts

    from jaxexp_mlflow.flavors import readback

    monkeypatch.setenv("JAXEXP_EARLY_UPLOAD", early)

    params = make_params(4 * MiB, 2)
    x = np.ones((2, 4), np.float32)
    blob = jax.export.export(jax.jit(apply))(
        jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params),
        jax.ShapeDtypeStruct(x.shape, x.dtype),
    ).serialize()
    # include_package=True: code/ goes up early too
    mlflow.jaxexp.save_model(
        blob, tmp_path / "local", params=params, input_example=x, include_package=True
    )
    mlflow.set_tracking_uri(server)
    try:
        mlflow.set_experiment(f"same-files-{early}")
        with mlflow.start_run():
            info = mlflow.jaxexp.log_model(
                blob, name="m", params=params, input_example=x, include_package=True
            )
        got = _files(Path(download_artifacts(info.model_uri, dst_path=str(tmp_path / "dl"))))
        got.pop("registered_model_meta", None)  # added by MLflow's download of models:/
        want = _files(tmp_path / "local")
        assert got.keys() == want.keys()
        assert len([k for k in got if k.startswith("code/")]) > 20
        chunks = {rel for rel in want if re.fullmatch(r"params/w1?/0\.0", rel)}
        assert len(chunks) == 2
        for rel in want:
            if rel.startswith("code/") or rel == "exported.bin" or rel in chunks:
                assert got[rel] == want[rel], rel
        model = mlflow.jaxexp.load_model(info.model_uri)  # checks every file against the manifest
        np.testing.assert_array_equal(model(x), apply(params, x))

        client = mlflow.MlflowClient()
        exp = client.get_experiment_by_name(f"same-files-{early}")
        seen: list[str] = []  # params files in the store while the read-back runs

        def broken(*args, **kwargs):
            if early == "1":  # the early upload sends params/ before the read-back: wait for it
                (cut,) = [
                    m for m in client.search_logged_models([exp.experiment_id]) if m.name == "cut"
                ]
                for _ in range(600):
                    seen[:] = [
                        i.path for i in client.list_logged_model_artifacts(cut.model_id, "params")
                    ]
                    if seen:
                        break
                    time.sleep(0.1)
            raise RuntimeError("read back failed")

        monkeypatch.setattr(readback, "read_back", broken)
        with mlflow.start_run(), pytest.raises(RuntimeError, match="read back failed"):
            mlflow.jaxexp.log_model(blob, name="cut", params=params, input_example=x)
        (cut,) = [m for m in client.search_logged_models([exp.experiment_id]) if m.name == "cut"]
        assert bool(seen) == (early == "1")
        assert client.list_logged_model_artifacts(cut.model_id) == []  # taken back
    finally:
        mlflow.set_tracking_uri(None)


def test_flax_nnx_and_equinox_models_through_the_server_load(server, monkeypatch):
    """Real model families through the server, their params bound by the read-back: a Flax
    NNX model with RNG state (a typed key among its params) and an Equinox MLP, each with
    2 MiB kernels; both load from ``models:/`` and reproduce their outputs, and the key comes
    back as a key."""
    eqx = pytest.importorskip("equinox")
    nnx = pytest.importorskip("flax.nnx")

    monkeypatch.setenv("JAXEXP_READBACK_RESTORE_MAX_BYTES", str(MiB))
    x = np.random.default_rng(0).standard_normal((2, 512)).astype(np.float32)

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(512, 1024, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.l2 = nnx.Linear(1024, 4, rngs=rngs)

        def __call__(self, x):
            return self.l2(self.drop(jax.nn.relu(self.l1(x)), deterministic=True))

    net = Net(nnx.Rngs(0, dropout=1))
    graphdef, state = nnx.split(net)
    mlp = eqx.nn.MLP(512, 2, 1024, 2, key=jax.random.key(0))
    weights, static = eqx.partition(mlp, eqx.is_array)
    mlflow.set_tracking_uri(server)
    try:
        mlflow.set_experiment("families-through-the-server")
        with mlflow.start_run():
            nnx_info = mlflow.jaxexp.log_model(
                jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)),
                name="nnx",
                params=state,
                input_example=x,
            )
            eqx_info = mlflow.jaxexp.log_model(
                jax.jit(lambda p, x: jax.vmap(eqx.combine(p, static))(x)),
                name="eqx",
                params=weights,
                input_example=x,
            )
        loaded = mlflow.jaxexp.load_model(nnx_info.model_uri)
        np.testing.assert_allclose(loaded(x), net(x), rtol=1e-5, atol=1e-6)
        key = loaded.params["drop.rngs.key"]
        assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
        want = jax.random.key_data(state["drop"]["rngs"]["key"][...])
        np.testing.assert_array_equal(jax.random.key_data(key), want)
        loaded = mlflow.jaxexp.load_model(eqx_info.model_uri)
        np.testing.assert_allclose(loaded(x), jax.vmap(mlp)(x), rtol=1e-5, atol=1e-6)
    finally:
        mlflow.set_tracking_uri(None)
