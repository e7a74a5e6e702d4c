"""The ``bridge`` and ``recorded-env`` routes (``runtime/routes.py``) for a blob: run it, or
re-export it, with another jax, in a cached venv (``jax_envs``) and a child process.

The child is ``python -I`` running ``_env_runner.py --blob`` (jax and numpy only; nothing from
the model directory, no ``PYTHON*`` variables, no user site), with the devices the export needs
(``XLA_FLAGS=--xla_force_host_platform_device_count``). Outputs come back as ``.npz`` read with
``allow_pickle=False``; a re-exported blob as bytes, which the caller checks like any blob.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from jaxexp_mlflow import settings
from jaxexp_mlflow.archive import jax_envs
from jaxexp_mlflow.archive.recorded_env import RUNNER, RecordedEnvError, read_child_result

#: The ``jax_version`` that stands for this Python's own jax (the virtual-devices route).
HERE = "this python"
#: How long a child may run (environment already built): compile + run of a model.
TIMEOUT = 900


def _child_env(nr_devices: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    if nr_devices > 1:
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={nr_devices}".strip()
    env["JAX_PLATFORMS"] = env.get("JAX_PLATFORMS") or "cpu"
    return env


def _invoke(
    jax_version: str,
    mode: str,
    data: bytes,
    out: Path,
    *,
    nr_devices: int,
    python: Path | None = None,
) -> dict[str, Any]:
    python = python or jax_envs.ensure(jax_version)
    blob = out / "source.bin"
    blob.write_bytes(bytes(data))
    cmd = [str(python), "-I", str(RUNNER), "--blob", mode, str(blob), str(out)]
    try:
        proc = subprocess.run(
            cmd,
            env=_child_env(nr_devices),
            cwd=out,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    except subprocess.TimeoutExpired as err:
        raise RecordedEnvError(
            f"jax {jax_version} did not finish ({mode}) within {TIMEOUT} s; expected a result "
            "from the child process. Run it again with --debug to see where it stops."
        ) from err
    result = read_child_result(
        out,
        proc,
        who=f"The jax {jax_version} child ({mode})",
        advice=(
            f" Rebuild its environment by deleting {jax_envs.env_path(jax_version)}."
            if jax_version != HERE
            else " Run it again with --debug."
        ),
    )
    if result.get("error"):
        raise RecordedEnvError(
            f"jax {result.get('jax_version', jax_version)} (python {result.get('python')}) could "
            f"not {'re-export' if mode == 'reexport' else 'run'} the blob: {result['error']}"
            + (f"\n{result.get('traceback')}" if settings.JAXEXP_DEBUG.get() else "")
        )
    return result


def reexport_in(jax_version: str, data: bytes, *, nr_devices: int = 1) -> tuple[bytes, dict]:
    """(the blob re-exported by jax ``jax_version``, the child's report)."""
    with tempfile.TemporaryDirectory(prefix="jaxexp-bridge-") as tmp:
        result = _invoke(jax_version, "reexport", data, Path(tmp), nr_devices=nr_devices)
        return Path(tmp, "exported.bin").read_bytes(), result


def run_virtual(
    data: bytes, leaves: list[Any], *, nr_devices: int
) -> tuple[list[np.ndarray], dict]:
    """The ``virtual-devices`` route: (the blob's flat outputs on ``leaves``, run unchanged by
    this Python's jax on ``nr_devices`` simulated CPU devices in a child process; its report)."""
    import sys

    return run_in(HERE, data, leaves, nr_devices=nr_devices, python=Path(sys.executable))


def run_in(
    jax_version: str,
    data: bytes,
    leaves: list[Any],
    *,
    nr_devices: int = 1,
    python: Path | None = None,
) -> tuple[list[np.ndarray], dict]:
    """(the blob's flat outputs on the flat input ``leaves``, run by jax ``jax_version``, in
    its cached venv or by ``python``; the child's report). Dtypes numpy lacks (bfloat16)
    travel as raw bits."""
    from jaxexp_mlflow.archive.reproduce import decode_outputs

    with tempfile.TemporaryDirectory(prefix="jaxexp-era-") as tmp:
        arrays = [np.asarray(x) for x in leaves]
        raw = {
            f"in_{i}": a.view(f"u{a.dtype.itemsize}")
            if a.dtype.kind == "V" or a.dtype.name not in np.sctypeDict
            else a
            for i, a in enumerate(arrays)
        }
        np.savez(Path(tmp, "inputs.npz"), **raw)
        Path(tmp, "inputs.json").write_text(json.dumps([str(a.dtype) for a in arrays]))
        result = _invoke(jax_version, "run", data, Path(tmp), nr_devices=nr_devices, python=python)
        with np.load(Path(tmp, "outputs.npz"), allow_pickle=False) as npz:
            got = [npz[f"out_{i}"] for i in range(len(result["output_dtypes"]))]
        return decode_outputs(got, result["output_dtypes"]), result
