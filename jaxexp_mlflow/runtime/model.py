"""The loaded model: an ``Exported`` with its params bound, callable like the original function."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxexp_mlflow.errors import (
    IncompatibleError,
    InputError,
    ParamsMismatchError,
    UnsupportedTransformError,
)
from jaxexp_mlflow.internals import jax_private
from jaxexp_mlflow.runtime import chunks, cpu_compile


def _guard_vjp(exported: Any, vjp_order: int, level: int = 0) -> Any:
    """Replace JAX's bare "No VJP is available" past ``vjp_order`` with an actionable error."""
    inner = jax_private.get_vjp(exported)
    if inner is not None and level < vjp_order:
        return jax_private.with_vjp(exported, lambda e: _guard_vjp(inner(e), vjp_order, level + 1))

    def refuse(_: Any) -> Any:
        raise IncompatibleError(
            f"This model was saved with vjp_order={vjp_order}, so it can be differentiated at "
            f"most {vjp_order} time(s); order {level + 1} was requested. Save it again with "
            f"vjp_order>={level + 1} (log_model(..., vjp_order={level + 1}))."
        )

    return jax_private.with_vjp(exported, refuse)


def _tracer_kinds(tree: Any) -> set[str]:
    """Class names (and base names) of the JAX tracers among the leaves of ``tree``."""
    return {
        c.__name__
        for x in jax.tree.leaves(tree)
        if isinstance(x, jax.core.Tracer)
        for c in type(x).__mro__
    }


def transform_error(err: Exception, args: Any, vjp_order: int) -> Exception | None:
    """The actionable error for a JAX transformation the exported function cannot go through.

    ``jax.export`` serializes reverse-mode derivatives only (up to ``vjp_order``), and its
    ``call_exported`` primitive has no batching rule: ``jvp``/``jacfwd``/``hessian`` and ``vmap``
    of a loaded model fail inside JAX with messages that do not say so. ``None`` when ``err`` is
    not one of those (e.g. a real shape mismatch).
    """
    text = str(err)
    if "Batching rule for 'call_exported'" in text or (
        isinstance(err, NotImplementedError) and "BatchTracer" in _tracer_kinds(args)
    ):
        return UnsupportedTransformError(
            "jax.vmap of a loaded jaxexp model is not possible: jax.export's call_exported has no "
            "batching rule. A model exported batch-polymorphic (leading dimension symbolic, the "
            "default) already takes a batch: call it on the stacked inputs. Otherwise loop over "
            "the examples, or use jax.lax.map(model, xs)."
        )
    if "forward-mode" in text or "Differentiation rule for 'call_exported'" in text:
        how = (
            f"use reverse mode instead: jax.grad or jax.vjp, nested up to {vjp_order} time(s) "
            f"(this model was saved with vjp_order={vjp_order})"
            if vjp_order > 0
            else "save it again with vjp_order>=1 (it was saved with vjp_order=0, so it cannot "
            "be differentiated at all) and use jax.grad or jax.vjp"
        )
        return UnsupportedTransformError(
            "Forward-mode differentiation (jax.jvp, jax.jacfwd, jax.hessian, jax.linearize) of a "
            "loaded jaxexp model is not possible: jax.export serializes reverse-mode derivatives "
            f"only. To differentiate it, {how}. jax.jacrev cannot be used either (it vmaps the "
            "pullback); for a full Jacobian apply the jax.vjp pullback to each basis vector with "
            "jax.lax.map (docs/transforms.md)."
        )
    return None


#: Input signatures whose compile options a model remembers (then it stops choosing).
_MAX_ROUTES = 64


def _concrete(x: Any) -> bool:
    """Whether ``x`` is a numpy array or a JAX array with a value (not a tracer)."""
    return type(x) is np.ndarray or (
        isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
    )


def _rows_layout(inputs: tuple, kwargs: dict) -> tuple[int, tuple] | None:
    """``(rows, the signature without them)`` where every input leaf is an array (a plain
    dtype) with the same number of rows along axis 0; else None (not cut into chunks)."""
    leaves, tree = jax.tree.flatten((inputs, kwargs))
    if not leaves or not all(isinstance(x.dtype, np.dtype) and x.ndim >= 1 for x in leaves):
        return None  # e.g. typed PRNG keys: not cut
    n = leaves[0].shape[0]
    if any(x.shape[0] != n for x in leaves):
        return None
    return n, (tree, *((x.shape[1:], x.dtype) for x in leaves))


def _signature(inputs: tuple, kwargs: dict, leaf_ok: Any = _concrete) -> tuple | None:
    """The shapes and dtypes of concrete array inputs (None for tracers or other leaves: those
    take the default path). One positional array, the common call, skips the tree walk.
    ``leaf_ok``: which leaves have a key (see :func:`_spec_key`)."""
    if not kwargs and len(inputs) == 1:
        x = inputs[0]
        return (x.shape, x.dtype) if leaf_ok(x) else None
    leaves, tree = jax.tree.flatten((inputs, kwargs))
    if not all(leaf_ok(x) for x in leaves):
        return None
    return (tree, *((x.shape, x.dtype) for x in leaves))


def _spec_key(inputs: tuple, kwargs: dict) -> tuple:
    """:func:`_signature` of ``jax.ShapeDtypeStruct`` inputs (a size compiled ahead of its
    call): the key arrays of those shapes and dtypes will have."""
    return _signature(inputs, kwargs, leaf_ok=lambda _: True)


class _ChosenRoute:
    """An input signature's executable compiled with options of its own (``runtime.cpu_compile``:
    reductions off YNNPACK, loop-invariant converts left in their loops), called as compiled;
    arguments it does not take as given (another weak type) go to a jit with the same
    options."""

    __slots__ = ("compiled", "jitted")

    def __init__(self, compiled: Any, jitted: Any) -> None:
        self.compiled, self.jitted = compiled, jitted

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.compiled(*args, **kwargs)
        except TypeError:
            return self.jitted(*args, **kwargs)


class JaxExpModel:
    """An exported JAX function with its parameters bound.

    ``model(*inputs, **kw)`` calls the export with the stored params as first argument (when the
    model has params), through one ``jax.jit``-compiled callable kept per model: a bare
    ``Exported.call`` outside jit costs 2-3x more at small batch sizes.

    ``params`` of a model saved by this version is a dict ``{name: jax.Array}`` in the export's
    leaf order, named by the attribute paths of the params the model was logged with
    (``l1.kernel``, ``layers[0].weight``), typed PRNG keys rebuilt; ``call_with_params`` takes
    the same dict. Older models give back the export's params tree. See
    docs/model-families.md.

    A model is built by ``load_model``; building one directly is for the flavor's own save path.

    Args:
        exported: the deserialized ``jax.export.Exported``.
        params: the params tree (or ``{name: array}`` dict) bound as the export's first
            argument; None for a model saved without params.
        metadata: the model's MLmodel ``jaxexp`` section (names, avals, ``vjp_order``).
        vjp_order: how many times the model may be differentiated; default: the metadata's.
        placement: the devices and shardings chosen by the loader; None: one device, or a plan
            made here for a multi-device export.

    Attributes:
        exported: the ``Exported``, its VJPs refused beyond ``vjp_order``.
        params: the bound params, placed on the model's devices.
        metadata: the MLmodel ``jaxexp`` section the model was loaded with.
        placement: the device placement, or None.
        verdict: the compatibility verdict the loader reached, or None.
        has_params: whether the model has params bound.
    """

    def __init__(
        self,
        exported: Any,
        params: Any = None,
        metadata: dict[str, Any] | None = None,
        *,
        vjp_order: int | None = None,
        placement: Any = None,
    ) -> None:
        self.metadata = dict(metadata or {})
        order = self.metadata.get("vjp_order", 0) if vjp_order is None else vjp_order
        self.exported = _guard_vjp(exported, int(order))
        self._param_names = None
        if params is not None and self.metadata.get("param_names") is not None:
            params = self._named(params)
        if placement is None and int(getattr(exported, "nr_devices", 1)) > 1:
            # built directly (e.g. at save time) rather than by the loader: place it here, and
            # move the params into the shardings the export expects
            from jaxexp_mlflow.runtime import devices

            placement = devices.plan(self.exported)
            if params is not None:
                n = len(jax.tree.leaves(params))
                shardings = list(placement.in_shardings[:n])
                if self._param_names is not None:
                    shardings = dict(zip(self._param_names, shardings, strict=True))
                else:
                    shardings = jax.tree.unflatten(jax.tree.structure(params), shardings)
                params = jax.device_put(params, shardings)
        if self._param_names is not None:
            from jaxexp_mlflow.params.names import wrap_keys

            params = wrap_keys(params, self.metadata.get("param_keys"))
        self.params = params
        self.placement = placement
        self.verdict: Any = None  # the compat.Verdict the loader reached, if loaded from disk
        # the blob's custom-call targets as its own bytes say (set by the loader; None: unknown)
        self.custom_call_targets: tuple[str, ...] | None = None
        self.has_params = params is not None
        self._in_shardings = tuple(placement.in_shardings) if placement is not None else ()
        self._n_param_leaves = len(jax.tree.leaves(params)) if self.has_params else 0
        # decided once: most models need no input placement, keep their call path bare
        self._places_inputs = placement is not None and (
            placement.data_parallel
            or any(s is not None for s in self._in_shardings[self._n_param_leaves :])
        )
        self._jit_call = jax.jit(self._raw_call)
        self._jit_call_with_params = jax.jit(self._raw_call)
        # XLA:CPU's compile options per input signature (runtime.cpu_compile); None: not chosen
        self._routes: dict[tuple, Any] | None = None
        self._option_calls: dict[tuple, Any] = {}  # a jit per set of compile options
        self._cuttable: bool | None = None  # big batches may run in chunks (decided once)
        # a signature without its rows -> (the fewest rows cut, that cut): more rows, cut alike
        self._cuts: dict[tuple, tuple[int, Any]] = {}
        if cpu_compile.enabled() and not self._places_inputs and self.platform == "cpu":
            self._routes = {}

    @property
    def platform(self) -> str:
        """The platform the model runs on, as ``jax.export`` names it (``cuda``, not ``gpu``).

        Returns:
            ``cpu``, ``cuda``, ``rocm`` or ``tpu``: the placement's platform, or the running
                platform when the model has no placement.
        """
        if self.placement is not None:
            return str(self.placement.platform)
        from jaxexp_mlflow.runtime.platforms import running_platform

        return running_platform()

    def _named(self, params: Any) -> dict[str, Any]:
        """The params as ``{name: array}`` in the export's leaf order (see params.names)."""
        from jaxexp_mlflow.store import artifact

        treedef = artifact.params_treedef(self.exported)
        names = artifact.param_names(self.metadata, treedef.num_leaves)
        self._param_names = names
        if not isinstance(params, dict) or set(params) != set(names):
            if jax.tree.structure(params) != treedef:
                raise ParamsMismatchError(
                    f"params: expected a dict with the names {names[:8]}... or the export's "
                    f"params tree {treedef}, found {jax.tree.structure(params)}. Pass a dict "
                    "like model.params."
                )
            params = dict(zip(names, jax.tree.leaves(params), strict=True))  # a copied tree
        return {name: params[name] for name in names}

    def export_arg(self, params: Any) -> Any:
        """The export's first argument from ``params`` shaped like ``model.params``.

        Args:
            params: a dict ``{name: array}`` like ``model.params`` (or, for older models, the
                export's params tree).

        Returns:
            The params tree the exported function takes as its first argument.
        """
        if self._param_names is None:
            return params
        from jaxexp_mlflow.params.names import export_arg
        from jaxexp_mlflow.store import artifact

        treedef = artifact.params_treedef(self.exported)
        avals = self.exported.in_avals[: treedef.num_leaves]
        return export_arg(params, self._param_names, treedef, avals)

    def _raw_call(self, params: Any, *inputs: Any, **kwargs: Any) -> Any:
        if self.has_params:
            return self.exported.call(self.export_arg(params), *inputs, **kwargs)
        return self.exported.call(*inputs, **kwargs)

    def _place(self, inputs: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Put the inputs on the placement's devices/shardings (params are placed at load)."""
        leaves, tree = jax.tree.flatten((inputs, kwargs))
        placed = self.placement.place_inputs(leaves, self._n_param_leaves)
        return jax.tree.unflatten(tree, placed)

    def _explain(self, err: Exception, inputs: tuple, kwargs: dict) -> InputError:
        expected = self.metadata.get("in_avals") or [str(a) for a in self.exported.in_avals]
        expected = expected[self._n_param_leaves :]
        found = [
            f"{getattr(x, 'dtype', type(x).__name__)}{list(getattr(x, 'shape', ()))}"
            for x in jax.tree.leaves((inputs, kwargs))
        ]
        return InputError(
            f"The inputs do not match the exported function {self.exported.fun_name!r}: "
            f"expected {expected}, found {found}. Pass arrays of those dtypes and shapes "
            f"(a symbolic dimension may take any size, one size wherever it appears: inputs "
            f"sharing a symbol share that size). JAX said: {err}"
        )

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the model on ``inputs`` with the bound params.

        Differentiable with ``jax.grad``/``jax.vjp`` up to the model's ``vjp_order``.

        Args:
            *inputs: the exported function's inputs after its params (arrays or pytrees).
            **kwargs: its keyword inputs, if it was exported with any.

        Returns:
            The exported function's output pytree.

        Raises:
            InputError: the inputs do not match the exported dtypes and shapes (the message
                gives what was expected and what was found).
            UnsupportedTransformError: a JAX transformation the export cannot go through
                (``vmap``, forward-mode ``jvp``, or a derivative beyond ``vjp_order``).
        """
        if self._places_inputs:
            inputs, kwargs = self._place(inputs, kwargs)
        call = self._jit_call
        if self._routes is not None:
            key = _signature(inputs, kwargs)
            if key is not None:
                call = self._routes.get(key) or self._route(key, inputs, kwargs)
        try:
            return call(self.params, *inputs, **kwargs)
        except (TypeError, ValueError, NotImplementedError) as err:
            order = int(self.metadata.get("vjp_order", 0))
            transform = transform_error(err, (inputs, kwargs), order)
            if transform is not None:
                raise transform from err
            if isinstance(err, NotImplementedError):
                raise
            raise self._explain(err, inputs, kwargs) from err

    def _route(self, key: tuple, inputs: tuple, kwargs: dict) -> Any:
        """The jitted callable for a new input signature on the CPU: XLA's defaults, or the
        options ``runtime.cpu_compile`` chooses; for a big batch of rows proven independent
        whose temporaries pass the budget, that call in chunks (``runtime/chunks.py``). Past
        :data:`_MAX_ROUTES` signatures, XLA's defaults without a choice (no lowering per call)."""
        if len(self._routes) >= _MAX_ROUTES:
            return self._jit_call
        layout = _rows_layout(inputs, kwargs) if self._cuts else None
        if layout is not None and chunks.budget() > 0:
            known = self._cuts.get(layout[1])
            if known is not None and layout[0] >= known[0]:  # temporaries grow with the rows
                self._routes[key] = known[1]  # cut alike, without compiling the whole batch
                return known[1]
        try:
            call, temp = self._compiled(key, inputs, kwargs)
        except Exception:  # noqa: BLE001 - a bad input: the call below raises it as usual
            return self._jit_call
        chunked = self._chunked(inputs, kwargs, temp)
        if chunked is not None:
            call = self._routes[key] = chunked
        return call

    def _compiled(self, key: tuple, inputs: tuple, kwargs: dict) -> tuple[Any, int | None]:
        """Compile signature ``key`` (``inputs`` arrays or ``jax.ShapeDtypeStruct``) as
        ``runtime.cpu_compile`` chooses; its route (kept) and its temporaries in bytes."""
        lowered = self._jit_call.lower(self.params, *inputs, **kwargs)
        compiled, options = cpu_compile.compile_lowered(lowered)
        # the default executable is the one the jit's own call finds in memory; one compiled
        # with options would be compiled again by a jit with those options: called as compiled
        call = self._jit_call
        if options:
            key_options = tuple(sorted(options.items()))
            jitted = self._option_calls.get(key_options)
            if jitted is None:
                jitted = jax.jit(self._raw_call, compiler_options=dict(options))
                self._option_calls[key_options] = jitted
            call = _ChosenRoute(compiled, jitted)
        self._routes[key] = call
        return call, cpu_compile.temp_bytes(compiled)

    def _rows_cuttable(self) -> bool:
        """Whether a big batch may run in chunks (``runtime/chunks.py``): rows proven
        independent at save (MLmodel ``jaxexp.padding``), one symbolic leading dimension on
        every input and output, and no loop in the module."""
        if self._cuttable is None:
            from jaxexp_mlflow.runtime import buckets

            padding = self.metadata.get("padding")
            avals = list(self.exported.in_avals)[self._n_param_leaves :]
            self._cuttable = bool(
                isinstance(padding, dict)
                and padding.get("rows_independent") is True
                and avals
                and buckets.batch_symbol(
                    [buckets.aval_symbols(a) for a in avals],
                    [buckets.aval_symbols(a) for a in self.exported.out_avals],
                )
                is not None
                and not buckets.has_loop(self.exported)
            )
        return self._cuttable

    def _chunked(self, inputs: tuple, kwargs: dict, temp: int | None) -> Any:
        """These inputs' call in chunks (``runtime.chunks.RowChunks`` over the route of a
        smaller power of two rows) when their executable's temporaries (``temp`` bytes) exceed
        ``runtime.chunks.budget()`` and such a size fits it; None: whole. Each size tried is
        compiled once and kept as its own route; the cut is kept for bigger batches alike."""
        limit = chunks.budget()
        if limit <= 0 or temp is None or temp <= limit or not self._rows_cuttable():
            return None
        layout = _rows_layout(inputs, kwargs)
        if layout is None or layout[0] <= 1:
            return None
        n, rest = layout
        leaves, tree = jax.tree.flatten((inputs, kwargs))

        def shaped(rows: int) -> tuple[tuple, dict]:
            specs = [jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype) for x in leaves]
            return jax.tree.unflatten(tree, specs)

        def temp_of(rows: int) -> int | None:
            if rows == n:
                return temp
            args, kw = shaped(rows)
            try:
                return self._compiled(_spec_key(args, kw), args, kw)[1]
            except Exception:  # noqa: BLE001 - that size does not compile: not cut
                return None

        plan = chunks.ChunkPlan(chunks.POWERS, temp_of, limit, tries=chunks.IN_PROCESS_TRIES)
        rows = plan.rows(n)
        if rows >= n:
            return None
        cut = chunks.RowChunks(self._routes[_spec_key(*shaped(rows))], rows)
        if rest not in self._cuts or n < self._cuts[rest][0]:
            self._cuts[rest] = (n, cut)
        return cut

    def call_with_params(self, params: Any, *inputs: Any, **kwargs: Any) -> Any:
        """Run with other ``params`` shaped like ``model.params``, e.g. to differentiate wrt
        them.

        Args:
            params: a dict ``{name: array}`` with the names, dtypes and shapes of
                ``model.params``.
            *inputs: the exported function's inputs after its params.
            **kwargs: its keyword inputs, if it was exported with any.

        Returns:
            The exported function's output pytree.

        Raises:
            InputError: the model was saved without params.
            ParamsMismatchError: ``params`` does not have the model's names and structure.
            UnsupportedTransformError: a JAX transformation the export cannot go through.
        """
        if not self.has_params:
            raise InputError(
                "This model was saved without params, so there are none to replace: "
                "call it as model(*inputs) instead."
            )
        try:
            return self._jit_call_with_params(params, *inputs, **kwargs)
        except (TypeError, ValueError, NotImplementedError) as err:
            order = int(self.metadata.get("vjp_order", 0))
            transform = transform_error(err, (params, inputs, kwargs), order)
            if transform is not None:
                raise transform from err
            raise

    def __repr__(self) -> str:
        meta = self.metadata
        return (
            f"JaxExpModel({self.exported.fun_name!r}, in={meta.get('in_avals')}, "
            f"out={meta.get('out_avals')}, platforms={list(self.exported.platforms)})"
        )
