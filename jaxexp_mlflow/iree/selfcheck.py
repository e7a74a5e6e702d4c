"""The self-check of a model loaded on IREE: its stored reference reproduced before it is used.

IREE compiles the model's StableHLO with its own passes, which have computed other numbers than
JAX (a float rounding folded away) and modules that fail at their first call. So a model
directory loaded on IREE is run once on its stored reference inputs (``reference/inputs.npz``)
and compared with the stored outputs by ``jaxexp verify``'s own comparison
(``archive.reproduce.compare_outputs``, its tolerances: per dtype width, wider where the
reference was computed on another platform). A model that does not reproduce them is refused
with an ``IncompatibleError`` naming the largest difference; one saved without a reference is
loaded with a warning (once per model directory and process), since nothing can be checked.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from jaxexp_mlflow.errors import IncompatibleError
from jaxexp_mlflow.iree import files

_logger = logging.getLogger(__name__)
#: Model directories already warned about (no reference to check), in this process.
_WARNED: set[str] = set()


def check_reference(model: Any, path: str | os.PathLike, meta: dict[str, Any]) -> None:
    """Run ``model`` (an ``IreeModel``) once on the reference stored in ``path``; raise
    ``IncompatibleError`` unless every output is within ``jaxexp verify``'s tolerances.

    Args:
        model: the model loaded on IREE (``call_flat`` takes the inputs after the params).
        path: the model directory.
        meta: its MLmodel ``jaxexp`` section.

    Raises:
        IncompatibleError: an output differs from the reference beyond the tolerances, or the
            IREE runtime failed running the reference inputs.
        ArtifactError: the reference files are damaged or do not fit the model.
    """
    from jaxexp_mlflow.runtime.tolerance import compare_outputs, reference_platform

    ref = files.read_reference(path, meta)
    if ref is None:
        key = str(os.path.abspath(path))
        if key not in _WARNED:
            _WARNED.add(key)
            _logger.warning(
                "jaxexp: the model at %s carries no reference input/outputs, so the IREE backend "
                "cannot check that it computes the model's numbers; save it with an "
                "input_example (or `jaxexp refresh` it) to have it checked at every load",
                path,
            )
        return
    inputs, outputs = ref
    got = model.call_flat(inputs)
    cross = reference_platform(meta) != "cpu"  # IREE's CPU target computes on the CPU
    checks = compare_outputs(got, outputs, cross_platform=cross)
    failed = [c for c in checks if not c.passed]
    if not failed:
        return
    worst = max(failed, key=lambda c: (c.max_abs_err, c.max_rel_err))
    raise IncompatibleError(
        f"The model at {path} does not reproduce its stored reference on the IREE backend: "
        f"expected every output within rtol={worst.rtol:g}, atol={worst.atol:g} of "
        f"reference/outputs.npz, found {len(failed)} of {len(checks)} output(s) off, the "
        f"largest difference in output {worst.index} ({worst.dtype}{list(worst.shape)}): "
        f"{worst.max_abs_err:.6g} absolute, {worst.max_rel_err:.3g} relative. IREE computes "
        "other numbers than JAX for this model; load it with the JAX backend (backend='jax')."
    )
