"""Turn a jitted JAX function plus example params and inputs into a ``jax.export.Exported``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.export  # jax < 0.8 does not import the submodule by itself

from jaxexp_mlflow.errors import UnsupportedModelError

BATCH_DIM = "b"


def as_args(input_example: Any) -> tuple:
    """Positional inputs from an input example: a tuple is the argument list, anything else is
    the single argument."""
    if input_example is None:
        return ()
    return tuple(input_example) if isinstance(input_example, tuple) else (input_example,)


def _spec(x: Any, batch: Any = None) -> jax.ShapeDtypeStruct:
    shape = tuple(getattr(x, "shape", ()))
    dtype = getattr(x, "dtype", None) or jax.numpy.result_type(x)
    if batch is not None and shape:
        shape = (batch, *shape[1:])
    return jax.ShapeDtypeStruct(shape, dtype)


def input_specs(args: tuple, *, batch_polymorphic: bool = True) -> tuple:
    """ShapeDtypeStructs for ``args``; with ``batch_polymorphic`` every array of rank >= 1 gets the
    same symbolic leading dimension ``b`` (inputs of one call share their batch size)."""
    batch = jax.export.symbolic_shape(BATCH_DIM)[0] if batch_polymorphic else None
    return jax.tree.map(lambda x: _spec(x, batch), args)


def export_function(
    fn: Callable,
    params: Any,
    input_example: Any,
    *,
    batch_polymorphic: bool = True,
    platforms: Sequence[str] | None = None,
) -> Any:
    """Export ``fn(params, *inputs)`` (or ``fn(*inputs)`` without params) against examples."""
    if input_example is None:
        raise UnsupportedModelError(
            "Exporting a function needs an input_example to learn the input shapes and dtypes: "
            "pass input_example=<a batch of inputs>, or export it yourself with jax.export.export "
            "and pass the Exported."
        )
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    args = input_specs(as_args(input_example), batch_polymorphic=batch_polymorphic)
    if params is not None:
        args = (jax.tree.map(_spec, params), *args)
    try:
        return jax.export.export(jitted, platforms=platforms)(*args)
    except Exception as err:
        hint = (
            " If the function needs a concrete batch size, pass batch_polymorphic=False."
            if batch_polymorphic
            else ""
        )
        raise UnsupportedModelError(
            f"jax.export could not export {getattr(fn, '__name__', fn)!r} for inputs "
            f"{[str(a) for a in jax.tree.leaves(args)]}: {err}.{hint}"
        ) from err


def argument_names(fn: Callable, *, has_params: bool) -> list[str]:
    """The names of ``fn``'s positional parameters after the params (``apply(params, tokens,
    mask)`` -> ``["tokens", "mask"]``), read with ``inspect.signature`` at export time.

    Stops at ``*args`` or the first keyword-only parameter; empty when the signature cannot be
    read (builtins, some C callables). Input leaves beyond these are named by position.
    """
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = []
    for p in sig.parameters.values():
        if p.kind not in kinds:
            break
        names.append(p.name)
    return names[1:] if has_params else names
