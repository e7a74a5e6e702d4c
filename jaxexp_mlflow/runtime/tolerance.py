"""How outputs are held to a stored reference: tolerances per dtype width and platform, and
the comparison itself. Numpy only, so that every backend (JAX, IREE) and ``jaxexp verify`` judge
a model by one rule."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from jaxexp_mlflow.errors import ArtifactError

#: Default tolerances (rtol, atol) per dtype width: a newer XLA may differ in the last bits.
DEFAULT_TOLERANCES = {2: (2e-2, 2e-2), 4: (1e-5, 1e-6), 8: (1e-12, 1e-14)}
#: Tolerances when the reference was computed on another platform (``reference.platform`` in
#: MLmodel, ``cpu`` for models that do not say): JAX's GPU matmuls and convolutions default to
#: TF32 (10 mantissa bits) for float32, and other platforms fuse and reduce in other orders.
#: Integers and booleans stay exact. docs/hardware.md gives the figures measured on a GPU.
CROSS_PLATFORM_TOLERANCES = {2: (5e-2, 5e-2), 4: (1e-2, 2e-3), 8: (1e-9, 1e-12)}


@dataclass(frozen=True)
class OutputCheck:
    """One output leaf of the reference comparison."""

    index: int
    shape: tuple[int, ...]
    dtype: str
    max_abs_err: float
    max_rel_err: float
    rtol: float
    atol: float
    passed: bool

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (for ``jaxexp verify --json``)."""
        return asdict(self)


def _tolerances(
    dtype: np.dtype, rtol: float | None, atol: float | None, cross_platform: bool = False
) -> tuple[float, float]:
    if dtype.kind in "biu":
        return 0.0, 0.0
    table = CROSS_PLATFORM_TOLERANCES if cross_platform else DEFAULT_TOLERANCES
    drtol, datol = table.get(dtype.itemsize, table[4])
    return (drtol if rtol is None else rtol), (datol if atol is None else atol)


def compare_outputs(
    got: list[Any],
    want: list[np.ndarray],
    *,
    rtol: float | None = None,
    atol: float | None = None,
    cross_platform: bool = False,
) -> list[OutputCheck]:
    """Compare flat output leaves with the reference, per dtype-aware tolerance
    (``CROSS_PLATFORM_TOLERANCES`` when the reference was computed on another platform)."""
    if len(got) != len(want):
        raise ArtifactError(
            f"The model returned {len(got)} output leaves but the reference has {len(want)}; "
            "the reference does not belong to this model."
        )
    checks = []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        g = np.asarray(g)
        r, a = _tolerances(w.dtype, rtol, atol, cross_platform)
        same_shape = g.shape == w.shape and g.dtype == w.dtype
        g64 = g.astype(np.float64) if same_shape else np.zeros(w.shape)
        w64 = w.astype(np.float64)
        both_nan = np.isnan(g64) & np.isnan(w64)  # NaN where the reference has NaN: its value
        diff = np.where(both_nan, 0.0, np.abs(g64 - w64))
        max_abs = float(diff.max()) if diff.size else 0.0
        max_rel = float((diff / np.maximum(np.abs(w64), 1e-30)).max()) if diff.size else 0.0
        ok = same_shape and bool(np.all((diff <= a + r * np.abs(w64)) | (g64 == w64) | both_nan))
        checks.append(OutputCheck(i, tuple(w.shape), str(w.dtype), max_abs, max_rel, r, a, ok))
    return checks


def reference_platform(meta: dict[str, Any]) -> str:
    """The platform that computed a model's stored reference (``cpu`` where MLmodel does not
    say: models written before it was recorded were all saved on CPU hosts)."""
    return str((meta.get("reference") or {}).get("platform") or "cpu")
