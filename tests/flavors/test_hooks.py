"""The training-loop hook: metrics, periodic/best model logs, alias, process 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import mlflow
import numpy as np
import optax
import pytest
import yaml
from click.testing import CliRunner

import jaxexp_mlflow  # noqa: F401  (mlflow.jaxexp)
from jaxexp_mlflow.hooks import TrainingHook
from tests.conftest import free_port, sqlite_uri

REPO = Path(__file__).resolve().parents[2]


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ for a child process, without the experiment id mlflow.set_experiment leaves."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME")
    }
    return {**env, **extra}


def apply(params, x):
    return jnp.tanh(x @ params["w"] + params["b"])


def _train(hook, steps, val_losses):
    """A real optax loop; the monitored metric follows ``val_losses`` (step -> value)."""
    key = jax.random.key(0)
    x = jax.random.normal(key, (64, 3))
    y = jnp.tanh(x @ jnp.array([[1.0, -1.0], [0.5, 0.2], [-0.3, 0.8]]))
    params = {"w": jnp.zeros((3, 2)), "b": jnp.zeros((2,))}
    opt = optax.sgd(0.1)
    state = opt.init(params)

    @jax.jit
    def step_fn(params, state):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((apply(p, x) - y) ** 2))(params)
        updates, state = opt.update(grads, state)
        return optax.apply_updates(params, updates), state, loss

    snapshots = {}
    for step in range(steps):
        params, state, loss = step_fn(params, state)
        metrics = {"loss": loss}
        if step in val_losses:
            metrics["val_loss"] = val_losses[step]
        snapshots[step] = jax.tree.map(np.asarray, params)
        hook(step, params, metrics)
    return snapshots


def _mlmodel(uri: str) -> dict:
    return yaml.safe_load((Path(mlflow.artifacts.download_artifacts(uri)) / "MLmodel").read_text())


def test_hook_logs_every_n_and_on_improvement_and_moves_best(tracking_uri, tmp_path):
    x = np.ones((4, 3), np.float32) * np.arange(4, dtype=np.float32)[:, None]
    hook = TrainingHook(
        apply,
        x,
        log_every=5,
        monitor="val_loss",
        registered_model_name="hooked",
        checkpoint_dir=tmp_path / "ckpt",
        max_to_keep=2,
    )
    with mlflow.start_run() as run, hook:
        snapshots = _train(hook, 12, {0: 5.0, 3: 3.0, 6: 4.0, 9: 2.0})
    # schedule: improvements at 0, 3, 9 (not 6); every 5 steps at 5 and 10. Improvements are
    # logged at most once per 5 steps: 3 and 9 wait in a checkpoint until 5 and 10.
    assert [(e.step, e.reasons) for e in hook.logged] == [
        (0, ("improved",)),
        (3, ("improved",)),
        (5, ("every_n",)),
        (9, ("improved",)),
        (10, ("every_n",)),
    ]
    assert hook.best == 2.0 and hook.best_step == 9
    client = mlflow.MlflowClient()
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 12
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_loss")] == [0, 3, 6, 9]
    # only the models logged on improvement are registered; @best is the one of step 9
    versions = [e.model_info.registered_model_version for e in hook.logged]
    assert versions == ["1", "2", None, "3", None] or versions == [1, 2, None, 3, None]
    assert str(client.get_model_version_by_alias("hooked", "best").version) == "3"
    assert hook.best_model_info.model_id == hook.logged[3].model_info.model_id
    probe = np.linspace(-1, 1, 15, dtype=np.float32).reshape(5, 3)
    best = mlflow.jaxexp.load_model("models:/hooked@best")
    np.testing.assert_allclose(best(probe), apply(snapshots[9], probe), rtol=1e-6, atol=1e-6)
    early = mlflow.jaxexp.load_model(hook.logged[1].model_info.model_uri)  # the step-3 params
    np.testing.assert_allclose(early(probe), apply(snapshots[3], probe), rtol=1e-6, atol=1e-6)
    last = mlflow.jaxexp.load_model(hook.logged[-1].model_info.model_uri)
    np.testing.assert_allclose(last(probe), apply(snapshots[10], probe), rtol=1e-6, atol=1e-6)
    # one export for all logs: every model stores the same blob
    confs = [_mlmodel(e.model_info.model_uri)["flavors"]["jaxexp"] for e in hook.logged]
    assert len({c["exported_sha256"] for c in confs}) == 1
    assert confs[0]["jax_version"] == jax.__version__  # exported here, not logged as bytes
    # params went through the CheckpointManager: the model holds that step's files, unchanged
    ckpt_item = tmp_path / "ckpt" / "10" / "default"
    model_dir = Path(mlflow.artifacts.download_artifacts(hook.logged[-1].model_info.model_uri))

    def chunks(root: Path) -> list[bytes]:  # array data files (zarr chunks, OCDBT data)
        from jaxexp_mlflow.codec.zarr import is_chunk_file

        files = [p for p in root.rglob("*") if p.is_file()]
        data = [p for p in files if is_chunk_file(p.relative_to(root).as_posix())]
        return sorted(p.read_bytes() for p in data)

    assert chunks(ckpt_item) and chunks(model_dir / "params") == chunks(ckpt_item)
    assert sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == [
        9,
        10,
    ]
    # tags say why the model was logged; the reference result reproduces
    logged = mlflow.get_logged_model(hook.logged[3].model_info.model_id)
    assert logged.tags["jaxexp.step"] == "9" and logged.tags["jaxexp.reason"] == "improved"
    from jaxexp_mlflow.cli import main

    result = CliRunner().invoke(main, ["verify", "models:/hooked@best"])
    assert result.exit_code == 0, result.output


def test_improving_every_step_logs_once_per_log_every_and_best_ends_on_the_best(
    tracking_uri, tmp_path
):
    x = np.ones((4, 3), np.float32)
    hook = TrainingHook(apply, x, log_every=10, monitor="val_loss", registered_model_name="steady")
    with mlflow.start_run(), hook:
        snapshots = _train(hook, 30, {s: 30.0 - s for s in range(30)})  # improves every step
    # 30 improvements: logged at 0, then with the every-10 logs, and the last one on close
    assert [(e.step, e.reasons) for e in hook.logged] == [
        (0, ("improved",)),
        (10, ("every_n", "improved")),
        (20, ("every_n", "improved")),
        (29, ("improved",)),
    ]
    client = mlflow.MlflowClient()
    assert len(client.search_model_versions("name='steady'")) == 4
    best = client.get_model_version_by_alias("steady", "best")
    assert str(best.version) == str(hook.logged[-1].model_info.registered_model_version)
    probe = np.eye(3, dtype=np.float32)
    model = mlflow.jaxexp.load_model("models:/steady@best")
    np.testing.assert_allclose(model(probe), apply(snapshots[29], probe), rtol=1e-6, atol=1e-6)


def test_hook_reuses_the_users_checkpoint_manager(tracking_uri, tmp_path, caplog):
    import logging

    import orbax.checkpoint as ocp

    caplog.set_level(logging.WARNING, logger="absl")

    params = {"w": np.full((3, 2), 0.5, np.float32), "b": np.ones((2,), np.float32)}
    manager = ocp.CheckpointManager(tmp_path / "user-ckpt")
    manager.save(4, args=ocp.args.StandardSave(params))
    manager.wait_until_finished()
    meta = tmp_path / "user-ckpt" / "4" / "default" / "_METADATA"
    before = meta.stat().st_mtime_ns
    hook = TrainingHook(apply, np.ones((2, 3), np.float32), log_every=4, checkpoint_manager=manager)
    with mlflow.start_run(), hook:
        for step in range(5):
            info = hook(step, params, {"loss": 1.0})
    assert info is not None and [e.step for e in hook.logged] == [4]
    assert manager.all_steps() == [4]
    assert meta.stat().st_mtime_ns == before  # reused, not written again
    model = mlflow.jaxexp.load_model(info.model_uri)
    x = np.eye(3, dtype=np.float32)
    np.testing.assert_allclose(model(x), apply(params, x), rtol=1e-6)
    manager.close()
    # a CheckpointManager step keeps _CHECKPOINT_METADATA beside its items: reading an item's
    # tree does not warn for it (it did, once per item and log)
    assert not [r for r in caplog.records if "Metadata file does not exist" in r.getMessage()]


def test_hook_starts_and_ends_its_own_run(tracking_uri):
    hook = TrainingHook(apply, np.ones((2, 3), np.float32), monitor="acc", mode="max")
    params = {"w": np.zeros((3, 2), np.float32), "b": np.zeros((2,), np.float32)}
    with hook:
        assert hook(0, params, {"acc": 0.5}) is not None
        assert hook(1, params, {"acc": 0.4}) is None  # worse for mode="max"
        assert mlflow.active_run() is not None
    assert mlflow.active_run() is None
    run = mlflow.get_run(hook.run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["acc"] == 0.4


def test_a_failing_loop_fails_the_hooks_own_run_and_keeps_its_best(tracking_uri):
    """An error inside ``with hook:`` ends the run the hook started as FAILED (as
    ``mlflow.start_run`` ends its own), and the improvement still pending is logged: the best
    model seen before the failure is not lost."""
    hook = TrainingHook(apply, np.ones((2, 3), np.float32), monitor="acc", mode="max", log_every=5)
    params = {"w": np.zeros((3, 2), np.float32), "b": np.zeros((2,), np.float32)}
    with pytest.raises(RuntimeError, match="diverged"), hook:
        hook(0, params, {"acc": 0.5})
        hook(1, params, {"acc": 0.7})  # an improvement held back by log_every
        raise RuntimeError("diverged")
    assert mlflow.active_run() is None
    assert mlflow.get_run(hook.run_id).info.status == "FAILED"
    assert hook.best_model_info is not None and "improved" in hook.logged[-1].reasons
    assert len(hook.logged) == 2


def test_hook_refuses_a_schedule_that_never_logs():
    with pytest.raises(ValueError, match="never log"):
        TrainingHook(apply, np.ones((2, 3)))
    with pytest.raises(ValueError, match="mode"):
        TrainingHook(apply, np.ones((2, 3)), monitor="loss", mode="lowest")


WORKER = textwrap.dedent(
    """
    import json, sys
    import jax
    jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
    import numpy as np
    from jaxexp_mlflow.hooks import TrainingHook

    def apply(p, x):
        return x @ p["w"]

    params = {"w": np.ones((3, 2), np.float32)}
    hook = TrainingHook(apply, np.ones((4, 3), np.float32), log_every=2,
                        checkpoint_dir=sys.argv[3], registered_model_name="mp")
    with hook:
        for step in range(5):
            params = {"w": params["w"] + 1}
            hook(step, params, {"loss": float(step)})
    print(json.dumps({"process": jax.process_index(), "run_id": hook._run_id,
                      "logged": [[e.step, e.model_info is not None] for e in hook.logged]}))
    """
)


def test_only_process_0_logs_in_a_multi_process_job(tmp_path):
    port = free_port()
    env = clean_env(MLFLOW_TRACKING_URI=sqlite_uri(tmp_path / "mp.db"), JAX_PLATFORMS="cpu")
    args = [f"localhost:{port}", None, str(tmp_path / "ckpt")]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, args[0], str(i), args[2]],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp_path,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
    reports = {r["process"]: r for r in (json.loads(o.strip().splitlines()[-1]) for o, _ in outs)}
    assert reports[0]["logged"] == [[2, True], [4, True]]
    assert reports[1]["logged"] == [[2, False], [4, False]]  # checkpointed, not logged
    assert reports[1]["run_id"] is None
    mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
    try:
        runs = mlflow.search_runs(search_all_experiments=True)
        assert list(runs.run_id) == [reports[0]["run_id"]]
        versions = mlflow.MlflowClient().search_model_versions("name='mp'")
        assert sorted(int(v.version) for v in versions) == [1, 2]
    finally:
        mlflow.set_tracking_uri(None)


def test_example_train_with_hook(tmp_path):
    env = clean_env()
    env.pop("MLFLOW_TRACKING_URI", None)
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / "train_with_hook.py"),
            "--steps",
            "41",
            "--eval-every",
            "10",
            "--log-every",
            "20",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "-> MATCH" in result.stdout
    assert (tmp_path / "mlruns.db").is_file()  # the local sqlite store under the working dir
