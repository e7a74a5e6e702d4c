"""The pyfunc face of a jaxexp model: numpy/pandas/JSON lists in, numpy out, no JAX for callers.

``JaxExpPyfunc.predict`` takes every form of the input contract (``flavors/inputs.py``: by name
or position, dicts, DataFrames, lists, MLflow's JSON envelopes, lossless casts only) and returns
a numpy array for a single output leaf, a dict ``{output name: array}`` otherwise.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import numpy as np
from mlflow.exceptions import MlflowException

from jaxexp_mlflow.errors import ArtifactError, InputError
from jaxexp_mlflow.flavors import serving_guard
from jaxexp_mlflow.flavors.inputs import (  # noqa: F401 - convert: the public name it had here
    ENV_ALLOW_NAN,
    InputContract,
    convert,
    from_records,
    from_split,
    read_csv,
)
from jaxexp_mlflow.flavors.signature import LeafSpec
from jaxexp_mlflow.runtime import buckets as buckets_mod

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
    ) -> None:
        from jaxexp_mlflow.flavors import signature

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
            "allow_nan", os.environ.get(ENV_ALLOW_NAN, saved.get("allow_nan"))
        )
        self.allow_nan = str(allow).lower() in ("1", "true", "on", "yes")
        self.contract = InputContract(inputs, allow_nan=self.allow_nan)
        self.max_request_bytes = int(
            self.model_config.get(
                "max_request_bytes",
                os.environ.get(
                    ENV_MAX_REQUEST_BYTES, saved.get("max_request_bytes", DEFAULT_MAX_REQUEST_BYTES)
                ),
            )
        )
        self.policy = buckets_mod.resolve(self.model_config, saved)
        self.batch_symbol = buckets_mod.batch_symbol(
            [s.symbols for s in inputs], [s.symbols for s in outputs]
        )
        # IREE runs every batch size with one compiled module: no padding to buckets
        self._bucketed = self.policy.enabled and self.batch_symbol is not None and not iree
        self._out_wire = [None if s.wire_dtype == s.dtype else s.wire_dtype for s in self.outputs]
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

            def flat_call(params: Any, *leaves: Any) -> list:
                args, kwargs = unflatten(leaves)
                if has_params:
                    return jax.tree.leaves(exported.call(export_arg(params), *args, **kwargs))
                return jax.tree.leaves(exported.call(*args, **kwargs))

            self._flat = jax.jit(flat_call)
        if self._bucketed and self.policy.precompile and self._only_batch_symbolic():
            self.precompile(self.policy.precompile)
        self.predict = self._fast_predict()

    def _fast_predict(self) -> Any:
        """``predict`` as a plain function carrying its ``__signature__``.

        ``PyFuncModel.predict`` calls ``inspect.signature`` on it for every request; a
        precomputed signature makes that a lookup instead of ~10 us of introspection.
        """
        import inspect

        convert_inputs, run, format_outputs = self.convert_inputs, self.run, self.format_outputs
        if self.classifier is not None:
            from jaxexp_mlflow.flavors import classifier as classifier_mod

            conf = self.classifier

            def predict(data: Any, params: dict[str, Any] | None = None) -> Any:
                return classifier_mod.apply(conf, run(convert_inputs(data))[0], params)
        else:

            def predict(data: Any, params: dict[str, Any] | None = None) -> Any:
                return format_outputs(run(convert_inputs(data)))

        predict.__signature__ = inspect.signature(predict)  # type: ignore[attr-defined]
        predict.__doc__ = JaxExpPyfunc.predict.__doc__
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
        """Compile the model for each batch size in ``sizes`` now (not on a request)."""
        for size in sizes:
            leaves = [np.zeros((size, *s.shape[1:]), s.dtype) for s in self.inputs]
            for out in self._call(leaves):
                out.block_until_ready()

    def run(self, leaves: list[np.ndarray]) -> list[np.ndarray]:
        """Run on converted input leaves (padding to a bucket); return numpy output leaves."""
        if not self._bucketed:
            return [np.asarray(o) for o in self._call(leaves)]
        n = leaves[0].shape[0]
        largest = self.policy.largest
        if n > largest:
            parts = [self.run([x[i : i + largest] for x in leaves]) for i in range(0, n, largest)]
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


# -- the scoring server guard -------------------------------------------------------------------
#
# MLflow's scoring server parses the JSON body itself before calling predict: it casts lists with
# np.array(data, dtype=<signature dtype>) (silently truncating floats sent to an int input), and
# its error messages repeat the request body or the parsed data. For jaxexp models only, the
# guard below parses the four JSON formats with ``convert`` (same rules as predict), refuses
# oversized bodies with 413 and keeps error messages short. Other models are untouched.

_FORMATS = ("inputs", "instances", "dataframe_split", "dataframe_records")


def _model_uuid(metadata: Any) -> str | None:
    return getattr(metadata, "model_uuid", None)


# jaxexp pyfunc implementations loaded in this process, by MLmodel model_uuid
_LOADED: dict[str, JaxExpPyfunc] = {}


def register(model_uuid: str | None, impl: JaxExpPyfunc) -> None:
    """Remember a loaded implementation so the serving guard finds it from MLflow's metadata."""
    if model_uuid:
        _LOADED[model_uuid] = impl


def _impl_for(metadata: Any) -> JaxExpPyfunc | None:
    flavors = getattr(metadata, "flavors", None) or {}
    if "jaxexp" not in flavors:
        return None
    return _LOADED.get(_model_uuid(metadata))


def parse_request(impl: JaxExpPyfunc, body: Any) -> tuple[Any, dict | None]:
    """Parse a JSON request body into validated wire-dtype arrays and MLflow params."""
    if isinstance(body, bytes | bytearray):
        try:
            body = body.decode("utf-8")
        except UnicodeDecodeError:
            raise InputError(
                "The request body is not UTF-8 JSON. Send a JSON object such as "
                f'{{"inputs": ...}} with: {impl._expected()}.'
            ) from None
    if isinstance(body, str):
        obj = serving_guard.loads(body, allow_nan=impl.allow_nan, expected=impl._expected())
    else:
        obj = body
    if not isinstance(obj, dict):
        raise InputError(
            f"The request body must be a JSON object with one of the keys {list(_FORMATS)}, "
            f"found a JSON {type(obj).__name__}. Inputs: {impl._expected()}."
        )
    keys = [k for k in obj if k in _FORMATS]
    extra = [k for k in obj if k not in _FORMATS and k != "params"]
    if len(keys) != 1 or extra:
        raise InputError(
            f"The request must have exactly one of the keys {list(_FORMATS)} (plus optional "
            f"'params'), found keys {list(obj)[:10]}. Inputs: {impl._expected()}."
        )
    fmt = keys[0]
    payload = obj[fmt]
    params = obj.get("params")
    if fmt in ("inputs", "instances"):
        data = payload
    elif fmt == "dataframe_split":
        data = from_split(impl.contract, payload)
    else:
        data = from_records(impl.contract, payload)
    return impl.convert_inputs(data, wire=True), params


def _short(message: str, limit: int = 600) -> str:
    return message if len(message) <= limit else message[:limit] + " ..."


def install_serving_guard(impl: JaxExpPyfunc | None = None) -> bool:
    """Wrap the scoring server's JSON parsing and invocations for jaxexp models (idempotent).

    Called by the pyfunc loader when it runs inside MLflow's scoring server or ``mlflow models
    predict`` (``mlflow.pyfunc.scoring_server`` imported). With ``impl``, the app the server
    builds next also limits request bodies while they stream in and the bytes in flight
    (``flavors.serving_guard``). Turn off with ``JAXEXP_SERVING_GUARD=0``.
    """
    server = sys.modules.get("mlflow.pyfunc.scoring_server")
    if server is None or os.environ.get("JAXEXP_SERVING_GUARD", "1").lower() in ("0", "off"):
        return False
    if impl is not None:  # 413 while the body streams in, bytes in flight bounded
        serving_guard.install_body_limit(server, impl)
    if getattr(server, "_jaxexp_guarded", False):
        return True
    orig_parse = getattr(server, "_parse_json_data", None)
    orig_invocations = getattr(server, "invocations", None)
    response_type = getattr(server, "InvocationsResponse", None)
    parsed_type = getattr(server, "ParsedJsonInput", None)
    if None in (orig_parse, orig_invocations, response_type, parsed_type):
        _logger.warning("jaxexp: unknown MLflow scoring server layout; serving guard not installed")
        return False

    def _parse_json_data(data: Any, metadata: Any, input_schema: Any) -> Any:
        impl = _impl_for(metadata)
        if impl is None:
            return orig_parse(data, metadata, input_schema)
        leaves, params = parse_request(impl, data)
        return parsed_type(dict(zip(impl._names, leaves, strict=True)), params, False)

    def invocations(data: Any, content_type: Any, model: Any, input_schema: Any) -> Any:
        impl = _impl_for(getattr(model, "metadata", None))
        if impl is None:
            return orig_invocations(data, content_type, model, input_schema)
        if data is not None and len(data) > impl.max_request_bytes:
            err = InputError(
                f"The request body has {len(data)} bytes, more than the limit of "
                f"{impl.max_request_bytes} (model_config max_request_bytes / "
                f"{ENV_MAX_REQUEST_BYTES}). Send smaller batches; inputs: {impl._expected()}."
            )
            return response_type(err.serialize_as_json(), 413, "application/json")
        try:
            return orig_invocations(data, content_type, model, input_schema)
        except MlflowException as err:  # MLflow prefixes the data to messages: drop it
            text = err.message
            if text.startswith("Failed to predict data '") and ". \nError: " in text:
                text = text.split(". \nError: ", 1)[1]
            err.message = _short(text)
            raise

    orig_csv = getattr(server, "parse_csv_input", None)

    def parse_csv_input(csv_input: Any, schema: Any = None) -> Any:
        if _LOADED and schema is not None and schema.is_tensor_spec():
            # the jaxexp model served here: its contract checks the widths, then casts
            served = list(_LOADED.values())
            return read_csv(csv_input, served[0].contract if len(served) == 1 else None)
        return orig_csv(csv_input, schema)

    if orig_csv is not None:
        server.parse_csv_input = parse_csv_input
    server._parse_json_data = _parse_json_data
    server.invocations = invocations
    server._jaxexp_guarded = True
    return True
