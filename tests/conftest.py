"""Shared fixtures: a real MLflow tracking store (sqlite) per test, the shared corpus."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.servers import free_port  # noqa: F401 - the tests' one helper for ports

REPO = Path(__file__).resolve().parents[1]
CORPUS = Path(os.environ.get("JAXEXP_CORPUS", REPO.parent / "shared" / "corpus"))


def corpus_cases(version: str | None = None) -> list[Path]:
    """Corpus case directories (``jax-<V>/<case>``), optionally of one jax version."""
    if not CORPUS.is_dir():
        return []
    pattern = f"jax-{version}/*" if version else "jax-*/*"
    return sorted(p for p in CORPUS.glob(pattern) if (p / "exported.bin").is_file())


def case_id(path: Path) -> str:
    return f"{path.parent.name}/{path.name}"


def _vkey(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split(".")[:3] if x.isdigit())


def jax_refuses_expired() -> bool:
    """Whether the installed jax is one that refuses expired blobs (jax >= 0.11.1)."""
    import jax

    return _vkey(jax.__version__) >= (0, 11, 1)


def corpus_refusals(case: Path, *, expired_flag: bool = False) -> set[str]:
    """Why the installed jax refuses to deserialize a corpus blob, as verdict codes (empty: it
    reads it).

    Measured with jax 0.11.0, 0.11.1 and 0.12.0.1, and read from their
    ``jax/_src/export/serialization.py``: from 0.11.1 on, jax refuses every blob of schema < 5
    (all of jax 0.4.35's and 0.6.2's) unless ``jax_export_deserialize_expired_versions`` is set
    (``expired``), and every blob carrying an old-style HLO sharding (``sharded4`` of 0.4.35,
    0.6.2 and 0.8.3) whatever the flag (``hlo_sharding``).
    """
    if not jax_refuses_expired():
        return set()
    version = case.parent.name.removeprefix("jax-")
    codes = set()
    if case.name == "sharded4" and version in ("0.4.35", "0.6.2", "0.8.3"):
        codes.add("hlo_sharding")
    if version in ("0.4.35", "0.6.2") and not expired_flag:
        codes.add("expired")
    return codes


@pytest.fixture
def expired_flag():
    """jax's ``jax_export_deserialize_expired_versions`` set for one test; yields whether this
    jax has the flag (jax >= 0.11.1, which refuses schema < 5 blobs without it)."""
    import jax

    name = "jax_export_deserialize_expired_versions"
    if not hasattr(jax.config, name):
        yield False
        return
    before = getattr(jax.config, name)
    jax.config.update(name, True)
    try:
        yield True
    finally:
        jax.config.update(name, before)


def load_case(path: Path) -> tuple[dict, list[np.ndarray], list[np.ndarray]]:
    """meta.json, flat inputs and flat outputs of a corpus case, with real dtypes restored."""
    from jaxexp_mlflow.codec.arrays import resolve_dtype

    meta = json.loads((path / "meta.json").read_text())

    def read(file: str, specs: list[dict]) -> list[np.ndarray]:
        with np.load(path / file, allow_pickle=False) as data:
            out = []
            for spec in specs:
                arr = data[spec["name"]]
                want = resolve_dtype(spec["dtype"])
                out.append(arr.view(want) if arr.dtype != want else arr)
            return out

    return meta, read("inputs.npz", meta["inputs"]), read("outputs.npz", meta["outputs"])


def run_on_devices(code: str, n_devices: int, *args: str) -> dict:
    """Run ``code`` in a fresh interpreter that sees ``n_devices`` CPU devices (XLA_FLAGS) and
    return the JSON of its last ``RESULT <json>`` line."""
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={n_devices}",
        "PYTHONPATH": str(REPO),
    }
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=600,
    )
    return result_of(proc)


def result_of(proc: subprocess.CompletedProcess) -> dict:
    """The JSON of a finished child's last ``RESULT <json>`` line (asserting it succeeded)."""
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def llm_example() -> Any:
    """examples/llm.py as a module (examples/ is no package), loaded once per process."""
    import importlib.util

    name = "llm_example"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "examples" / "llm.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(autouse=True, scope="session")
def _compilation_cache_in_tmp(tmp_path_factory):
    """Keep JAX's persistent compilation cache (on by default at load) out of the user's home."""
    os.environ.setdefault("JAXEXP_COMPILATION_CACHE", str(tmp_path_factory.mktemp("xla-cache")))
    # one IREE .vmfb cache for the whole session (and the subprocesses the tests start)
    os.environ.setdefault("JAXEXP_IREE_CACHE", str(tmp_path_factory.mktemp("iree-cache")))
    # the per-user secret that signs stored executables (runtime/cache_auth.py), not the user's
    os.environ["XDG_CONFIG_HOME"] = str(tmp_path_factory.mktemp("config"))


@pytest.fixture(autouse=True)
def _no_leaked_cli_environment(monkeypatch):
    """The jaxexp CLI turns MLflow's progress bars off in its own environment when stderr is no
    terminal; run in-process (CliRunner) that would leak into later tests' child processes."""
    monkeypatch.delenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", raising=False)


#: Where the test run keeps its empty, migrated MLflow sqlite store (set by a session fixture).
_DB_TEMPLATE_DIR: list[Path] = []


@pytest.fixture(autouse=True, scope="session")
def _mlflow_db_template_dir(tmp_path_factory):
    """A directory for the session's empty MLflow store, made on first use by :func:`sqlite_uri`."""
    _DB_TEMPLATE_DIR.append(tmp_path_factory.mktemp("mlflow-db-template"))
    yield
    _DB_TEMPLATE_DIR.clear()


def sqlite_uri(db: Path) -> str:
    """``sqlite:///<db>`` for a new MLflow store whose file already holds MLflow's schema: a copy
    of one empty store made once per session. A new sqlite file otherwise runs all of MLflow's
    migrations when first opened, seconds each time, in every test that makes a store.

    The copy holds no experiment: whatever opens it first (this process, a child, an
    ``mlflow server``) makes the Default experiment with its own artifact root, as it does in a
    new file."""
    import shutil
    import sqlite3

    if _DB_TEMPLATE_DIR and not db.exists():
        template = _DB_TEMPLATE_DIR[0] / "empty.db"
        if not template.exists():
            import mlflow

            made = template.with_name("making.db")
            mlflow.MlflowClient(tracking_uri=f"sqlite:///{made}").search_experiments()
            with contextlib.closing(sqlite3.connect(made)) as con, con:
                con.execute("DELETE FROM experiment_tags")
                con.execute("DELETE FROM experiments")
            shutil.copyfile(made, template)
        shutil.copyfile(template, db)
    return f"sqlite:///{db}"


@contextlib.contextmanager
def sqlite_store(root: Path, experiment: str = "tests", artifacts: str = "artifacts"):
    """A real sqlite-backed MLflow store in ``root`` (artifacts under ``root / artifacts``), made
    this process' tracking URI and active experiment (also through the environment, for the child
    processes a test starts) until the block ends. Yields ``(uri, experiment_id)``."""
    import mlflow

    uri = sqlite_uri(root / "mlflow.db")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mlflow.set_tracking_uri(uri)
        exp_id = mlflow.create_experiment(experiment, artifact_location=(root / artifacts).as_uri())
    with active_store(uri, exp_id):
        yield uri, exp_id


@contextlib.contextmanager
def active_store(uri: str, experiment_id: str):
    """Make an existing store and experiment this process' tracking URI and active experiment
    (also through the environment, for the child processes a test starts) until the block ends.
    """
    import mlflow

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mlflow.set_tracking_uri(uri)
        mp.setenv("MLFLOW_EXPERIMENT_ID", experiment_id)  # set_experiment sets it; undone
        mlflow.set_experiment(experiment_id=experiment_id)
        try:
            yield
        finally:
            mlflow.end_run()
            mlflow.set_tracking_uri(None)


@pytest.fixture(scope="session")
def tracking_server(tmp_path_factory):
    """One real ``mlflow server`` (sqlite backend, artifacts proxied into its own directory) for
    the session's modules that log to and load from a server as a user would; yields
    ``(url, artifacts_dir)``. Each module keeps to its own experiments and registered names; a
    test that kills or reconfigures a server starts its own (tests/servers.py)."""
    from tests.servers import mlflow_server

    root = tmp_path_factory.mktemp("tracking-server")
    with mlflow_server(root, backend=sqlite_uri(root / "db.sqlite")) as (url, _):
        yield url, root / "artifacts"


@pytest.fixture(scope="session")
def registered_mlp(tmp_path_factory) -> dict[str, Any]:
    """The tests' MLP logged once per session into a real sqlite store with file artifacts,
    registered as ``mlp`` with the alias ``best``. Read-only: a module that reads it makes it its
    store with ``active_store(d["uri"], d["experiment_id"])``; a test that alters the model
    copies ``d["local"]`` first. Keys: ``uri``, ``experiment_id``, ``root``, ``store`` (the
    artifact root), ``run_id``, ``model_id``, ``runs_uri``, ``models_uri``, ``local`` (a
    download), ``x``, ``want`` (the MLP's answer for ``x``), ``params``."""
    import mlflow

    import jaxexp_mlflow  # noqa: F401 - installs mlflow.jaxexp
    from tests.models import batch, export_mlp, mlp_apply, mlp_params

    root = tmp_path_factory.mktemp("registered")
    with sqlite_store(root, "registered", "art") as (uri, exp_id):
        params, x = mlp_params(), batch()
        with mlflow.start_run() as run:
            info = mlflow.jaxexp.log_model(
                export_mlp(params),
                name="model",
                params=params,
                input_example=x,
                registered_model_name="mlp",
            )
        client = mlflow.MlflowClient()
        client.set_registered_model_alias("mlp", "best", info.registered_model_version)
        runs_uri = f"runs:/{run.info.run_id}/model"
        local = Path(mlflow.artifacts.download_artifacts(runs_uri))
    return {
        "uri": uri,
        "experiment_id": exp_id,
        "root": root,
        "store": str(root / "art"),
        "run_id": run.info.run_id,
        "model_id": info.model_id,
        "runs_uri": runs_uri,
        "models_uri": f"models:/mlp/{info.registered_model_version}",
        "local": local,
        "x": x,
        "want": np.asarray(mlp_apply(params, x)),
        "params": params,
    }


@pytest.fixture
def tracking_uri(tmp_path):
    """A fresh sqlite-backed MLflow store with artifacts under tmp_path."""
    with sqlite_store(tmp_path) as (uri, _):
        yield uri


@pytest.fixture
def expired_flag_off(monkeypatch):
    """JAX's expired-versions flag off, and its environment variable unset, for the test: as a
    user who did not set it has it (``pytestmark = pytest.mark.usefixtures(...)``)."""
    import jax

    from jaxexp_mlflow.runtime import compat

    monkeypatch.delenv(compat.EXPIRED_ENV, raising=False)
    if not hasattr(jax.config, compat.EXPIRED_FLAG):
        yield
        return
    before = getattr(jax.config, compat.EXPIRED_FLAG)
    jax.config.update(compat.EXPIRED_FLAG, False)
    try:
        yield
    finally:
        jax.config.update(compat.EXPIRED_FLAG, before)


@pytest.fixture
def without_expired_flag():
    """A context manager that unsets jax's ``jax_export_deserialize_expired_versions`` for its
    block (inside a test that set it with ``expired_flag``): what a user without the flag sees."""
    import contextlib

    import jax

    name = "jax_export_deserialize_expired_versions"

    @contextlib.contextmanager
    def unset():
        if not hasattr(jax.config, name):
            yield
            return
        before = getattr(jax.config, name)
        jax.config.update(name, False)
        try:
            yield
        finally:
            jax.config.update(name, before)

    return unset


def as_logged_by_older_jax(model_dir: Path, blob: Path) -> None:
    """Make ``model_dir`` (a saved bare-blob model of the same function) hold ``blob`` instead,
    as an older jax that could still read it would have saved it: the blob file, its checksum
    and the format facts MLmodel records of it. For blobs the installed jax cannot read at all
    (old-style HLO shardings under jax >= 0.11.1), so cannot save."""
    import hashlib

    import yaml

    from jaxexp_mlflow.codec.reader import read_blob_file

    data = blob.read_bytes()
    desc = read_blob_file(blob)
    mlmodel = yaml.safe_load((model_dir / "MLmodel").read_text())
    conf = mlmodel["flavors"]["jaxexp"]
    (model_dir / conf.get("exported_file", "exported.bin")).write_bytes(data)
    conf.update(
        exported_sha256=hashlib.sha256(data).hexdigest(),
        exported_nbytes=len(data),
        calling_convention_version=int(desc.calling_convention_version),
        serialization_version=int(desc.serialization_version),
        schema_generation=int(desc.schema_generation),
        in_shardings=[None if s is None else str(s) for s in desc.in_shardings],
        out_shardings=[None if s is None else str(s) for s in desc.out_shardings],
    )
    (model_dir / "MLmodel").write_text(yaml.safe_dump(mlmodel))


@pytest.fixture(scope="session")
def mlp_dir(tmp_path_factory):
    """``(path, params)``: the tests' MLP (``tests.models``) saved once per session with
    ``mlflow.jaxexp.save_model``, a 2-row input example; never altered (a test that alters it
    copies it first). ``test_iree.py`` has one of its own."""
    import mlflow

    import jaxexp_mlflow  # noqa: F401 - installs mlflow.jaxexp
    from tests.models import batch, export_mlp, mlp_params

    path = tmp_path_factory.mktemp("m") / "mlp"
    params = mlp_params()
    mlflow.jaxexp.save_model(export_mlp(params), path, params=params, input_example=batch(2))
    return path, params


@pytest.fixture(scope="session")
def saved_mlp(tmp_path_factory) -> Path:
    """The tests' MLP (``tests.models``) saved once per session with a 5-row input example;
    never altered (a test that alters a model takes :func:`mlp_copy`)."""
    import mlflow

    import jaxexp_mlflow  # noqa: F401 - installs mlflow.jaxexp
    from tests.models import batch, export_mlp, mlp_params

    path = tmp_path_factory.mktemp("saved-mlp") / "model"
    params = mlp_params()
    mlflow.jaxexp.save_model(export_mlp(params), path, params=params, input_example=batch())
    return path


@pytest.fixture
def mlp_copy(saved_mlp, tmp_path) -> Path:
    """A private copy of :func:`saved_mlp` for one test to alter."""
    import shutil

    return Path(shutil.copytree(saved_mlp, tmp_path / "model", symlinks=True))


def reseal_reference(model_dir: Path) -> None:
    """Record the digests of ``model_dir``'s reference files as they are now in its MLmodel:
    a reference rewritten on purpose (one the function does not reproduce) rather than
    damaged, which the digests would report as such."""
    import hashlib

    import yaml

    doc = yaml.safe_load((model_dir / "MLmodel").read_text())
    ref = doc["flavors"]["jaxexp"]["reference"]
    ref["sha256"] = {
        side: hashlib.sha256((model_dir / "reference" / f"{side}.npz").read_bytes()).hexdigest()
        for side in ("inputs", "outputs")
    }
    (model_dir / "MLmodel").write_text(yaml.safe_dump(doc))


def run_cli(*args: str, env: dict | None = None):
    """The ``jaxexp`` command in this process (click's runner); stdout and stderr kept apart."""
    from click.testing import CliRunner

    from jaxexp_mlflow.cli import main

    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


# --- tests/runtime, tests/params: one long-lived child per device count -----------------------

#: The child that runs the scripts given to :func:`device_child`, one after another, each as
#: ``python -c`` would (``__main__``, its own ``sys.argv``, environment and working directory),
#: answering each with one JSON line on the process's original stdout.
_DEVICE_WORKER = r"""
import contextlib, io, json, os, sys, traceback
reply = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # what C code prints lands in stderr, never in the replies
for line in sys.stdin:
    job = json.loads(line)
    out, err, rc = io.StringIO(), io.StringIO(), 0
    os.environ.clear()
    os.environ.update(job["env"])
    os.chdir(job["cwd"])
    sys.argv = ["-c", *job["argv"]]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            exec(compile(job["code"], "<string>", "exec"), {"__name__": "__main__"})
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            traceback.print_exc()
            rc = 1
    if "mlflow" in sys.modules:  # the next script starts with no run and no tracking URI set
        import mlflow
        while mlflow.active_run() is not None:
            mlflow.end_run()
        mlflow.set_tracking_uri(None)
    reply.write(json.dumps({"rc": rc, "out": out.getvalue(), "err": err.getvalue()}) + "\n")
    reply.flush()
"""

#: the running children, by what JAX reads as it starts (device count, platforms, ...)
_DEVICE_WORKERS: dict[tuple, subprocess.Popen] = {}


def _startup_key(env: dict[str, str]) -> tuple:
    """What a child reads once, as it starts: children that differ in it are not shared."""
    read_at_start = ("XLA_", "JAX_", "JAXEXP_", "PYTHON", "TF_", "LD_")
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(read_at_start)))


def _close_device_workers() -> None:
    for proc in _DEVICE_WORKERS.values():
        proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    _DEVICE_WORKERS.clear()


def device_child(
    code: str, n_devices: int, *args: str, env: dict[str, str] | None = None, timeout: int = 600
) -> subprocess.CompletedProcess:
    """Run ``code`` as ``python -c code *args`` would, in a child that sees ``n_devices`` CPU
    devices (XLA_FLAGS, read once as jax starts), with ``env`` (default: this process's) as its
    environment and the repository as working directory and import root. One child per device
    count (and start-up environment) serves the whole test session, one script after another:
    each pays no interpreter start and no ``import jax, mlflow``. The result reads as that of
    ``subprocess.run(..., capture_output=True, text=True)``."""
    import atexit
    import select

    env = {
        **(os.environ if env is None else env),
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={n_devices}",
        "PYTHONPATH": str(REPO),
    }
    key = _startup_key(env)
    proc = _DEVICE_WORKERS.get(key)
    if proc is None or proc.poll() is not None:
        if not _DEVICE_WORKERS:
            atexit.register(_close_device_workers)
        import tempfile

        log = tempfile.TemporaryFile()  # what C code prints, for a child that dies
        proc = subprocess.Popen(
            [sys.executable, "-c", _DEVICE_WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            cwd=REPO,
            env=env,
        )
        proc.log = log  # type: ignore[attr-defined]
        _DEVICE_WORKERS[key] = proc
    job = {"code": code, "argv": list(args), "env": env, "cwd": str(REPO)}
    proc.stdin.write(json.dumps(job) + "\n")
    proc.stdin.flush()
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if not line:  # died or hung: the next script gets a new child
        proc.kill()
        rc = proc.wait()
        del _DEVICE_WORKERS[key]
        proc.log.seek(0)
        said = proc.log.read().decode(errors="replace")[-3000:]
        raise AssertionError(
            f"the {n_devices}-device child ended ({rc}) or took over {timeout} s:\n{said}"
        )
    reply = json.loads(line)
    return subprocess.CompletedProcess(proc.args, reply["rc"], reply["out"], reply["err"])


def run_on_device_child(code: str, n_devices: int, *args: str) -> dict:
    """:func:`run_on_devices` in the shared child of that device count (:func:`device_child`)."""
    return result_of(device_child(code, n_devices, *args))
