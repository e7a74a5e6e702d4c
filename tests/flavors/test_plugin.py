"""The MLflow plugin points: JAX run tags only when jax is imported; lazy mlflow.jaxexp.

Each case runs in a fresh interpreter: whether jax is imported is a per-process fact.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap

import jax

from tests.conftest import sqlite_uri

TAGS = {
    "jaxexp.jax_version",
    "jaxexp.jaxlib_version",
    "jaxexp.backend",
    "jaxexp.device_kind",
    "jaxexp.device_count",
}


def run_python(code: str, tmp_path, **env: str) -> dict:
    """Run ``code`` in a fresh interpreter against a fresh sqlite store; its last stdout line
    is JSON."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_EXPERIMENT")}
    full_env["MLFLOW_TRACKING_URI"] = sqlite_uri(tmp_path / "plugin.db")
    full_env.update(env)
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=tmp_path,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_entry_point_is_installed():
    eps = importlib.metadata.entry_points(group="mlflow.run_context_provider")
    assert "jaxexp_mlflow.mlflow_plugin:JaxRunContextProvider" in {ep.value for ep in eps}


def test_runs_are_tagged_when_jax_is_imported(tmp_path):
    out = run_python(
        """
        import json, jax, jaxlib, mlflow
        with mlflow.start_run() as idle:  # jax imported, no backend started yet
            pass
        jax.devices()
        with mlflow.start_run() as run:
            pass
        tags = mlflow.get_run(run.info.run_id).data.tags
        idle_tags = mlflow.get_run(idle.info.run_id).data.tags
        print(json.dumps({"tags": tags, "idle": idle_tags, "jaxlib": jaxlib.__version__}))
        """,
        tmp_path,
        XLA_FLAGS="--xla_force_host_platform_device_count=3",
        JAX_PLATFORMS="cpu",
    )
    tags = out["tags"]
    assert TAGS <= set(tags)
    assert tags["jaxexp.jax_version"] == jax.__version__
    assert tags["jaxexp.jaxlib_version"] == out["jaxlib"]
    assert tags["jaxexp.backend"] == "cpu"
    assert tags["jaxexp.device_kind"] == "cpu"
    assert tags["jaxexp.device_count"] == "3"  # the real count, not a default
    # tagging never starts a backend: before jax.devices() only the versions are known
    idle = {k for k in out["idle"] if k.startswith("jaxexp.")}
    assert idle == {"jaxexp.jax_version", "jaxexp.jaxlib_version"}


def test_mlflow_without_jax_pays_nothing_and_mlflow_jaxexp_loads_lazily(tmp_path):
    out = run_python(
        """
        import json, sys
        import mlflow
        after_import = "jax" in sys.modules
        with mlflow.start_run() as run:
            pass
        tags = mlflow.get_run(run.info.run_id).data.tags
        after_run = "jax" in sys.modules
        has_attr = hasattr(mlflow, "jaxexp")  # the lazy module exists, jax still not imported
        after_attr = "jax" in sys.modules
        flavor_before = "jaxexp_mlflow.flavors.jaxexp" in sys.modules
        import mlflow.jaxexp
        log_model = mlflow.jaxexp.log_model  # first real use loads the flavor module
        print(json.dumps({
            "tags": sorted(t for t in tags if t.startswith("jaxexp.")),
            "jax_after_import": after_import, "jax_after_run": after_run,
            "has_attr": has_attr, "jax_after_attr": after_attr,
            "flavor": mlflow.jaxexp.FLAVOR_NAME, "log_model": callable(log_model),
            "flavor_before": flavor_before,
            "flavor_after": "jaxexp_mlflow.flavors.jaxexp" in sys.modules,
        }))
        """,
        tmp_path,
    )
    assert out["tags"] == []
    assert out["jax_after_import"] is False and out["jax_after_run"] is False
    assert out["has_attr"] is True and out["jax_after_attr"] is False
    assert out["flavor"] == "jaxexp" and out["log_model"] is True
    assert out["flavor_before"] is False and out["flavor_after"] is True
