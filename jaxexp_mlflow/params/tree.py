"""Params trees: which leaves a checkpoint may hold, and how a stored tree differs from a target.

Every differing leaf is named, e.g. ``params['w']: expected float32[784,10], found
float32[784,12]``; key paths compare alike whatever the container (dict, FrozenDict, nnx.State,
tuple or the list Orbax stores).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxexp_mlflow.errors import ParamsMismatchError
from jaxexp_mlflow.params.layout import key_token


def aval_str(shape: tuple[int, ...], dtype: Any) -> str:
    """``float32[784,10]``."""
    import numpy as np

    name = np.dtype(dtype).name
    return f"{name}[{','.join(str(int(d)) for d in shape)}]"


def as_array_leaf(path: Any, leaf: Any) -> Any:
    """Accept jax/numpy arrays and numeric scalars; reject anything else with a clear error."""
    import jax
    import numpy as np

    if isinstance(leaf, np.generic | bool | int | float | complex):
        leaf = np.asarray(leaf)
    if isinstance(leaf, jax.Array | np.ndarray):
        if leaf.size == 0:
            raise ParamsMismatchError(
                f"params{jax.tree_util.keystr(path)}: expected a non-empty array, found "
                f"{aval_str(leaf.shape, leaf.dtype)}. Orbax cannot store zero-size arrays; "
                "replace the leaf with None (or drop it) and build the empty array inside the "
                "function."
            )
        return leaf
    raise ParamsMismatchError(
        f"params{jax.tree_util.keystr(path)}: expected an array (jax.Array or numpy.ndarray), "
        f"found {type(leaf).__module__}.{type(leaf).__qualname__}. Params must be a pytree "
        "(dict/list/tuple/None, Flax FrozenDict or nnx.State) whose leaves are arrays; convert "
        "other leaves to arrays or move them out of params."
    )


def flat(tree: Any) -> dict[tuple[str, ...], Any]:
    """``{key path tokens: leaf}`` of a tree."""
    import jax

    return {
        tuple(key_token(k) for k in kp): leaf
        for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def compare(found: dict[tuple[str, ...], Any], target: Any) -> list[str]:
    """Per-leaf differences between the checkpoint's leaves ``{tokens: leaf with shape and
    dtype}`` and the target tree (empty when they fit)."""
    import jax
    import numpy as np

    expected, names = {}, {}
    for kp, leaf in jax.tree_util.tree_flatten_with_path(target)[0]:
        tokens = tuple(key_token(k) for k in kp)
        expected[tokens] = leaf
        names[tokens] = "params" + jax.tree_util.keystr(kp)
    problems = []
    for tokens, exp in expected.items():
        name = names[tokens]
        if not hasattr(exp, "shape") or not hasattr(exp, "dtype"):
            problems.append(
                f"{name}: target leaf is {type(exp).__name__}, expected a jax.ShapeDtypeStruct"
            )
            continue
        want = aval_str(exp.shape, exp.dtype)
        if tokens not in found:
            problems.append(f"{name}: expected {want}, found no such array in the checkpoint")
            continue
        got = found[tokens]
        if tuple(got.shape) != tuple(exp.shape) or np.dtype(got.dtype) != np.dtype(exp.dtype):
            problems.append(f"{name}: expected {want}, found {aval_str(got.shape, got.dtype)}")
    for tokens, got in found.items():
        if tokens not in expected:
            where = "params" + "".join(f"[{t!r}]" for t in tokens)
            problems.append(
                f"{where}: expected nothing there, found {aval_str(got.shape, got.dtype)} in "
                "the checkpoint"
            )
    return problems


def raise_mismatch(path: Path, problems: list[str]) -> None:
    """``ParamsMismatchError`` listing ``problems`` (at most 20 shown), if any."""
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ParamsMismatchError(
            f"The params checkpoint at {path} does not match the expected params "
            f"({len(problems)} difference(s)):\n  {shown}{more}\n"
            "Log the model again with params that match the exported function's first "
            "argument, or pass params of the right structure, shapes and dtypes."
        )
