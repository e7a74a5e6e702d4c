"""``JaxExpPyfunc``: the object ``mlflow.pyfunc`` calls for a jaxexp model.

It holds a loaded ``JaxExpModel`` and turns every form of the input contract
(``serving/inputs.py``) into its input leaves, runs them in batch buckets (padded only where the
rows are proven independent, precompiled in the background where asked) and answers numpy.
It lives apart from ``serving/pyfunc.py``, which loads it once per process (identity, cache,
registry) and parses the scoring server's requests for it; that module re-exports it.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

import numpy as np

from jaxexp_mlflow import settings
from jaxexp_mlflow.errors import ArtifactError
from jaxexp_mlflow.runtime import buckets as buckets_mod
from jaxexp_mlflow.runtime import executables as executables_mod
from jaxexp_mlflow.serving import background, serving_guard
from jaxexp_mlflow.serving.inputs import (
    InputContract,
    convert,
    is_ml_float,
)
from jaxexp_mlflow.serving.signature import LeafSpec

_logger = logging.getLogger("jaxexp_mlflow.serving.pyfunc")  # the name it always logged under

ENV_MAX_REQUEST_BYTES = "JAXEXP_MAX_REQUEST_BYTES"
DEFAULT_MAX_REQUEST_BYTES = 64 * 1024 * 1024


class JaxExpPyfunc:
    """Wraps a ``JaxExpModel`` for ``mlflow.pyfunc``: input conversion, buckets, numpy output."""

    def __init__(
        self,
        model: Any,
        model_config: dict[str, Any] | None = None,
        *,
        inputs: list[LeafSpec] | None = None,
        outputs: list[LeafSpec] | None = None,
        saved_config: dict[str, Any] | None = None,
        classifier: dict[str, Any] | None = None,
        serving: bool = False,
        rows_independent: bool = False,
    ) -> None:
        from jaxexp_mlflow.serving import signature

        self.model = model
        self.classifier = classifier
        self.model_config = dict(model_config or {})
        saved = dict(saved_config or {})
        iree = getattr(model, "backend", "jax") == "iree"
        if inputs is None or outputs is None:
            if iree:
                raise ArtifactError(
                    "This model records no input/output specs (MLmodel 'io', written by "
                    "save_model since jaxexp-mlflow 0.1), which the IREE backend needs. Run "
                    "`jaxexp refresh` on it once, or serve it with the JAX backend."
                )
            inputs, outputs = signature.leaf_specs(model.exported, has_params=model.has_params)
        self.inputs = inputs
        self.outputs = outputs
        self._names = [s.name for s in inputs]
        allow = self.model_config.get(
            "allow_nan", settings.JAXEXP_ALLOW_NAN.get(saved.get("allow_nan"))
        )
        self.allow_nan = str(allow).lower() in ("1", "true", "on", "yes")
        self.contract = InputContract(inputs, allow_nan=self.allow_nan)
        self.max_request_bytes = int(
            self.model_config["max_request_bytes"]
            if "max_request_bytes" in self.model_config
            else settings.JAXEXP_MAX_REQUEST_BYTES.get(
                saved.get("max_request_bytes", DEFAULT_MAX_REQUEST_BYTES)
            )
        )
        self.policy = buckets_mod.resolve(self.model_config, saved, serving=serving)
        self.batch_symbol = buckets_mod.batch_symbol(
            [s.symbols for s in inputs], [s.symbols for s in outputs]
        )
        # IREE runs every batch size with one compiled module: no padding to buckets; padding
        # needs rows proven independent at save (MLmodel jaxexp.padding, runtime/rows.py)
        self.rows_independent = bool(rows_independent)
        self._bucketed = (
            self.policy.enabled
            and self.batch_symbol is not None
            and not iree
            and self.rows_independent
        )
        if (
            self.policy.enabled
            and self.batch_symbol is not None
            and not iree
            and not rows_independent
        ):
            _logger.info(
                "jaxexp: batches run at their own size, not padded to buckets: the model's "
                "rows are not proven independent (MLmodel jaxexp.padding; docs/serving/batching.md)"
            )
        self._out_wire = [None if s.wire_dtype == s.dtype else s.wire_dtype for s in self.outputs]
        self._chunks: Any = None  # the rows each bucket runs in (CPU, JAX path): _chunk_plan
        if iree:
            call_flat = model.call_flat
            self._flat = lambda _params, *leaves: call_flat(list(leaves))
            self.predict = self._fast_predict()
            return
        import jax

        treedef, _, _ = signature.input_structure(model.exported, model.has_params)
        self._in_treedef = treedef
        placement = getattr(model, "placement", None)
        sharded = placement is not None and (
            bool(getattr(placement, "data_parallel", False))
            or any(s is not None for s in getattr(placement, "in_shardings", ()))
        )
        if sharded:
            self._flat = None  # let the model place inputs on its mesh
        else:
            exported = model.exported
            has_params = model.has_params
            unflatten = treedef.unflatten
            export_arg = model.export_arg

            def make_flat() -> Any:
                """A new ``jax.jit`` of the flat call: JAX's own caches of traced, lowered and
                compiled shapes live as long as the function object they were made for."""

                def flat_call(params: Any, *leaves: Any) -> list:
                    args, kwargs = unflatten(leaves)
                    if has_params:
                        return jax.tree.leaves(exported.call(export_arg(params), *args, **kwargs))
                    return jax.tree.leaves(exported.call(*args, **kwargs))

                return jax.jit(flat_call)

            # a bucket compiled by an earlier process loads without lowering; at most
            # max_shapes executables are kept (runtime/executables.py)
            self._flat = executables_mod.executables(
                make_flat(),
                model,
                len(exported.out_avals),
                capacity=executables_mod.max_shapes(len(self.policy.sizes) + 1),
                renew=make_flat,
            )
        self._chunks = self._chunk_plan()
        self._precompiling: threading.Thread | None = None
        if self._bucketed and self.policy.precompile and self._only_batch_symbolic():
            if self.policy.background:  # a server's default: up now, buckets compile meanwhile
                sizes = self.policy.precompile
                if buckets_mod.has_loop(model.exported):  # a generate loop: see has_loop
                    sizes = sizes[:1]
                    _logger.info(
                        "jaxexp: the model loops (stablehlo.while): only batch bucket %s is "
                        "compiled ahead, the others on first use (precompile= to choose)",
                        sizes[0],
                    )
                self._precompiling = background.start(
                    self._precompile_in_background, sizes, name="jaxexp-precompile"
                )
            else:
                self.precompile(self.policy.precompile)
        self.predict = self._fast_predict()

    def _chunk_plan(self) -> Any:
        """The rows each bucket runs in (``runtime/chunks.py``): on the CPU, for a padded model
        called through our executables, with only its batch dimension symbolic and no loop (a
        decode loop reads every weight once a step whatever its rows); else None."""
        from jaxexp_mlflow.runtime import chunks

        flat = getattr(self, "_flat", None)
        if not (
            self._bucketed
            and isinstance(flat, executables_mod.Executables)
            and self._only_batch_symbolic()
            and getattr(self.model, "platform", None) == "cpu"
            and not buckets_mod.has_loop(self.model.exported)
        ):
            return None
        limit = chunks.budget()
        if limit <= 0:
            return None
        inputs = self.inputs

        def temp_bytes(size: int) -> int | None:
            return flat.temp_bytes(*[np.zeros((size, *s.shape[1:]), s.dtype) for s in inputs])

        return chunks.ChunkPlan(self.policy.sizes, temp_bytes, limit)

    def _fast_predict(self) -> Any:
        """``predict`` as a plain function carrying its ``__signature__``.

        ``PyFuncModel.predict`` calls ``inspect.signature`` on it for every request; a
        precomputed signature makes that a lookup instead of ~10 us of introspection.
        """
        import inspect

        convert_inputs, run, format_outputs = self.convert_inputs, self.run, self.format_outputs
        if self.classifier is not None:
            from jaxexp_mlflow.serving import classifier as classifier_mod

            conf = self.classifier

            def predict(data: Any, params: dict[str, Any] | None = None) -> Any:
                return classifier_mod.apply(conf, run(convert_inputs(data))[0], params)
        elif self._one_array_path():
            predict = self._one_array_predict()
        else:

            def predict(data: Any, params: dict[str, Any] | None = None) -> Any:
                return format_outputs(run(convert_inputs(data)))

        predict.__signature__ = inspect.signature(predict)  # type: ignore[attr-defined]
        predict.__doc__ = JaxExpPyfunc.predict.__doc__
        return predict

    def _one_array_path(self) -> bool:
        """One input array, one output array, bucketed, called through our own jitted function:
        the common case, which gets a predict without the generic steps (lists of leaves,
        per-leaf output conversion)."""
        return (
            len(self.inputs) == 1
            and len(self.outputs) == 1
            and self._bucketed
            and getattr(self, "_flat", None) is not None
            and len(self.inputs[0].shape) >= 1
        )

    def _one_array_predict(self) -> Any:
        """``predict`` for :meth:`_one_array_path`: a numpy array of the input's rank is
        converted (the same ``convert`` and checks), padded to its bucket and run directly;
        anything else takes the generic path."""
        convert_inputs, run, format_outputs = self.convert_inputs, self.run, self.format_outputs
        spec, rank, allow_nan = self.inputs[0], len(self.inputs[0].shape), self.allow_nan
        flat, model, wire = self._flat, self.model, self._out_wire[0]
        largest, bucket_for = self.policy.largest, self.policy.bucket_for
        pad_rows = buckets_mod.pad_rows
        ndarray, asarray, isfinite = np.ndarray, np.asarray, np.isfinite
        all_true, finite_number = np.logical_and.reduce, math.isfinite
        # the array `convert` would pass unchanged: the exported dtype, a batch dimension, every
        # other dimension fixed and equal; checked here in a few attribute reads (an array that
        # is anything else goes through `convert`, which casts it or says what is wrong)
        target = spec.dtype
        batched = spec.shape[0] is None and None not in spec.shape[1:]
        tail = tuple(spec.shape[1:]) if batched else None
        floats = not allow_nan and (target.kind in "fc" or is_ml_float(target))
        small = 1 << 16
        # a few float16/32 values are finite iff their sum in Python floats is (no overflow
        # of a double: at most 32 values each < 3.5e38; NaN and inf propagate): 0.4 us
        # instead of numpy's ~1 us per call
        tiny = 32 if target in (np.dtype(np.float16), np.dtype(np.float32)) else 0

        def accept(data: ndarray) -> ndarray:
            shape = data.shape
            if tail is not None and data.dtype == target and shape[1:] == tail and 0 < shape[0]:
                if not floats:
                    return data
                size = data.size
                if size <= tiny:
                    if finite_number(sum(data.ravel().tolist())):
                        return data
                elif size <= small and all_true(isfinite(data), axis=None):
                    return data
            return convert(data, spec, allow_nan=allow_nan)

        # a padded shape's executable, once its first call (through `flat`) has compiled or
        # loaded it, is called directly: later calls skip `Executables`' dispatch
        direct = getattr(flat, "executable", None)
        params_ = model.params

        def call(x: ndarray) -> Any:
            bound = model.params  # other params set on the model: the generic call decides
            if direct is not None and bound is params_:
                exe = direct(x)
                if exe is not None:
                    return exe(bound, x)[0]
            return flat(bound, x)[0]

        rows_for = self._chunks.rows if self._chunks is not None else None

        check_deadline = serving_guard.check_deadline

        def piece(x: ndarray, n: int) -> ndarray:
            size = bucket_for(n)
            if size == n:
                return asarray(call(x))
            return asarray(call(pad_rows(x, size)))[:n]

        def predict(data: Any, params: dict[str, Any] | None = None) -> Any:
            if type(data) is ndarray and data.ndim == rank:
                x = accept(data)
                n = x.shape[0]
                if n <= largest:
                    rows = n if rows_for is None or n == 1 else rows_for(bucket_for(n))
                    if rows >= n:
                        out = piece(x, n)
                    else:  # temporaries past the budget: chunks of a smaller bucket
                        parts = []
                        for i in range(0, n, rows):
                            check_deadline()  # a request past its deadline stops here
                            parts.append(piece(x[i : i + rows], min(rows, n - i)))
                        out = np.concatenate(parts)
                    return out if wire is None else out.astype(wire)
            return format_outputs(run(convert_inputs(data)))

        return predict

    # -- running ---------------------------------------------------------------------------------

    def _only_batch_symbolic(self) -> bool:
        return all(all(d is not None for d in s.shape[1:]) for s in (*self.inputs, *self.outputs))

    def _call(self, leaves: list[np.ndarray]) -> list[Any]:
        if self._flat is not None:
            return self._flat(self.model.params, *leaves)
        import jax

        args, kwargs = self._in_treedef.unflatten(leaves)
        return jax.tree.leaves(self.model(*args, **kwargs))

    def precompile(self, sizes: Any) -> None:
        """Compile the model for each batch size in ``sizes`` now (not on a request), without
        running it where the call goes through our executables (``prepare``)."""
        prepare = getattr(self._flat, "prepare", None)
        for size in sizes:
            if background.stopping():  # the process is exiting: no more buckets
                return
            leaves = [np.zeros((size, *s.shape[1:]), s.dtype) for s in self.inputs]
            if prepare is not None:
                prepare(self.model.params, *leaves)
                continue
            for out in self._call(leaves):
                out.block_until_ready()

    def _precompile_in_background(self, sizes: Any) -> None:
        """``precompile`` on a background thread: a failure is logged, never raised (the
        bucket then compiles on its first use, where its error reaches the caller)."""
        try:
            self.precompile(sizes)
        except Exception as err:  # noqa: BLE001 - a request will meet it, typed
            _logger.warning("jaxexp: precompiling the batch buckets stopped: %s", err)

    def run(self, leaves: list[np.ndarray]) -> list[np.ndarray]:
        """Run on converted input leaves (padding to a bucket); return numpy output leaves."""
        if not self._bucketed:
            return [np.asarray(o) for o in self._call(leaves)]
        n = leaves[0].shape[0]
        step = self.policy.largest
        if self._chunks is not None and n > 1:  # temporaries past the budget: smaller chunks
            step = min(step, self._chunks.rows(self.policy.bucket_for(min(n, step))))
        if n > step:
            parts = []
            for i in range(0, n, step):
                serving_guard.check_deadline()  # a request past its deadline stops here
                parts.append(self.run([x[i : i + step] for x in leaves]))
            return [np.concatenate(chunk) for chunk in zip(*parts, strict=True)]
        size = self.policy.bucket_for(n)
        if size != n:
            leaves = [buckets_mod.pad_rows(x, size) for x in leaves]
            return [np.asarray(o)[:n] for o in self._call(leaves)]
        return [np.asarray(o) for o in self._call(leaves)]

    # -- input and output conversion ------------------------------------------------------------

    def named_inputs(self, data: Any) -> dict[str, Any]:
        """Map any accepted input form to ``{input name: raw value}``."""
        return self.contract.named(data)

    def _expected(self) -> str:
        return self.contract.expected()

    def convert_inputs(self, data: Any, *, wire: bool = False) -> list[np.ndarray]:
        """Validate and cast inputs into a list of leaves (exported dtypes, or wire dtypes)."""
        if not self.inputs and (data is None or (isinstance(data, dict) and not data)):
            return []  # a function of params only (or of nothing): predict(None) or predict({})
        if len(self.inputs) == 1 and isinstance(data, np.ndarray):  # the fast path
            spec = self.inputs[0]
            if data.ndim == len(spec.shape):
                dt = spec.wire_dtype if wire else None
                return [convert(data, spec, dtype=dt, allow_nan=self.allow_nan)]
        return self.contract.leaves(data, wire=wire)

    def format_outputs(self, outs: list[np.ndarray]) -> Any:
        """A single output as an array, several as ``{name: array}`` (wire dtypes)."""
        outs = [o if w is None else o.astype(w) for o, w in zip(outs, self._out_wire, strict=True)]
        if len(outs) == 1:
            return outs[0]
        return {s.name: o for s, o in zip(self.outputs, outs, strict=True)}

    # -- the pyfunc API ---------------------------------------------------------------------------

    def get_raw_model(self) -> Any:
        """The underlying ``JaxExpModel``."""
        return self.model

    def predict(self, data: Any, params: dict[str, Any] | None = None) -> Any:
        """Run the model on ``data`` (see the module docstring for the accepted forms)."""
        return self.format_outputs(self.run(self.convert_inputs(data)))
