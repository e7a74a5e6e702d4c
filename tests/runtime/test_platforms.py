"""Platform names as ``jax.export`` names them, tested against JAX itself on any host.

Lowering for ``cuda`` or ``tpu`` needs no device, so the naming, the verdict, the save of a model
for a platform this machine lacks and the cross-platform tolerances are all checked here; the GPU
suite (tests/e2e/test_gpu.py) checks the rest where an accelerator is visible.
"""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import mlflow
import numpy as np
import pytest

import jaxexp_mlflow  # noqa: F401 - installs mlflow.jaxexp
from jaxexp_mlflow.codec.mlmodel import read_mlmodel
from jaxexp_mlflow.errors import IncompatibleError, UnsupportedModelError
from jaxexp_mlflow.runtime import compat, platforms
from tests.conftest import CORPUS, REPO, run_cli


def _apply(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


PARAMS = {"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4), "b": np.ones(4, np.float32)}
X = np.linspace(0, 1, 6, dtype=np.float32).reshape(2, 3)


def test_running_platform_is_jax_exports_name():
    assert platforms.running_platform() == jax.export.default_export_platform()
    assert platforms.running_platform() in ("cpu", "cuda", "rocm", "tpu")
    assert platforms.available_platforms()[0] == platforms.running_platform()


@pytest.mark.parametrize(
    ("name", "version", "want"),
    [
        ("gpu", "cuda 13.0", "cuda"),
        ("gpu", "", "cuda"),
        ("gpu", "rocm 6.3 (HIP)", "rocm"),
        ("cuda", "", "cuda"),
        ("tpu", "", "tpu"),
        ("CPU", "", "cpu"),
    ],
)
def test_canonical_names(name, version, want):
    assert platforms.canonical(name, version=version) == want


def test_jax_lowers_for_cuda_without_a_gpu_and_gpu_is_taken_as_cuda(tmp_path):
    exp = jax.export.export(jax.jit(_apply), platforms=("cpu", "cuda"))(PARAMS, X)
    assert exp.platforms == ("cpu", "cuda")  # what JAX records, and what the verdict compares
    mlflow.jaxexp.save_model(
        jax.jit(_apply), tmp_path / "m", params=PARAMS, input_example=X, platforms=("cpu", "gpu")
    )
    assert read_mlmodel(tmp_path / "m")["flavors"]["jaxexp"]["platforms"] == ["cpu", "cuda"]


def test_the_verdict_on_a_cuda_host_names_cuda():
    """What a CUDA host's environment is (``gpu`` as JAX's backend says it): a model exported for
    cuda, or for cpu and cuda, is not refused for its platform."""
    cuda_host = {"platform": "gpu", "available_platforms": ["gpu", "cpu"]}
    for plats in (["cuda"], ["cpu", "cuda"], ["cpu"]):
        verdict = compat.assess({"platforms": plats, "nr_devices": 1}, env=cuda_host)
        assert "platform" not in {r.code for r in verdict.reasons}, (plats, verdict.reasons)
    verdict = compat.assess({"platforms": ["tpu"], "nr_devices": 1}, env=cuda_host)
    (reason,) = [r for r in verdict.reasons if r.code == "platform"]
    assert "runs JAX on 'cuda'" in reason.message and "'gpu'" not in str(reason)


def test_lapack_kernels_of_the_host_are_no_false_refusal_on_a_gpu_host():
    """jax 0.10.2's ``linalg`` corpus blob calls LAPACK kernels; on a CUDA host they are
    registered for the host CPU, which runs the cpu lowering, so they are no reason to refuse."""
    case = CORPUS / "jax-0.10.2" / "linalg"
    if not case.is_dir():
        pytest.skip(f"no corpus at {CORPUS}")
    from jaxexp_mlflow.codec import blob

    desc = blob.describe((case / "exported.bin").read_bytes(), source=str(case))
    env = {"platform": "cuda", "available_platforms": ["cuda", "cpu"]}
    verdict = compat.assess({}, description=desc, env=env)
    assert "custom_calls" not in {r.code for r in verdict.reasons}, verdict.reasons


def test_save_for_a_platform_this_machine_lacks(tmp_path):
    """Exported for tpu from here: the reference comes from a host lowering and says so; a load
    here is refused before anything runs, and no route is offered."""
    path = tmp_path / "m"
    mlflow.jaxexp.save_model(
        jax.jit(_apply), path, params=PARAMS, input_example=X, platforms=("tpu",)
    )
    conf = read_mlmodel(path)["flavors"]["jaxexp"]
    assert conf["platforms"] == ["tpu"]
    assert conf["reference"]["platform"] == platforms.running_platform()
    with np.load(path / "reference" / "outputs.npz") as ref:
        np.testing.assert_allclose(ref["out_0"], np.asarray(_apply(PARAMS, X)), rtol=1e-6)
    with pytest.raises(IncompatibleError) as err:
        mlflow.jaxexp.load_model(str(path))
    assert "No route runs it here" in str(err.value) and "recorded-env" not in str(err.value)
    checked = run_cli("check", str(path), "--json")  # `python -m`: test_python_dash_m_cli
    assert checked.exit_code == 1, checked.stderr[-2000:]
    assert json.loads(checked.stdout)["status"] == "incompatible"


def test_an_exported_for_an_absent_platform_with_an_example_is_refused(tmp_path):
    exp = jax.export.export(jax.jit(_apply), platforms=("tpu",))(PARAMS, X)
    with pytest.raises(IncompatibleError, match="Cannot compute the reference outputs"):
        mlflow.jaxexp.save_model(exp, tmp_path / "m", params=PARAMS, input_example=X)
    assert not (tmp_path / "m").exists()


def test_load_options_given_to_save_model_are_a_typed_error(tmp_path):
    with pytest.raises(UnsupportedModelError, match="options of load_model"):
        mlflow.jaxexp.save_model(
            jax.jit(_apply),
            tmp_path / "m",
            params=PARAMS,
            input_example=X,
            platforms=("cuda",),
            allow_other_platform=True,
        )
    assert not (tmp_path / "m").exists()


def test_shapes_only_input_example(tmp_path):
    path = tmp_path / "m"
    spec = jax.ShapeDtypeStruct((2, 3), np.float32)
    mlflow.jaxexp.save_model(jax.jit(_apply), path, params=PARAMS, input_example=spec)
    conf = read_mlmodel(path)["flavors"]["jaxexp"]
    assert conf["reference_synthetic"]  # a synthetic probe's reference, since it runs here
    assert not (path / "serving_input_example.json").exists()
    model = mlflow.jaxexp.load_model(str(path))
    np.testing.assert_allclose(np.asarray(model(X)), np.asarray(_apply(PARAMS, X)), rtol=1e-6)


def test_cross_platform_tolerances():
    from jaxexp_mlflow.archive.reproduce import compare_outputs, reference_platform

    want = [np.linspace(1, 2, 50, dtype=np.float32)]
    tf32_like = [want[0] * np.float32(1 + 2e-3)]  # what TF32 matmuls differ by
    assert not compare_outputs(tf32_like, want)[0].passed
    assert compare_outputs(tf32_like, want, cross_platform=True)[0].passed
    assert not compare_outputs([want[0] * 1.05], want, cross_platform=True)[0].passed
    ints = [np.arange(5)]
    assert not compare_outputs([ints[0] + 1], ints, cross_platform=True)[0].passed
    assert reference_platform({}) == "cpu"
    assert reference_platform({"reference": {"platform": "cuda"}}) == "cuda"


def test_python_dash_m_cli():
    proc = subprocess.run(
        [sys.executable, "-m", "jaxexp_mlflow.cli", "--version"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("jaxexp"), proc.stderr
