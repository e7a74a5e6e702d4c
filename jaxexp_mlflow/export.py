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
            "pass input_example=<a batch of inputs> (or jax.ShapeDtypeStruct leaves: shapes "
            "only, no reference result stored), or export it yourself with jax.export.export "
            "and pass the Exported."
        )
    if platforms is not None:
        from jaxexp_mlflow.runtime.platforms import canonical

        platforms = tuple(canonical(p) for p in platforms)  # jax.export's names: cuda, not gpu
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    args = input_specs(as_args(input_example), batch_polymorphic=batch_polymorphic)
    if params is not None:
        args = (jax.tree.map(_spec, params), *args)
    try:
        return jax.export.export(jitted, platforms=platforms)(*args)
    except Exception as err:
        raise export_error(
            fn,
            jitted,
            args,
            err,
            batch_polymorphic=batch_polymorphic,
            has_params=params is not None,
        ) from err


#: Primitives that call back into the Python host: jax.export cannot serialize them.
HOST_CALLBACKS = frozenset({"debug_callback", "pure_callback", "io_callback", "callback"})


def _sub_jaxprs(value: Any) -> list[Any]:
    """The jaxprs inside one equation parameter (a Jaxpr, a ClosedJaxpr, or tuples of them)."""
    if hasattr(value, "eqns"):
        return [value]
    inner = getattr(value, "jaxpr", None)
    if inner is not None and hasattr(inner, "eqns"):
        return [inner]
    if isinstance(value, tuple | list):
        return [j for v in value for j in _sub_jaxprs(v)]
    return []


def _callback_module(eqn: Any) -> str:
    """The module of the Python function a callback equation calls, where jax records it."""
    callback = eqn.params.get("callback")
    func = getattr(callback, "callback_func", callback)
    return str(getattr(func, "__module__", "") or "")


def host_callbacks(jitted: Callable, args: tuple) -> list[tuple[str, str]]:
    """The host callbacks ``jitted(*args)`` traces to (nested jaxprs included): (primitive,
    module of the called function), each pair once; empty when there are none or tracing
    itself fails."""
    try:
        closed = jax.make_jaxpr(jitted)(*args)
    except Exception:  # the export's own error is then the one to report
        return []
    found: list[tuple[str, str]] = []
    stack, seen = [closed.jaxpr], 0
    while stack and seen < 100_000:
        jaxpr = stack.pop()
        for eqn in jaxpr.eqns:
            seen += 1
            name = eqn.primitive.name
            if name in HOST_CALLBACKS and (name, _callback_module(eqn)) not in found:
                found.append((name, _callback_module(eqn)))
            for value in eqn.params.values():
                stack.extend(_sub_jaxprs(value))
    return found


def _describe_inputs(args: tuple, has_params: bool) -> str:
    """The export's inputs in a few words: the params as a count, the inputs by aval."""
    leaves = [jax.tree.leaves(a) for a in args]
    inputs = [f"{x.dtype}{list(x.shape)}" for a in leaves[1 if has_params else 0 :] for x in a]
    shown = ", ".join(inputs[:8]) + (f", ... ({len(inputs)} in all)" if len(inputs) > 8 else "")
    if has_params and args:
        return f"{len(leaves[0])} params leaves and inputs [{shown}]"
    return f"inputs [{shown}]"


def export_error(
    fn: Callable,
    jitted: Callable,
    args: tuple,
    err: Exception,
    *,
    batch_polymorphic: bool,
    has_params: bool,
) -> UnsupportedModelError:
    """The error of a failed export, its real cause first.

    A function calling back into Python (``jax.debug.callback``/``print``, ``pure_callback``,
    ``io_callback``; Equinox's ``eqx.error_if`` and the solvers built on it) cannot be
    serialized; jax says so in words that do not name the callback (``NotImplementedError:
    serialization of host_callbacks``, or ``std::bad_cast`` under symbolic shapes). Params are
    counted, not listed.
    """
    name = getattr(fn, "__name__", None) or type(fn).__name__
    what = _describe_inputs(args, has_params)
    reason = f"{type(err).__name__}: {str(err)[:1000]}"
    callbacks = host_callbacks(jitted, args)
    if callbacks:
        from_equinox = any(module.split(".")[0] == "equinox" for _, module in callbacks)
        kinds = sorted({prim for prim, _ in callbacks})
        cause = (
            "Equinox's eqx.error_if / eqx.branched_error_if (runtime checks; diffrax and "
            "optimistix solvers use them) call back unless EQX_ON_ERROR is set in the environment "
            "before equinox is imported: export with EQX_ON_ERROR=nan (a failed check then gives "
            "NaN outputs; its NaN fill needs concrete shapes, so also pass "
            "batch_polymorphic=False) or EQX_ON_ERROR=off (the checks are dropped)."
            if from_equinox
            else "Remove jax.debug.callback/jax.debug.print, jax.pure_callback and io_callback "
            "from the exported function (keep them in the training code)."
        )
        return UnsupportedModelError(
            f"jax.export cannot serialize {name!r}: it calls back into the Python host "
            f"({', '.join(kinds)}), and host callbacks cannot be serialized. {cause} "
            f"[{what}; jax said {reason}]"
        )
    hint = (
        " If the function needs a concrete batch size, pass batch_polymorphic=False."
        if batch_polymorphic
        else ""
    )
    return UnsupportedModelError(
        f"jax.export could not export {name!r} for {what}: {reason}.{hint}"
    )


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
