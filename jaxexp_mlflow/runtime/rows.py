"""The proof that a model's rows are independent: what lets pyfunc pad a batch to a bucket.

Padding a batch of ``n`` rows up to a bucket (``runtime/buckets.py``) is exact only when each
output row depends on its own input row alone. A graph network whose inputs are nodes and edges
(segment sums over edges), attention across the batch, BatchNorm in training mode, anything that
reduces over the leading axis: each gives other numbers for the real rows once filler rows are
added. Nothing in the signature says which kind a function is, so :func:`prove` runs it.

The proof, at save time, on the input example (or a synthetic probe without one): the batch of
``n`` rows is run as it is, then padded with ``k`` filler rows of several kinds (the last row
repeated, as serving pads; the first row repeated; zeros; the rows in reverse order), every
padded batch at the same size ``n + k``. The model's rows are proven independent when

* the real rows of every padded run are **bit for bit** the same whatever the filler (same
  shape, same executable: any difference is the filler leaking into a real row), and
* they agree with the unpadded run within float rounding (a different batch size may take
  another kernel: XLA:CPU computes one row through a matrix-vector product, a few ulp off the
  matrix-matrix one; integers and booleans must be equal).

Padded batches that come out identical (a one-row example: ``last``, ``first`` and ``reversed``
all repeat its row) are run once: the same executable on the same inputs gives the same rows.
A model whose run is a whole decode loop (``runtime.buckets.has_loop``: a ``generate``) is
proven on one padded batch, :data:`LOOP_FILLERS`, rows that differ from the real ones, judged
against the unpadded run only (docs/saving.md says what that leaves unproven).

The verdict is recorded in MLmodel (``jaxexp.padding``); pyfunc pads only a model recorded
``rows_independent: true``. A model saved before the record existed, or whose proof could not
run here, is called at each batch's own size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

#: The filler rows tried, in order: ``last`` is the one serving pads with.
FILLERS = ("last", "first", "zeros", "reversed")
#: The one filler of a model that loops (each padded run is a whole decode): zeros, rows that
#: differ from the real ones (a ``last`` filler repeats a real row, which hides a batch mean).
LOOP_FILLERS = ("zeros",)
#: Filler rows added: at least 3 (so a one-row example meets several kinds), at most 16.
MIN_FILL, MAX_FILL = 3, 16
#: Rows are compared with the unpadded run within this many ulp of the output's magnitude.
ULPS = 64


def fill_count(n: int) -> int:
    """How many filler rows a batch of ``n`` rows is padded with for the proof."""
    return max(MIN_FILL, min(n, MAX_FILL))


def filler(x: np.ndarray, k: int, how: str) -> np.ndarray:
    """``k`` filler rows for ``x`` (``n`` rows): one of :data:`FILLERS`."""
    n = x.shape[0]
    if how == "last":
        idx = np.full(k, n - 1)
    elif how == "first":
        idx = np.zeros(k, dtype=np.intp)
    elif how == "reversed":
        idx = (n - 1 - np.arange(k)) % n
    elif how == "zeros":
        return np.zeros((k, *x.shape[1:]), dtype=x.dtype)
    else:
        raise ValueError(f"unknown filler {how!r}: expected one of {FILLERS}")
    return x[idx]


def _differs_exactly(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return True
    if a.dtype.kind in "fc":
        return not np.array_equal(a, b, equal_nan=True)
    return a.tobytes() != b.tobytes()


def _float_eps(dtype: np.dtype) -> float | None:
    """The machine epsilon of a float or complex dtype (ml_dtypes floats too), else None."""
    if dtype.kind in "fc":
        return float(np.finfo(dtype).eps)
    if dtype.kind == "V":
        try:
            import ml_dtypes

            return float(ml_dtypes.finfo(dtype).eps)
        except (ImportError, TypeError, ValueError):
            return None
    return None


def _rounding_gap(got: np.ndarray, want: np.ndarray) -> float | None:
    """The largest difference beyond float rounding between ``got`` and ``want`` (None: none);
    integers, booleans and other dtypes must be equal."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return float("inf")
    eps = _float_eps(want.dtype)
    if eps is None:
        return None if got.tobytes() == want.tobytes() else float("inf")
    if want.size == 0:
        return None
    wide = np.complex128 if want.dtype.kind == "c" else np.float64
    g, w = got.astype(wide), want.astype(wide)
    fin = np.isfinite(w)
    # NaN where NaN, the same infinities: exact; finite values: within ULPS of the magnitude
    if not np.array_equal(np.isnan(g), np.isnan(w)) or not np.array_equal(
        g[~fin & ~np.isnan(w)], w[~fin & ~np.isnan(w)]
    ):
        return float("inf")
    if not np.all(np.isfinite(g[fin])):
        return float("inf")
    if not np.any(fin):
        return None
    scale = float(np.max(np.abs(w[fin])))
    gap = float(np.max(np.abs(g[fin] - w[fin])))
    return None if gap <= ULPS * eps * max(scale, 1.0) else gap


def prove(
    call: Callable[[list[np.ndarray]], Sequence[Any]],
    leaves: Sequence[np.ndarray],
    *,
    source: str,
    exact: Sequence[Any] | None = None,
    fillers: Sequence[str] = FILLERS,
) -> dict[str, Any]:
    """Run ``call`` (flat input leaves -> flat output leaves, every leaf batched along axis 0)
    on ``leaves`` as they are and padded with each filler; the ``jaxexp.padding`` record.

    ``source`` says what the rows came from (``"input example"``, ``"synthetic probe"``).
    ``exact``: the flat outputs of ``call(leaves)`` when the caller already has them (the
    save's reference run), so the unpadded batch is not run a second time. ``fillers``: the
    kinds of filler rows tried (:data:`FILLERS`; :data:`LOOP_FILLERS` for a decode loop); a
    padded batch identical to an earlier one is not run again.
    Never raises for the model's sake: a proof that fails to run is a model not proven
    row-independent (an unknown kind in ``fillers`` is the caller's ``ValueError``).
    """
    leaves = [np.asarray(x) for x in leaves]
    if not leaves or any(x.ndim == 0 for x in leaves):
        return _record(False, "the inputs have no batch axis")
    n = leaves[0].shape[0]
    if n < 1 or any(x.shape[0] != n for x in leaves):
        return _record(False, f"the {source}'s inputs do not share one batch size")
    k = fill_count(n)
    fillers = tuple(fillers)
    if not fillers or any(how not in FILLERS for how in fillers):
        raise ValueError(f"fillers={fillers!r}: expected kinds of {FILLERS}")
    runs: list[list[np.ndarray]] = []  # the padded batches run
    try:
        exact = [np.asarray(o) for o in (call(leaves) if exact is None else exact)]
        if any(o.ndim == 0 or o.shape[0] != n for o in exact):
            return _record(False, "an output has no batch axis of the inputs' size")
        first: list[np.ndarray] | None = None
        for how in fillers:
            padded = [np.concatenate([x, filler(x, k, how)]) for x in leaves]
            if any(_same_batch(padded, done) for done in runs):
                continue  # the same inputs to the same executable: the same rows
            runs.append(padded)
            real = [np.asarray(o)[:n] for o in call(padded)]
            if first is None:
                first = real
                for i, (got, want) in enumerate(zip(real, exact, strict=True)):
                    gap = _rounding_gap(got, want)
                    if gap is not None:
                        return _record(
                            False,
                            f"output {i} of the {source}'s {n} rows changes when the batch is "
                            f"padded to {n + k} rows (max difference {gap:.3g})",
                        )
                continue
            for i, (got, want) in enumerate(zip(real, first, strict=True)):
                if _differs_exactly(got, want):
                    return _record(
                        False,
                        f"output {i} of the {source}'s {n} real rows depends on the filler "
                        f"rows ('{fillers[0]}' and '{how}' padding to {n + k} rows disagree)",
                    )
    except Exception as err:  # noqa: BLE001 - unproven, never a failed save
        return _record(False, f"the proof did not run: {type(err).__name__}: {str(err)[:300]}")
    kinds = ", ".join(fillers)
    if len(fillers) == 1:
        return _record(
            True,
            f"the {source}'s {n} rows padded to {n + k} with one kind of filler rows ({kinds}) "
            "give the unpadded rows within rounding",
        )
    same = f"; {len(fillers) - len(runs)} identical padded batches run once" * (
        len(runs) < len(fillers)
    )
    return _record(
        True,
        f"the {source}'s {n} rows padded to {n + k} with {len(fillers)} kinds of filler rows "
        f"({kinds}) give the same real rows bit for bit, and the unpadded rows within rounding"
        + same,
    )


def _same_batch(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> bool:
    """Whether two padded batches hold the same bytes, leaf by leaf."""
    return all(x.shape == y.shape and x.tobytes() == y.tobytes() for x, y in zip(a, b, strict=True))


def _record(independent: bool, proof: str) -> dict[str, Any]:
    return {"rows_independent": bool(independent), "proof": proof}


def proven(conf: dict[str, Any] | None) -> bool:
    """Whether a ``jaxexp`` section records rows proven independent (absent: not proven)."""
    padding = (conf or {}).get("padding")
    return isinstance(padding, dict) and padding.get("rows_independent") is True
