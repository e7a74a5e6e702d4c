"""CPU computations on the calling thread in a scoring server (``runtime/dispatch.py``).

Each case is a fresh process: the flag is read once, when jax makes its CPU client, so it can
only be set before the process imports jax.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import result_of
from tests.models import batch, mlp_apply

CHILD = r"""
import json, sys
import numpy as np
first, server = sys.argv[2], sys.argv[3] == "server"
if first == "jax":  # the application imported jax itself before loading the model
    import jax
if server:  # what `jaxexp serve` imports before it loads the model
    import jaxexp_mlflow.serving.server  # noqa: F401
import mlflow.pyfunc
model = mlflow.pyfunc.load_model(sys.argv[1])
x = np.load(sys.argv[4])
y = model.predict(x)
import jax
from jaxexp_mlflow.runtime.dispatch import inline_now
print("RESULT " + json.dumps({
    "async": jax.config.values["jax_cpu_enable_async_dispatch"],
    "inline_now": inline_now(),
    "y": np.asarray(y).tolist(),
}), flush=True)
import os
os._exit(0)  # skip waiting for the bucket a server may still be compiling (background.py)
"""


def child(model_dir, x_file, first: str, role: str, **env: str) -> dict:
    run_env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXEXP_LITE": "0"}
    run_env.pop("JAXEXP_CPU_INLINE", None)
    run_env.update(env)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(model_dir), first, role, str(x_file)],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return result_of(proc)


@pytest.fixture(scope="module")
def x_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("x") / "x.npy"
    np.save(path, batch(3))
    return path


@pytest.mark.parametrize(
    ("first", "role", "env", "inline"),
    [
        ("mlflow", "server", {}, True),  # a scoring server that loads jax: inline
        ("mlflow", "server", {"JAXEXP_CPU_INLINE": "0"}, False),  # turned off
        ("mlflow", "script", {}, False),  # not a server: jax's default
        ("mlflow", "script", {"JAXEXP_CPU_INLINE": "1"}, True),  # asked for
        ("jax", "server", {}, False),  # the process imported jax first: its own
        ("jax", "script", {"JAXEXP_CPU_INLINE": "1"}, False),  # too late to ask
    ],
)
def test_server_runs_cpu_inline(mlp_dir, x_file, first, role, env, inline):
    path, params = mlp_dir
    got = child(path, x_file, first, role, **env)
    assert got["async"] is (not inline) and got["inline_now"] is inline
    # the same answers either way
    want = np.asarray(mlp_apply(params, batch(3)))
    np.testing.assert_allclose(np.asarray(got["y"]), want, rtol=1e-6, atol=1e-6)


def test_a_bad_setting_says_what_it_expected(monkeypatch):
    from jaxexp_mlflow.runtime import dispatch

    monkeypatch.setenv(dispatch.ENV_CPU_INLINE, "sometimes")
    with pytest.raises(ValueError, match="expected 1 or 0"):
        dispatch.inline_cpu_dispatch(serving=True)


def test_a_process_with_jax_is_left_alone(monkeypatch):
    """This process imported jax: nothing is set, whatever is asked."""
    import jax

    from jaxexp_mlflow.runtime import dispatch

    monkeypatch.setenv(dispatch.ENV_CPU_INLINE, "1")
    before = jax.config.values["jax_cpu_enable_async_dispatch"]
    assert dispatch.inline_cpu_dispatch(serving=True) is False
    assert jax.config.values["jax_cpu_enable_async_dispatch"] is before
