"""The static-batch entries compiled beside ``main`` and the shapes at a batch size.

A module whose inputs have one dimension variable (the batch) may carry functions with that
variable set (``jaxexp_main_batch1`` at batch 1, or one per size for models compiled per batch
size, ``iree/static.py``): IREE's code for static shapes is much faster. This module names those
entries for the compiler and works out the input and output shapes they take and give; the
callable model (``iree/model.py``) routes calls of those shapes to them. Nothing here imports JAX
or the IREE runtime.
"""

from __future__ import annotations

from typing import Any

from jaxexp_mlflow.errors import InputError
from jaxexp_mlflow.iree import compiler, shapes

#: The name of the batch-1 function the compiler adds beside ``main`` (:func:`batch1_entry`).
BATCH1 = "jaxexp_main_batch1"


def batch1_entry(
    description: Any,
    n_params: int,
    platform_index: int | None = None,
    constraints: tuple[str, ...] = (),
) -> compiler.Entry | None:
    """The batch-1 function to compile beside ``main``: for a module whose inputs (after the
    ``n_params`` fixed-size param leaves) have one dimension variable, the batch, ``main`` with
    it set to 1 (if the constraints allow); else None. IREE's code for static shapes is several
    times faster at batch 1 than its code for a dynamic dimension that happens to be 1."""
    return sized_entry(BATCH1, description, n_params, 1, platform_index, constraints)


def sized_entry(
    name: str,
    description: Any,
    n_params: int,
    size: int,
    platform_index: int | None = None,
    constraints: tuple[str, ...] = (),
    bind_params: bool = False,
) -> compiler.Entry | None:
    """The entry ``name``: ``main`` with its one dimension variable (the batch) set to ``size``,
    as the static shapes of the arguments it is passed and of its results; None when the inputs
    do not have exactly one dimension variable or the constraints refuse ``size``. With
    ``bind_params``, the kept params' positions among ``main``'s arguments as ``bound``."""
    avals = [shapes.Aval.parse(a) for a in description.in_avals]
    outs = [shapes.Aval.parse(a) for a in description.out_avals]
    found = batch_shapes(avals[n_params:], outs, constraints, size)
    if found is None:
        return None
    inputs, outputs = found
    static = [_static(a) for a in avals[:n_params]] + list(inputs)
    passed = [static[i] for i in description.module_kept_var_idx]
    if any(p is None for p in passed):
        return None
    offset = 0 if platform_index is None else 1
    if platform_index is not None:
        passed.insert(0, ())
    kept = description.module_kept_var_idx
    bound = tuple(j + offset for j, i in enumerate(kept) if i < n_params) if bind_params else ()
    return compiler.Entry(name, tuple(passed), outputs, bound)  # type: ignore[arg-type]


def batch1_shapes(
    inputs: list[shapes.Aval], outputs: list[shapes.Aval], constraints: tuple[str, ...] = ()
) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]] | None:
    """The input and output shapes at batch 1 (:func:`batch_shapes`)."""
    return batch_shapes(inputs, outputs, constraints, 1)


def batch_shapes(
    inputs: list[shapes.Aval],
    outputs: list[shapes.Aval],
    constraints: tuple[str, ...] = (),
    size: int = 1,
) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]] | None:
    """The input and output shapes at batch ``size`` when ``inputs`` have exactly one dimension
    variable (a plain name) and the constraints allow it to be ``size``; else None."""
    name = shapes.dim_var(inputs)
    if name is None:
        return None
    env = {name: size}
    try:
        found = tuple(tuple(shapes.evaluate(str(d), env) for d in a.dims) for a in inputs)
        shapes.bind_dims(inputs, found, [str(a) for a in inputs], constraints)
    except (InputError, ValueError, KeyError, SyntaxError, ZeroDivisionError):
        return None
    resolved = tuple(_resolve(a, env) for a in outputs)
    if any(d is None for shape in resolved for d in shape):
        return None
    return found, resolved  # type: ignore[return-value]


def _static(aval: shapes.Aval) -> tuple[int, ...] | None:
    """The shape of a fixed-size aval; None if some dimension is symbolic."""
    return None if aval.symbolic else tuple(int(d) for d in aval.dims)


def _resolve(aval: shapes.Aval, env: dict[str, int]) -> tuple[int | None, ...]:
    """The shape of ``aval`` with its dimension expressions evaluated (None where they cannot
    be: the result's size is then only checked against its buffer)."""
    out: list[int | None] = []
    for d in aval.dims:
        if isinstance(d, int):
            out.append(d)
            continue
        try:
            out.append(shapes.evaluate(d, env))
        except (KeyError, ValueError, ZeroDivisionError, SyntaxError):
            out.append(None)
    return tuple(out)
