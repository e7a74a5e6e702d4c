"""The pyfunc face of a jaxexp model: numpy/pandas/JSON lists in, numpy out, no JAX for callers.

``JaxExpPyfunc.predict`` takes every form of the input contract (``serving/inputs.py``: by name
or position, dicts, DataFrames, lists, MLflow's JSON envelopes, lossless casts only) and returns
a numpy array for a single output leaf, a dict ``{output name: array}`` otherwise.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sys
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from jaxexp_mlflow import settings
from jaxexp_mlflow.errors import ArtifactError, IncompatibleError, InputError
from jaxexp_mlflow.runtime import buckets as buckets_mod
from jaxexp_mlflow.runtime import executables as executables_mod
from jaxexp_mlflow.runtime import rows as rows_mod
from jaxexp_mlflow.runtime.backend import backend_of
from jaxexp_mlflow.serving import background, lite_pyfunc, serving_guard
from jaxexp_mlflow.serving.inputs import (
    InputContract,
    convert,
    from_records,
    from_split,
    is_ml_float,
)
from jaxexp_mlflow.serving.signature import LeafSpec

_logger = logging.getLogger(__name__)

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
                "rows are not proven independent (MLmodel jaxexp.padding; docs/serving.md)"
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


# -- loading, once per process -------------------------------------------------------------------
#
# Spark's ``spark_udf`` (local mode) and ``mlflow.models.evaluate`` call
# ``mlflow.pyfunc.load_model`` on the same directory again and again in one Python worker. Each
# implementation loaded is kept under the model's identity (the directory's real path, the sha256
# of its MLmodel, of its blob and of its params manifest, the model_config and the JAXEXP_*
# environment), never under its path alone: a directory rewritten in place is a new identity
# and loads again.

ENV_PYFUNC_CACHE = "JAXEXP_PYFUNC_CACHE"
_CACHE_SIZE = 4
_CACHE: OrderedDict[tuple, JaxExpPyfunc] = OrderedDict()
_CACHE_LOCK = threading.Lock()
#: What a scoring server's process has imported before it loads a model: ``mlflow models
#: serve``, ``jaxexp serve``, and MLServer (``mlserver start`` loads models in its main process,
#: or in spawned workers with ``parallel_workers`` > 0).
_SERVER_MODULES = (
    "mlflow.pyfunc.scoring_server.app",
    "jaxexp_mlflow.serving.server",
    "mlserver.server",
    "mlserver.parallel.worker",
)


def in_scoring_server() -> bool:
    """Whether this process is a scoring server (``mlflow models serve``, ``jaxexp serve``,
    MLServer)."""
    return any(name in sys.modules for name in _SERVER_MODULES)


def model_identity(model_dir: str | os.PathLike, config: dict[str, Any]) -> tuple:
    """What makes two loads the same model: real path, file digests, config, environment."""
    return _identity(model_dir, config)[0]


def _identity(model_dir: str | os.PathLike, config: dict[str, Any]) -> tuple[tuple, Any]:
    """``model_identity`` and the model directory it read (``store.model_files.ModelFiles``:
    MLmodel and the blob, read and checked once; the load takes it as it is)."""
    from jaxexp_mlflow.codec import files
    from jaxexp_mlflow.params.manifest import MANIFEST_FILE
    from jaxexp_mlflow.store import artifact
    from jaxexp_mlflow.store.model_files import read_model_files

    # an MLmodel that is no mapping: the load reports the missing flavor
    model_files = read_model_files(model_dir, mapping=False)
    model_files.blob  # noqa: B018 - read and checked against exported_sha256: its digest
    blob_digest = model_files.flavor["exported_sha256"]
    manifest = ""
    ckpt = artifact.params_dir(model_dir, model_files.flavor)
    if ckpt is not None and (ckpt / MANIFEST_FILE).is_file():
        data = files.read_file(ckpt / MANIFEST_FILE, what="params manifest", max_bytes=256 << 20)
        manifest = hashlib.sha256(data).hexdigest()
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("JAXEXP_")))
    key = (
        os.path.realpath(model_dir),
        model_files.mlmodel_sha256,
        blob_digest,
        manifest,
        json.dumps(config, sort_keys=True, default=str),
        env,
        in_scoring_server(),
    )
    return key, model_files


def load_pyfunc(path: str | os.PathLike, model_config: dict[str, Any] | None = None) -> Any:
    """The jaxexp pyfunc implementation of the model at ``path``, loaded once per process.

    A second load of the same model (see ``model_identity``) returns the implementation already
    loaded, with the buckets it has compiled. ``JAXEXP_PYFUNC_CACHE=0`` loads every time.
    """
    config = {k: v for k, v in (model_config or {}).items() if v is not None}
    model_dir = Path(path)
    if model_dir.is_file():
        model_dir = model_dir.parent
    if not settings.JAXEXP_PYFUNC_CACHE.get():
        return _load_uncached(model_dir, config)
    key, model_files = _identity(model_dir, config)
    with _CACHE_LOCK:
        impl = _CACHE.get(key)
        if impl is not None:
            _CACHE.move_to_end(key)
            return impl
    if backend_of(config, model_files.flavor) == "iree":  # runs without jax or jaxlib as it is
        impl = _load_uncached(model_dir, config, model_files)
    else:  # stored buckets run without importing jax (lite_pyfunc)
        serving = in_scoring_server()
        impl = lite_pyfunc.load(
            model_dir, config, model_files, key, _load_uncached, register, serving
        )
    with _CACHE_LOCK:
        _CACHE[key] = impl
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return impl


def _load_uncached(
    model_dir: Path, config: dict[str, Any], model_files: Any = None
) -> JaxExpPyfunc:
    """Read, judge and load the model at ``model_dir`` into a new ``JaxExpPyfunc``
    (``model_files``: the directory as the caller has just read it, ``store.model_files``)."""
    from jaxexp_mlflow.serving import signature as sig
    from jaxexp_mlflow.store.model_files import read_model_files

    if model_files is None:
        model_files = read_model_files(model_dir)
    flavor_conf = model_files.flavor
    saved = dict(flavor_conf.get("serving") or {})
    backend = backend_of(config, flavor_conf)
    load_options = {k: config[k] for k in ("allow_other_platform", "data_parallel") if k in config}
    if config.get("route") is not None:  # taken as asked, never chosen (runtime/routes.py)
        from jaxexp_mlflow.runtime.routes import check_name

        if backend == "iree":
            raise IncompatibleError(
                f"model_config route={config['route']!r} is a route of the JAX backend; "
                "backend 'iree' is a route of its own: pass one of them."
            )
        load_options["route"] = check_name(str(config["route"]))
    if backend == "iree":
        from jaxexp_mlflow.iree.loader import load_directory

        load_options.update({k: config[k] for k in ("iree_cache", "iree_driver") if k in config})
        load_options["model_files"] = model_files
    else:
        from jaxexp_mlflow.runtime.dispatch import inline_cpu_dispatch

        inline_cpu_dispatch(in_scoring_server())  # before jax's CPU client, in a server only
        from jaxexp_mlflow.runtime import cache
        from jaxexp_mlflow.runtime.loader import load_directory

        cache.configure(config.get("compilation_cache", saved.get("compilation_cache")))
        load_options["model_files"] = model_files
    model = load_directory(
        model_dir,
        flavor_conf,
        allow_incompatible=bool(config.get("allow_incompatible", False)),
        **load_options,
    )
    specs = sig.specs_from_conf(flavor_conf)
    inputs, outputs = specs if specs is not None else (None, None)
    impl = JaxExpPyfunc(
        model,
        config,
        inputs=inputs,
        outputs=outputs,
        saved_config=saved,
        classifier=flavor_conf.get("classifier"),
        serving=in_scoring_server(),
        rows_independent=rows_mod.proven(flavor_conf),
    )
    register(model_files.mlmodel.get("model_uuid"), impl)
    return impl


# -- requests of the jaxexp scoring server ------------------------------------------------------
#
# ``jaxexp serve`` (``serving/server.py``) parses ``/invocations`` bodies with ``parse_request``:
# the four JSON formats of MLflow's scoring protocol, through the input contract (the same rules
# as predict), at the cost of a plain ``json.loads`` + ``np.asarray``. ``mlflow models serve``
# keeps MLflow's own parsing: with no input schema in the signature it turns every format into
# numpy arrays or DataFrames, uncast, and ``predict`` applies the contract to them; nothing here
# changes MLflow's server.

_FORMATS = ("inputs", "instances", "dataframe_split", "dataframe_records")


def _model_uuid(metadata: Any) -> str | None:
    return getattr(metadata, "model_uuid", None)


# jaxexp pyfunc implementations loaded in this process, by MLmodel model_uuid
_LOADED: dict[str, JaxExpPyfunc] = {}


def register(model_uuid: str | None, impl: JaxExpPyfunc) -> None:
    """Remember a loaded implementation, found again from MLflow's metadata by ``impl_for``."""
    if model_uuid:
        _LOADED[model_uuid] = impl


def impl_for(metadata: Any) -> JaxExpPyfunc | None:
    """The implementation loaded for a ``PyFuncModel``'s metadata (``None``: not jaxexp)."""
    flavors = getattr(metadata, "flavors", None) or {}
    if "jaxexp" not in flavors:
        return None
    return _LOADED.get(_model_uuid(metadata))


def parse_request(impl: JaxExpPyfunc, body: Any) -> tuple[list[np.ndarray], dict | None]:
    """Parse a JSON request body into validated wire-dtype arrays and MLflow params.

    ``json.loads`` without per-number hooks (``serving_guard.loads``), then the contract on the
    converted arrays: finiteness, integer ranges and lossless casts checked vectorised.
    """
    if isinstance(body, bytes | bytearray | memoryview):
        try:
            body = bytes(body).decode("utf-8")
        except UnicodeDecodeError:
            raise InputError(
                "Expected a UTF-8 JSON object such as "
                f'{{"inputs": ...}} with: {impl._expected()}. Found bytes that are not UTF-8.'
            ) from None
    obj = serving_guard.loads(body, expected=impl._expected()) if isinstance(body, str) else body
    if not isinstance(obj, dict):
        raise InputError(
            f"Expected the request body to be a JSON object with one of the keys "
            f"{list(_FORMATS)}, found a JSON {type(obj).__name__}. Inputs: {impl._expected()}."
        )
    keys = [k for k in obj if k in _FORMATS]
    extra = [k for k in obj if k not in _FORMATS and k != "params"]
    if len(keys) != 1 or extra:
        raise InputError(
            f"Expected exactly one of the keys {list(_FORMATS)} (plus optional 'params'), "
            f"found keys {[str(k)[:40] for k in list(obj)[:10]]}. Inputs: {impl._expected()}."
        )
    fmt = keys[0]
    payload = obj[fmt]
    params = obj.get("params")
    if params is not None and not isinstance(params, dict):
        raise InputError(
            f"Expected the request's 'params' to be a JSON object, found a JSON "
            f"{type(params).__name__}. Inputs: {impl._expected()}."
        )
    if fmt in ("inputs", "instances"):
        data = payload
    elif fmt == "dataframe_split":
        data = from_split(impl.contract, payload)
    else:
        data = from_records(impl.contract, payload)
    return impl.convert_inputs(data, wire=True), params


def short(message: str, limit: int = 600) -> str:
    """``message`` cut to ``limit`` characters."""
    return message if len(message) <= limit else message[:limit] + " ..."
