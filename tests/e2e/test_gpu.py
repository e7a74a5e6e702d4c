"""The GPU suite: log, load, call, serve and verify on the accelerator JAX runs on.

Marked ``gpu`` and skipped unless JAX's default platform here is an accelerator (``cuda``,
``rocm``, ``tpu``); ``JAXEXP_GPU_TESTS_ON_CPU=1`` runs it on a CPU host too (the rehearsal of
``scripts/gpu_suite.sh``), where every assertion is about the running platform, whatever it is.
Each assertion names the platform as ``jax.export`` does (``runtime.platforms``). The figures a
test prints (``GPU-FIGURE`` lines: cross-platform errors) go to docs/hardware.md.

Run on a GPU machine: ``bash scripts/gpu_suite.sh run`` (docs/hardware.md, "The GPU suite").
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import mlflow
import numpy as np
import pytest
import requests

# after mlflow: with the package on PYTHONPATH only (no entry point installed, as
# scripts/gpu_suite.sh runs it), importing it is what installs mlflow.jaxexp
import jaxexp_mlflow  # noqa: F401
from jaxexp_mlflow.runtime.platforms import running_platform
from tests.conftest import CORPUS, REPO, load_case, run_cli
from tests.servers import free_port

HERE = running_platform()
FORCED = os.environ.get("JAXEXP_GPU_TESTS_ON_CPU") == "1"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        HERE == "cpu" and not FORCED,
        reason="no accelerator visible (JAXEXP_GPU_TESTS_ON_CPU=1 rehearses the suite on CPU)",
    ),
]
#: Two runs on an accelerator may pick other kernels (TF32 matmuls on GPUs); on CPU they agree.
TOL = {"rtol": 1e-5, "atol": 1e-5} if HERE == "cpu" else {"rtol": 2e-3, "atol": 2e-3}
#: A platform this machine lacks, to export for.
ABSENT = "tpu" if HERE != "tpu" else "cuda"


def _platform_of(array: jax.Array) -> str:
    from jaxexp_mlflow.runtime.platforms import canonical

    (device,) = array.devices()
    return canonical(device.platform, version=str(getattr(device.client, "platform_version", "")))


def _mlp(d_in: int = 64, d_hidden: int = 256, d_out: int = 10, seed: int = 0):
    rng = np.random.default_rng(seed)
    params = {
        "w1": (rng.standard_normal((d_in, d_hidden)) / np.sqrt(d_in)).astype(np.float32),
        "b1": np.zeros(d_hidden, np.float32),
        "w2": (rng.standard_normal((d_hidden, d_out)) / np.sqrt(d_hidden)).astype(np.float32),
    }

    def apply(p, x):
        return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]

    x = rng.standard_normal((8, d_in)).astype(np.float32)
    return jax.jit(apply), params, x


def _pythonpath() -> str:
    """The checkout first, then what the suite runs with (scripts/gpu_suite.sh's wheels)."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m jaxexp_mlflow.cli`` (what runs where no ``jaxexp`` script is installed)."""
    return subprocess.run(
        [sys.executable, "-m", "jaxexp_mlflow.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": _pythonpath(), **(env or {})},
        timeout=600,
    )


def _jaxexp(*args: str, env: dict | None = None):
    """The ``jaxexp`` command in this process, on the platform the suite runs on (where the
    process is not what a test checks; JAX's deserializer still runs in its capped child)."""
    return run_cli(*args, env=env)


def test_readme_example_logs_loads_and_runs_here(tracking_uri):
    """The README's example, as a training loop on this machine runs it."""
    fn, params, x = _mlp()
    with mlflow.start_run():
        info = mlflow.jaxexp.log_model(
            fn, name="model", params=params, input_example=x[:4], vjp_order=1
        )
    model = mlflow.jaxexp.load_model(info.model_uri)
    assert model.metadata["platforms"] == [HERE]
    assert model.metadata["reference"]["platform"] == HERE
    assert {_platform_of(leaf) for leaf in jax.tree.leaves(model.params)} == {HERE}
    y = model(x)
    assert _platform_of(y) == HERE
    np.testing.assert_allclose(np.asarray(y), np.asarray(fn(params, x)), **TOL)
    g = jax.grad(lambda v: model(v).sum())(x)
    want = jax.grad(lambda v: fn(params, v).sum())(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(want), **TOL)
    proc = _jaxexp("verify", info.model_uri, "--json", env={"MLFLOW_TRACKING_URI": tracking_uri})
    assert proc.exit_code == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["ok"] and report["environment"]["backend"] == HERE


def test_export_for_several_platforms_runs_on_this_accelerator(tmp_path):
    """``("cpu", HERE)``: the accelerator's lowering is the one that runs, not the host's."""
    fn, params, x = _mlp()
    platforms = ("cpu", HERE) if HERE != "cpu" else ("cpu", "cuda")
    mlflow.jaxexp.save_model(
        fn, tmp_path / "m", params=params, input_example=x, platforms=platforms
    )
    model = mlflow.jaxexp.load_model(str(tmp_path / "m"))
    assert model.platform == HERE
    assert _platform_of(model(x)) == HERE


def test_cpu_only_export_runs_on_the_host_and_says_so_once(tmp_path, caplog):
    if HERE == "cpu":
        pytest.skip("on a CPU host a cpu-only export is the ordinary case")
    fn, params, x = _mlp()
    mlflow.jaxexp.save_model(fn, tmp_path / "m", params=params, input_example=x, platforms=("cpu",))
    with caplog.at_level(logging.WARNING, logger="jaxexp_mlflow.runtime.platforms"):
        first = mlflow.jaxexp.load_model(str(tmp_path / "m"))
        second = mlflow.jaxexp.load_model(str(tmp_path / "m"))
    said = [r for r in caplog.records if "runs on this host's cpu devices" in r.getMessage()]
    assert len(said) <= 1  # once per process (an earlier test may have said it already)
    for model in (first, second):
        assert model.platform == "cpu"
        assert _platform_of(model(x)) == "cpu"
        assert {_platform_of(p) for p in jax.tree.leaves(model.params)} == {"cpu"}


def test_export_for_a_platform_this_machine_lacks(tmp_path):
    """Saved from here for ``ABSENT``: the reference comes from a host lowering; loading here is
    refused before anything runs, naming both platforms and no route."""
    from jaxexp_mlflow.errors import IncompatibleError

    fn, params, x = _mlp()
    path = tmp_path / "m"
    mlflow.jaxexp.save_model(fn, path, params=params, input_example=x, platforms=(ABSENT,))
    from jaxexp_mlflow.codec.mlmodel import read_mlmodel

    conf = read_mlmodel(path)["flavors"]["jaxexp"]
    assert conf["platforms"] == [ABSENT] and conf["reference"]["platform"] == HERE
    with pytest.raises(IncompatibleError) as err:
        mlflow.jaxexp.load_model(str(path))
    assert f"exported for platforms ['{ABSENT}']" in str(err.value)
    assert f"runs JAX on '{HERE}'" in str(err.value) and "gpu'" not in str(err.value)
    proc = _jaxexp("check", str(path))
    assert proc.exit_code != 0 and "recorded-env" not in proc.stdout + proc.stderr


_SAVE_ON_CPU = textwrap.dedent(
    """
    import sys, numpy as np, jax, jax.numpy as jnp, mlflow, jaxexp_mlflow
    from tests.models_real import nnx_transformer
    rng = np.random.default_rng(0)
    d = 512
    p = {f"w{i}": (rng.standard_normal((d, d)) / np.sqrt(d)).astype(np.float32) for i in range(4)}
    def apply(p, x):
        for i in range(4):
            x = jnp.tanh(x @ p[f"w{i}"])
        return x
    x = rng.standard_normal((16, d)).astype(np.float32)
    plats = tuple(sys.argv[2].split(","))
    mlflow.jaxexp.save_model(jax.jit(apply), sys.argv[1] + "/mlp", params=p, input_example=x,
                             platforms=plats)
    fn, state, ids = nnx_transformer(jnp.bfloat16)
    mlflow.jaxexp.save_model(fn, sys.argv[1] + "/nnx_bf16", params=state, input_example=ids,
                             platforms=plats)
    print("RESULT {}")
    """
)


def test_model_logged_on_cpu_verifies_here(tmp_path):
    """Logged on a CPU (the reference computed there), verified on this machine's accelerator:
    the cross-platform tolerances apply (TF32 matmuls on GPUs), and verify says so."""
    plats = "cpu" if HERE == "cpu" else f"cpu,{HERE}"
    proc = subprocess.run(
        [sys.executable, "-c", _SAVE_ON_CPU, str(tmp_path), plats],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": _pythonpath(), "JAX_PLATFORMS": "cpu"},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("mlp", "nnx_bf16"):
        out = _jaxexp("verify", str(tmp_path / name), "--json")
        report = json.loads(out.stdout)
        assert report["reference"]["platform"] == "cpu"
        assert report["environment"]["backend"] == HERE
        errs = [(o["dtype"], o["max_abs_err"], o["max_rel_err"]) for o in report["outputs"]]
        print(f"GPU-FIGURE verify {name} logged on cpu, run on {HERE}: {errs}")
        assert report["ok"], report["outputs"]
        if HERE != "cpu":
            assert "cross-platform" in _jaxexp("verify", str(tmp_path / name)).stdout


def test_real_models_bf16_and_equinox_run_here(tmp_path):
    from jaxexp_mlflow.archive.reproduce import verify_directory
    from tests.models_real import eqx_mlp, nnx_transformer

    for name, (fn, params, x) in {
        "nnx_bf16": nnx_transformer(jnp.bfloat16),
        "eqx": eqx_mlp(),
    }.items():
        path = tmp_path / name
        mlflow.jaxexp.save_model(fn, path, params=params, input_example=x)
        model = mlflow.jaxexp.load_model(str(path))
        assert _platform_of(model(x)) == HERE
        assert all(c.passed for c in verify_directory(model, path))


def test_pyfunc_and_both_servers_answer_from_this_accelerator(tmp_path):
    fn, params, x = _mlp()
    path = tmp_path / "m"
    mlflow.jaxexp.save_model(fn, path, params=params, input_example=x)
    want = np.asarray(fn(params, x))
    pyf = mlflow.pyfunc.load_model(str(path))
    np.testing.assert_allclose(np.asarray(pyf.predict(x)), want, **TOL)
    env = {
        **os.environ,
        "PYTHONPATH": _pythonpath(),
        # MLflow starts uvicorn by name: where PATH has none, this interpreter's (a venv not
        # activated); scripts/gpu_suite.sh puts its wheels' scripts on PATH itself
        "PATH": os.environ.get("PATH", "")
        + ("" if shutil.which("uvicorn") else os.pathsep + os.path.dirname(sys.executable)),
        "JAXEXP_COMPILATION_CACHE": str(tmp_path / "c"),
    }
    mlflow_bin = shutil.which("mlflow") or os.path.join(os.path.dirname(sys.executable), "mlflow")
    port = free_port()
    commands = {
        "mlflow models serve": [mlflow_bin, "models", "serve", "-m", str(path), "--env-manager"]
        + ["local", "-h", "127.0.0.1", "-p", str(port)],
        "jaxexp serve": [sys.executable, "-m", "jaxexp_mlflow.cli", "serve", "-m", str(path)]
        + ["--host", "127.0.0.1", "-p", str(port + 1)],
    }
    for (name, cmd), p in zip(commands.items(), (port, port + 1), strict=True):
        log = tmp_path / f"{name.split()[0]}.log"
        proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{p}"
            deadline = time.time() + 240
            while True:
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.time() < deadline, log.read_text()[-3000:]
                try:
                    if requests.get(f"{url}/ping", timeout=2).status_code == 200:
                        break
                except requests.ConnectionError:
                    time.sleep(0.5)
            r = requests.post(f"{url}/invocations", json={"inputs": x.tolist()}, timeout=120)
            assert r.status_code == 200, r.text[:500]
            got = np.asarray(r.json()["predictions"], np.float32)
            np.testing.assert_allclose(got, want, **TOL, err_msg=name)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def test_devices_data_parallel_and_compilation_cache(tmp_path):
    fn, params, x = _mlp()
    path = tmp_path / "m"
    mlflow.jaxexp.save_model(fn, path, params=params, input_example=x)
    device = jax.devices()[0]
    one = mlflow.jaxexp.load_model(str(path), devices=[device])
    assert one(x).devices() == {device}
    dp = mlflow.jaxexp.load_model(str(path), data_parallel=True)
    np.testing.assert_allclose(np.asarray(dp(x)), np.asarray(one(x)), **TOL)
    cache = tmp_path / "xla"
    pyf = mlflow.pyfunc.load_model(str(path), model_config={"compilation_cache": str(cache)})
    pyf.predict(x)
    assert any(cache.rglob("*")), "the compilation cache stays empty on this platform"


def test_corpus_checks_and_runs_on_this_host():
    """JAX's archived blobs (cpu lowerings) on this host: no false kernel refusal (LAPACK is
    registered for the host CPU of a GPU machine too), and each one that the verdict passes
    reproduces its stored outputs."""
    from jaxexp_mlflow.codec.arrays import resolve_dtype  # noqa: F401 - load_case needs it
    from jaxexp_mlflow.runtime import compat

    cases = sorted((CORPUS / "jax-0.10.2").glob("*/exported.bin"))
    if not cases:
        pytest.skip(f"no corpus at {CORPUS} (set JAXEXP_CORPUS)")
    ran = 0
    for blob in cases:
        case = blob.parent
        meta, inputs, outputs = load_case(case)
        proc = _jaxexp("check", str(case), "--json")
        verdict = json.loads(proc.stdout)
        codes = {r["code"] for r in verdict["reasons"] if r["severity"] == compat.INCOMPATIBLE}
        assert "custom_calls" not in codes, (case.name, verdict["reasons"])
        if codes:
            continue  # e.g. sharded4 on one device
        exp = jax.export.deserialize(bytearray(blob.read_bytes()))
        args, kwargs = jax.tree.unflatten(exp.in_tree, inputs)
        with jax.default_device(jax.devices("cpu")[0]):  # cpu lowerings run on the host CPU
            got = jax.tree.leaves(exp.call(*args, **kwargs))
        for g, w in zip(got, outputs, strict=True):
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=1e-5, err_msg=case.name)
        ran += 1
    print(f"GPU-FIGURE corpus jax-0.10.2 on {HERE} host: {ran}/{len(cases)} ran and reproduced")
    assert ran >= len(cases) - 1


def test_llm_generates_here_as_the_raw_jitted_call(tmp_path):
    """An LLM on the accelerator: examples/llm.py's tiny bf16 decoder (prefill and a KV-cached
    ``fori_loop`` in one function), saved here, loaded with its params in this accelerator's
    memory, generating the raw ``jax.jit(generate)``'s tokens through ``load_model`` and pyfunc;
    ``jaxexp verify`` in a fresh process reproduces the stored reference."""
    from tests.conftest import llm_example

    llm = llm_example()
    cfg = llm.CONFIGS["tiny"]
    params = llm.init_params(cfg, jax.random.key(0))
    ids = llm.prompt(cfg, batch=2)
    fn = jax.jit(llm.generate)
    path = tmp_path / "llm"
    mlflow.jaxexp.save_model(fn, path, params=params, input_example=ids)
    model = mlflow.jaxexp.load_model(str(path))
    assert {_platform_of(leaf) for leaf in jax.tree.leaves(model.params)} == {HERE}
    assert model.metadata["reference"]["platform"] == HERE
    x = llm.prompt(cfg, batch=3, seed=3)
    got = model(x)
    assert _platform_of(got) == HERE
    want = np.asarray(fn(params, x))
    same = float(np.mean(np.asarray(got) == want))
    print(f"GPU-FIGURE tiny LLM on {HERE}: load_model tokens equal to raw jax.jit: {same:.3f}")
    assert same == 1.0
    pyf = mlflow.pyfunc.load_model(str(path))
    assert np.array_equal(np.asarray(pyf.predict(x)), want)
    proc = _cli("verify", str(path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Reproduced: all 1 output(s) match." in proc.stdout
