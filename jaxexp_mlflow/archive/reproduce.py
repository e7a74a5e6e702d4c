"""Reproduce an archived result: run the stored reference input, compare with stored outputs."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from jaxexp_mlflow.errors import ArtifactError
from jaxexp_mlflow.runtime.tolerance import CROSS_PLATFORM_TOLERANCES as CROSS_PLATFORM_TOLERANCES
from jaxexp_mlflow.runtime.tolerance import DEFAULT_TOLERANCES as DEFAULT_TOLERANCES
from jaxexp_mlflow.runtime.tolerance import OutputCheck as OutputCheck
from jaxexp_mlflow.runtime.tolerance import compare_outputs as compare_outputs
from jaxexp_mlflow.runtime.tolerance import reference_platform as reference_platform


def verify_directory(
    model: Any, path: str | os.PathLike, *, rtol: float | None = None, atol: float | None = None
) -> list[OutputCheck]:
    """Run ``model`` (a loaded ``JaxExpModel`` or ``IreeModel``) on its stored reference input
    and compare."""
    iree = getattr(model, "backend", "jax") == "iree"
    if iree:
        from jaxexp_mlflow.iree.files import read_reference
    else:
        from jaxexp_mlflow.store.artifact import read_reference
    ref = read_reference(path, model.metadata)
    if ref is None:
        raise ArtifactError(
            f"The model at {path} carries no reference input/outputs (it was saved without "
            "input_example, before synthetic references), so there is nothing to reproduce. "
            "Save or log it again (a synthetic reference is stored when it runs), or "
            "`jaxexp refresh` it (proved on synthetic probes)."
        )
    inputs, outputs = ref
    cross = reference_platform(model.metadata) != running_platform_of(model)
    # the reference holds the inputs after the params
    if iree:
        got = model.call_flat(inputs)
    else:
        from jaxexp_mlflow.runtime.probes import call_flat

        got = call_flat(model, inputs)
    return compare_outputs(got, outputs, rtol=rtol, atol=atol, cross_platform=cross)


def running_platform_of(model: Any) -> str:
    """The platform a loaded model runs on (IREE's CPU target counts as ``cpu``)."""
    if getattr(model, "backend", "jax") == "iree":
        return "cpu"
    return str(getattr(model, "platform", "cpu"))


def decode_outputs(raw: list[np.ndarray], dtypes: list[str]) -> list[np.ndarray]:
    """Arrays stored as raw bits (dtypes numpy lacks, e.g. bfloat16) viewed as their dtype."""
    from jaxexp_mlflow.codec.arrays import resolve_dtype

    out = []
    for arr, name in zip(raw, dtypes, strict=True):
        want = resolve_dtype(name)
        out.append(arr.view(want) if arr.dtype != want else arr)
    return out
