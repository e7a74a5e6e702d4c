"""How a request's values reach the exported dtypes: the lossless casting rules of every door.

``convert``: the value must reach the exported dtype without losing
information. Accepted: the exact dtype; ints into wider/narrower ints when every value fits;
bools into bool; ints (exactly representable) and floats into any float type (rounding to the
nearest representable value, e.g. float64 -> float32 or float32 -> bfloat16; that is how the
ml_dtypes types JSON cannot carry arrive); anything real into complex. Refused: floats into
ints or bool, values out of the target's range (300 into int8, 1e6 into float16), NaN and
infinities unless ``allow_nan`` is set, strings/objects, ragged lists, wrong rank or fixed
dimension, a batch of 0, inputs sharing a symbolic dimension with different sizes, missing or
unknown inputs.
Every refusal is an ``InputError`` stating the rule, the expected spec and what was found, never
the input itself. ``serving/inputs.py`` (the input contract) applies it to every leaf.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxexp_mlflow.serving.signature import LeafSpec, input_error

ENV_ALLOW_NAN = "JAXEXP_ALLOW_NAN"


def describe_found(arr: Any) -> str:
    """What a refusal says was found: ``dtype[shape]``, never the values."""
    a = np.asarray(arr) if not isinstance(arr, np.ndarray) else arr
    return f"{a.dtype}[{','.join(str(d) for d in a.shape)}]"


def _exactly_representable_ints(arr: np.ndarray, target: np.dtype) -> bool:
    try:
        cast = arr.astype(target)
    except (OverflowError, ValueError):
        return False
    with np.errstate(invalid="ignore", over="ignore"):
        return bool(np.array_equal(cast.astype(arr.dtype), arr))


def convert(value: Any, spec: LeafSpec, *, dtype: np.dtype | None = None, allow_nan: bool) -> Any:
    """``value`` as a numpy array of ``dtype`` (default: the exported dtype) fitting ``spec``.

    Checks rank and fixed dimensions (symbolic ones are checked across inputs by the caller)
    and refuses casts that lose information; see the module docstring for the rules.
    """
    target = spec.dtype if dtype is None else dtype
    if isinstance(value, np.ndarray) and value.dtype == target:
        arr = value
    else:
        if hasattr(value, "__array__") and not isinstance(value, np.ndarray | list | tuple):
            value = np.asarray(value)  # jax arrays, pandas Series
        try:
            arr = np.asarray(value)
        except (ValueError, TypeError, OverflowError):
            raise input_error(
                spec, "a ragged or non-numeric nested list", "Send a rectangular array of numbers."
            ) from None
        if arr.size == 0 and arr.ndim >= 1 and spec.shape and spec.shape[0] is None:
            raise input_error(spec, "a batch of 0 rows", "Send at least one row.")
        arr = _cast(arr, spec, target)
    if arr.ndim != len(spec.shape) or any(
        d is not None and d != a for d, a in zip(spec.shape, arr.shape, strict=False)
    ):
        raise input_error(spec, describe_found(arr), _shape_hint(spec, arr))
    if spec.shape and spec.shape[0] is None and arr.shape[0] == 0:
        raise input_error(spec, "a batch of 0 rows", "Send at least one row.")
    if not allow_nan and arr.size and (arr.dtype.kind in "fc" or is_ml_float(arr.dtype)):
        if not _all_finite(arr):
            raise input_error(
                spec,
                "NaN or infinite values",
                "NaN and infinities are not allowed for this model (set allow_nan in the "
                f"model_config or {ENV_ALLOW_NAN}=1 to allow them).",
            )
    return arr


#: Up to this many values, ``isfinite(arr).all()`` (a small bool temporary); above it, for
#: numpy's own float dtypes, ``max`` and ``min`` (no temporary, no warning to silence).
_SMALL_FINITE_CHECK = 1 << 16


def _all_finite(arr: np.ndarray) -> bool:
    """Whether every value is finite. For big arrays of numpy floats two reductions that need no
    temporary: ``max`` and ``min`` propagate NaN, and an infinity is one of them. On 1024 x 784
    float32 they take 61 us, where ``isfinite(arr).all()`` takes 55 us with a 0.8 MB temporary
    and the ``sum`` used before 108 us. Complex and ml_dtypes arrays (whose reductions warn on
    NaN) take ``isfinite``."""
    if arr.size <= _SMALL_FINITE_CHECK or arr.dtype.kind != "f" or is_ml_float(arr.dtype):
        return bool(np.isfinite(arr).all())
    return bool(np.isfinite(arr.max()) and np.isfinite(arr.min()))


def is_ml_float(dt: np.dtype) -> bool:
    return dt.type.__module__ != "numpy" and not dt.name.startswith(("int", "uint"))


def _shape_hint(spec: LeafSpec, arr: np.ndarray) -> str:
    if arr.ndim == len(spec.shape) - 1:
        return "It looks like a single example: wrap it in a list to make a batch of 1."
    return "Send an array of that rank with the fixed dimensions shown (-1 = any size)."


def _cast(arr: np.ndarray, spec: LeafSpec, target: np.dtype) -> np.ndarray:
    src = arr.dtype
    if src == target:
        return arr
    found = describe_found(arr)
    if src.kind in "OUSV" and not is_ml_float(src) or src.kind == "O":
        held, hint = _object_contents(arr) if src.kind == "O" else ("", "")
        raise input_error(spec, found + held, hint or "Send numbers within the input's dtype.")
    t_float = target.kind in "f" or is_ml_float(target)
    t_int = target.kind in "iu" or (target.type.__module__ != "numpy" and not t_float)
    if target.kind == "b":
        if src.kind in "iu" and arr.size and ((arr == 0) | (arr == 1)).all():
            return arr.astype(bool)
        raise input_error(spec, found, "Send true/false values.")
    if t_int:
        if src.kind == "b":
            return arr.astype(target)
        if src.kind not in "iu":
            raise input_error(
                spec,
                found,
                "Floats are not cast into an integer input: send integers (in JSON, numbers "
                "without a decimal point: 3, not 3.0).",
            )
        info = np.iinfo(target) if target.type.__module__ == "numpy" else _ml_iinfo(target)
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            raise input_error(
                spec,
                f"{found} with values in [{arr.min()}, {arr.max()}]",
                f"Values must lie in [{info.min}, {info.max}].",
            )
        return arr.astype(target)
    if t_float:
        if src.kind in "iu" or src.kind == "b":
            if src.kind in "iu" and not _exactly_representable_ints(arr, target):
                raise input_error(
                    spec, found, f"Some integers are not exactly representable in {target}."
                )
            return arr.astype(target)
        if src.kind == "c":
            raise input_error(spec, found, "Complex values are not cast into a real input.")
        with np.errstate(over="ignore", invalid="ignore"):
            out = arr.astype(target)
        if arr.size:
            src_finite = np.isfinite(arr)
            if not np.array_equal(src_finite, np.isfinite(out.astype(np.float32))):
                big = np.abs(arr[src_finite]).max()
                raise input_error(
                    spec,
                    f"{found} with a value of magnitude {big:.6g}",
                    f"That is out of the range of {target}.",
                )
        return out
    if target.kind == "c":
        if src.kind in "biufc":
            return arr.astype(target)
    raise input_error(spec, found)


def _object_contents(arr: np.ndarray) -> tuple[str, str]:
    """What an object array holds that numbers do not (its first such value, in order):
    ``(" holding ...", what to send)``; numpy makes one from nulls, rows of unequal lengths
    (a missing field or a short row) and integers beyond 64 bits."""
    for v in arr.flat:
        if v is None:
            return " holding a null (a missing value)", "Send a number for every value."
        if isinstance(v, list | tuple | np.ndarray):
            return (
                " holding ragged rows (of unequal lengths: a row or record missing values)",
                "Send every row with the same number of values.",
            )
        if type(v) is int:  # numpy keeps integers beyond 64 bits as Python ints
            return " holding an integer beyond 64 bits", "Send numbers within the input's dtype."
        if isinstance(v, str | bytes):
            return " holding text", "Send numbers, not strings."
    return "", ""


def _ml_iinfo(target: np.dtype) -> Any:
    import ml_dtypes

    return ml_dtypes.iinfo(target)
