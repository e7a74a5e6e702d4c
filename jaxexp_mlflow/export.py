"""Turn a jitted JAX function plus example params and inputs into a ``jax.export.Exported``."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.export  # jax < 0.8 does not import the submodule by itself
import numpy as np

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


def batch_symbols(args: tuple) -> list[str | None]:
    """The symbolic leading dimension of each input leaf (None for a scalar): ``b`` for every
    leaf when the leading sizes of the example agree; otherwise one symbol per distinct leading
    size, in order of first appearance (``b``, ``b1``, ``b2``, ...): nodes ``[5, F]`` and edges
    ``[7]`` get ``b`` and ``b1``, and leaves of one size share theirs."""
    sizes = [np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(args)]
    order: list[int] = []
    for n in sizes:
        if n is not None and n not in order:
            order.append(n)
    names = {n: BATCH_DIM if i == 0 else f"{BATCH_DIM}{i}" for i, n in enumerate(order)}
    return [None if n is None else names[n] for n in sizes]


def looks_like_key(x: Any) -> bool:
    """Whether an input example leaf looks like one raw PRNG key: ``uint32[2]`` (threefry, as
    ``jax.random.PRNGKey`` makes it) or ``uint32[4]`` (rbg)."""
    if np.ndim(x) != 1 or np.shape(x)[0] not in (2, 4):
        return False
    dtype = getattr(x, "dtype", None)
    try:
        return (np.asarray(x).dtype if dtype is None else np.dtype(dtype)) == np.uint32
    except TypeError:  # a typed key array (key<fry>): refused later, with what to pass instead
        return False


def unbatched_leaves(args: tuple) -> list[bool]:
    """Which input leaves the example shows are one value for the whole batch: a raw PRNG key
    (:func:`looks_like_key`) beside batched inputs (rank >= 1, not keys) whose leading sizes
    agree with each other but not with the key's. Such a leaf keeps its concrete shape; every
    other leaf is as :func:`batch_symbols` names it.

    Args:
        args: the positional inputs of the example (:func:`as_args`).

    Returns:
        One flag per input leaf (``jax.tree.leaves`` order): True where it is one value.
    """
    leaves = jax.tree.leaves(args)
    keys = [looks_like_key(x) for x in leaves]
    sizes = {np.shape(x)[0] for x, k in zip(leaves, keys, strict=True) if np.ndim(x) and not k}
    if len(sizes) != 1:
        return [False] * len(leaves)
    (size,) = sizes
    return [k and np.shape(x)[0] != size for x, k in zip(leaves, keys, strict=True)]


def input_specs(
    args: tuple,
    *,
    batch_polymorphic: bool = True,
    polymorphic_shapes: Any = None,
    static: Sequence[bool] | None = None,
) -> tuple:
    """ShapeDtypeStructs for ``args``.

    ``polymorphic_shapes`` (``jax.export``'s shapes specification: one string per input, or a
    prefix pytree of them, e.g. ``("n, f", "e")``) names the symbolic dimensions of each input;
    it is checked against the example (``InputError`` naming the input and the dimension).
    Otherwise, with ``batch_polymorphic``, leading dimensions become symbols (:func:`batch_symbols`:
    one shared ``b`` when the example's leading sizes agree, one per distinct size otherwise),
    except for the leaves ``static`` marks (one flag per input leaf): those keep their shape.
    """
    if polymorphic_shapes is not None:
        return _user_specs(args, polymorphic_shapes)
    if not batch_polymorphic:
        return jax.tree.map(_spec, args)
    leaves, tree = jax.tree.flatten(args)
    static = list(static) if static is not None else [False] * len(leaves)
    names = batch_symbols(tuple(x for x, s in zip(leaves, static, strict=True) if not s))
    names_iter = iter(names)
    names = [None if s else next(names_iter) for s in static]
    scope = jax.export.SymbolicScope()
    dims = {n: jax.export.symbolic_shape(n, scope=scope)[0] for n in dict.fromkeys(names) if n}
    specs = [_spec(x, dims.get(n) if n else None) for x, n in zip(leaves, names, strict=True)]
    return jax.tree.unflatten(tree, specs)


def _leaf_labels(args: tuple) -> list[str]:
    """``args[0]``, ``args[1]['x']``, ...: how a message names each input leaf."""
    paths = jax.tree_util.tree_flatten_with_path(args)[0]
    return [f"input {jax.tree_util.keystr(p)}" for p, _ in paths]


def _user_specs(args: tuple, polymorphic_shapes: Any) -> tuple:
    """``jax.export.symbolic_args_specs`` for the user's shapes specification, its errors typed:
    which input, which dimension, what the example has there."""
    from jaxexp_mlflow.errors import InputError

    if isinstance(polymorphic_shapes, str) and len(args) == 1:
        polymorphic_shapes = (polymorphic_shapes,)
    if isinstance(polymorphic_shapes, list):
        polymorphic_shapes = tuple(polymorphic_shapes)
    try:
        specs = jax.export.symbolic_args_specs(args, polymorphic_shapes)
    except Exception as err:  # noqa: BLE001 - JAX's ValueError/TypeError: say it in our words
        raise InputError(
            f"polymorphic_shapes={polymorphic_shapes!r} does not fit the input example"
            f"{_failing_input(args, polymorphic_shapes)} "
            f"({_describe_inputs(args, False)}): {type(err).__name__}: {str(err)[:600]}. Give "
            "one shapes string per input (e.g. polymorphic_shapes=('n, ...', 'e') for inputs of "
            "shapes [N, F] and [E]), with as many dimensions as the input has ('...' for the "
            "rest); a dimension named twice must have one size in the example."
        ) from err
    _check_example_fits(args, specs)
    return specs


def _failing_input(args: tuple, polymorphic_shapes: Any) -> str:
    """`` at input [i] (float32[5, 4] against 'n, 3')`` for the first input whose own shapes
    string JAX refuses, when the specification has one entry per input; else empty."""
    if not isinstance(polymorphic_shapes, tuple) or len(polymorphic_shapes) != len(args):
        return ""
    for i, (arg, spec) in enumerate(zip(args, polymorphic_shapes, strict=True)):
        try:
            jax.export.symbolic_args_specs((arg,), (spec,))
        except Exception:  # noqa: BLE001 - this one is the culprit
            shapes = [f"{np.result_type(x)}{list(np.shape(x))}" for x in jax.tree.leaves(arg)]
            return f" at input [{i}] ({', '.join(shapes[:4])} against {spec!r})"
    return ""


def _check_example_fits(args: tuple, specs: tuple) -> None:
    """Each symbol of ``specs`` has one size across the example, and fixed dimensions match:
    else an ``InputError`` naming both places."""
    from jaxexp_mlflow.errors import InputError

    labels = _leaf_labels(args)
    seen: dict[str, tuple[int, str, int]] = {}
    for label, x, spec in zip(labels, jax.tree.leaves(args), jax.tree.leaves(specs), strict=True):
        shape = np.shape(x)
        if len(spec.shape) != len(shape):
            raise InputError(
                f"polymorphic_shapes gives {label} {len(spec.shape)} dimensions "
                f"({', '.join(map(str, spec.shape))}), but the input example has "
                f"{len(shape)} ({list(shape)}). Give one name per dimension, or '...' for "
                "the rest."
            )
        for axis, (dim, size) in enumerate(zip(spec.shape, shape, strict=True)):
            if isinstance(dim, int):
                if dim != size:
                    raise InputError(
                        f"polymorphic_shapes: {label} dimension {axis} is fixed to {dim}, but the "
                        f"input example has {size} there. Name it with a symbol, or pass an "
                        "example of that size."
                    )
                continue
            name = str(dim)
            if not name.isidentifier():
                continue  # an expression (2*n, n + 1): JAX checks it when exporting
            if name in seen and seen[name][0] != size:
                first_size, first_label, first_axis = seen[name]
                raise InputError(
                    f"polymorphic_shapes names dimension {axis} of {label} {name!r}, as it names "
                    f"dimension {first_axis} of {first_label}, but the input example has "
                    f"{size} and {first_size} there: one symbol has one size per call. Give "
                    "them different symbols if they may differ, or fix the example."
                )
            seen.setdefault(name, (size, label, axis))


def export_function(
    fn: Callable,
    params: Any,
    input_example: Any,
    *,
    batch_polymorphic: bool = True,
    platforms: Sequence[str] | None = None,
    polymorphic_shapes: Any = None,
    announce: bool = True,
    arg_names: Sequence[str] | None = None,
) -> Any:
    """Export ``fn(params, *inputs)`` (or ``fn(*inputs)`` without params) against examples
    (symbolic dimensions: :func:`input_specs`).

    An input that is one value for the whole batch (a PRNG key ``uint32[2]`` beside batched
    inputs, as samplers and tree searches take it) keeps its concrete shape: where the example
    shows it (:func:`unbatched_leaves`), or where tracing with a symbolic leading dimension
    fails for that input alone (each input leaf tried once). The choice is logged (unless
    ``announce`` is False: a second export of the same function, said once already), naming
    the inputs by ``arg_names`` (the user's function's parameters after the params, where
    ``fn`` wraps it) or by ``fn``'s own. Where
    no single input explains the failure, or several do, the ``UnsupportedModelError`` names
    the ``polymorphic_shapes`` to give (e.g. ``(None, "b, ...")``).
    """
    if input_example is None:
        raise UnsupportedModelError(
            "Exporting a function needs an input_example to learn the input shapes and dtypes: "
            "pass input_example=<a batch of inputs> (or jax.ShapeDtypeStruct leaves: shapes "
            "only, no reference result stored), or export it yourself with jax.export.export "
            "and pass the Exported."
        )
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    example = as_args(input_example)
    auto = batch_polymorphic and polymorphic_shapes is None
    static = unbatched_leaves(example) if auto else None

    def specs(flags: Sequence[bool] | None) -> tuple:
        args = input_specs(
            example,
            batch_polymorphic=batch_polymorphic,
            polymorphic_shapes=polymorphic_shapes,
            static=flags,
        )
        return args if params is None else (jax.tree.map(_spec, params), *args)

    args = specs(static)
    try:
        exp = jax.export.export(jitted, platforms=platforms)(*args)
    except Exception as err:
        failed = export_error(
            fn,
            jitted,
            args,
            err,
            batch_polymorphic=batch_polymorphic,
            has_params=params is not None,
        )
        callback = "calls back into the Python host" in failed.message  # export_error's word
        if not auto or callback or not _about_batch(str(err), args):
            raise failed from err
        exp, static = _static_retry(jitted, platforms, example, static, specs, failed, err)
    if announce and static is not None and any(static):
        _logger.warning(
            "jaxexp: %s of %r is one value for the whole batch (not batched): exported at its "
            "concrete shape, recorded with batched: false in MLmodel's io, sent once per "
            "request and never split or padded. Spelled out, this is polymorphic_shapes=%s.",
            ", ".join(
                label
                for label, s in zip(
                    _named_labels(fn, example, params, arg_names), static, strict=True
                )
                if s
            ),
            getattr(fn, "__name__", None) or type(fn).__name__,
            _shapes_hint(example, static),
        )
    return exp


_logger = logging.getLogger(__name__)


def _named_labels(
    fn: Callable, example: tuple, params: Any, arg_names: Sequence[str] | None = None
) -> list[str]:
    """``input 'key'``, ``input 'batch'['x']``: each input leaf by the function's parameter
    name (``arg_names``, else :func:`argument_names` of ``fn``), else by position."""
    names = list(arg_names or argument_names(fn, has_params=params is not None))
    labels = []
    for path, _ in jax.tree_util.tree_flatten_with_path(example)[0]:
        first = getattr(path[0], "idx", None) if path else None
        if isinstance(first, int) and first < len(names):
            labels.append(f"input {names[first]!r}{jax.tree_util.keystr(path[1:])}")
        else:
            labels.append(f"input {jax.tree_util.keystr(path)}")
    return labels


#: Input leaves tried one at a time as unbatched after an export with every leading
#: dimension symbolic fails (each try is one trace of the function).
MAX_STATIC_TRIES = 16


def _static_retry(
    jitted: Callable,
    platforms: Sequence[str] | None,
    example: tuple,
    static: list[bool],
    specs: Callable[[Sequence[bool]], tuple],
    failed: UnsupportedModelError,
    err: Exception,
) -> tuple[Any, list[bool]]:
    """The export with one more input leaf kept static, where exactly one such leaf makes it
    succeed; else ``failed`` with the ``polymorphic_shapes`` to give added."""
    leaves = jax.tree.leaves(example)
    tries = [i for i, x in enumerate(leaves) if np.ndim(x) and not static[i]]
    fixes: list[tuple[list[bool], Any]] = []
    if len(tries) > 1:  # one batched input: keeping it static is batch_polymorphic=False
        for i in tries[:MAX_STATIC_TRIES]:
            flags = [s or j == i for j, s in enumerate(static)]
            try:
                fixes.append((flags, jax.export.export(jitted, platforms=platforms)(*specs(flags))))
            except Exception:  # noqa: BLE001 - this input is not the one
                continue
    if len(fixes) == 1:
        return fixes[0][1], fixes[0][0]
    if fixes:
        options = " or ".join(f"polymorphic_shapes={_shapes_hint(example, f)}" for f, _ in fixes)
        advice = (
            f" Keeping any one of several inputs unbatched makes the export succeed, so the "
            f"flavor cannot tell which is one value for the whole batch: pass {options}."
        )
    else:
        guess = [s or looks_like_key(x) for s, x in zip(static, leaves, strict=True)]
        advice = (
            " If some inputs are one value for the whole batch (a PRNG key, a shared table), "
            "say which with one shapes string per input, None for those: e.g. "
            f"polymorphic_shapes={_shapes_hint(example, guess)}."
        )
    raise UnsupportedModelError(failed.message + advice) from err


def _shapes_hint(example: tuple, static: Sequence[bool]) -> str:
    """``(None, 'b, ...')``: the ``polymorphic_shapes`` of one entry per input that keeps the
    inputs marked ``static`` (all of an input's leaves) concrete and batches the others."""
    leaves = jax.tree.leaves(example)
    names = iter(batch_symbols(tuple(x for x, s in zip(leaves, static, strict=True) if not s)))
    flags = iter(static)
    parts = []
    for arg in example:
        mine = jax.tree.leaves(arg)
        syms = [None if next(flags) else next(names) for _ in mine]
        batched = bool(mine) and all(syms)
        parts.append(f"'{syms[0]}, ...'" if batched else "None")
    return f"({', '.join(parts)},)" if len(parts) == 1 else f"({', '.join(parts)})"


def _about_batch(text: str, args: tuple) -> bool:
    """Whether an export failure is about the symbolic dimensions: a shape naming one of the
    symbols of ``args``, or jax's words for them (a mismatch of concrete shapes is not)."""
    syms = {str(d) for a in jax.tree.leaves(args) for d in a.shape if not isinstance(d, int)}
    return any(
        word in text for word in ("symbolic", "polymorphic", "Inconclusive", "dimension variable")
    ) or any(re.search(rf"\b{re.escape(sym)}\b", text) for sym in syms)


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
    syms = sorted(
        {str(d) for a in jax.tree.leaves(args) for d in a.shape if not isinstance(d, int)}
    )
    # the batch hint where the failure is about the symbolic batch (a shape naming a symbol,
    # or jax's words for it); a mismatch of concrete shapes (params of the wrong shape) is not
    about_batch = _about_batch(str(err), args)
    hint = (
        " If the function needs a concrete batch size, pass batch_polymorphic=False."
        if batch_polymorphic and about_batch
        else ""
    )
    if len(syms) > 1:
        hint += (
            f" The inputs' leading dimensions got the symbols {syms} (one per distinct size in "
            "the input example): if the function needs some of them equal, say so with "
            "polymorphic_shapes (e.g. ('n, ...', 'n')), or give an example whose sizes agree."
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
