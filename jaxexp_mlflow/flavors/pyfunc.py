"""The pyfunc face of a jaxexp model: numpy/pandas/JSON lists in, numpy out, no JAX for callers.

``JaxExpPyfunc.predict`` takes

* a numpy array (models with one input leaf),
* a dict ``{input name: array or nested list}``,
* a pandas DataFrame: one column per input (scalar cells for 1-D inputs, array- or list-valued
  cells otherwise), or, for a single 2-D input ``[-1, k]``, ``k`` scalar columns,
* lists as JSON decodes them (a nested list for one input, a list of ``{name: value}`` records),

and returns a numpy array for a single output leaf, a dict ``{output name: array}`` otherwise.

Casting rules (``convert``): the value must reach the exported dtype without losing
information. Accepted: the exact dtype; ints into wider/narrower ints when every value fits;
bools into bool; ints (exactly representable) and floats into any float type (rounding to the
nearest representable value, e.g. float64 -> float32 or float32 -> bfloat16; that is how the
ml_dtypes types JSON cannot carry arrive); anything real into complex. Refused: floats into
ints or bool, values out of the target's range (300 into int8, 1e6 into float16), NaN unless
``allow_nan`` is set, strings/objects, ragged lists, wrong rank or fixed dimension, a batch of
0, inputs sharing a symbolic dimension with different sizes, missing or unknown inputs.
Every refusal is an ``InputError`` (HTTP 400) naming the input and its expected spec.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np
from mlflow.exceptions import MlflowException

from jaxexp_mlflow.errors import InputError
from jaxexp_mlflow.flavors.signature import LeafSpec, input_error
from jaxexp_mlflow.runtime import buckets as buckets_mod

_logger = logging.getLogger(__name__)

ENV_ALLOW_NAN = "JAXEXP_ALLOW_NAN"
ENV_MAX_REQUEST_BYTES = "JAXEXP_MAX_REQUEST_BYTES"
DEFAULT_MAX_REQUEST_BYTES = 64 * 1024 * 1024


def _describe_found(arr: Any) -> str:
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
        except (ValueError, TypeError):
            raise input_error(
                spec, "a ragged or non-numeric nested list", "Send a rectangular array of numbers."
            ) from None
        if arr.size == 0 and arr.ndim >= 1 and spec.shape and spec.shape[0] is None:
            raise input_error(spec, "a batch of 0 rows", "Send at least one row.")
        arr = _cast(arr, spec, target)
    if arr.ndim != len(spec.shape) or any(
        d is not None and d != a for d, a in zip(spec.shape, arr.shape, strict=False)
    ):
        raise input_error(spec, _describe_found(arr), _shape_hint(spec, arr))
    if spec.shape and spec.shape[0] is None and arr.shape[0] == 0:
        raise input_error(spec, "a batch of 0 rows", "Send at least one row.")
    if (
        not allow_nan
        and arr.size
        and (arr.dtype.kind == "f" or _is_ml_float(arr.dtype))
        and (
            np.isnan(arr.sum()) and np.isnan(arr).any()  # the sum is a cheap first test
        )
    ):
        raise input_error(
            spec,
            "NaN values",
            "NaN is not allowed for this model (set allow_nan in the model_config or "
            f"{ENV_ALLOW_NAN}=1 to allow it).",
        )
    return arr


def _is_ml_float(dt: np.dtype) -> bool:
    return dt.type.__module__ != "numpy" and not dt.name.startswith(("int", "uint"))


def _shape_hint(spec: LeafSpec, arr: np.ndarray) -> str:
    if arr.ndim == len(spec.shape) - 1:
        return "It looks like a single example: wrap it in a list to make a batch of 1."
    return "Send an array of that rank with the fixed dimensions shown (-1 = any size)."


def _cast(arr: np.ndarray, spec: LeafSpec, target: np.dtype) -> np.ndarray:
    src = arr.dtype
    if src == target:
        return arr
    found = _describe_found(arr)
    if src.kind in "OUSV" and not _is_ml_float(src) or src.kind == "O":
        raise input_error(spec, found, "Send numbers.")
    t_float = target.kind in "f" or _is_ml_float(target)
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
                spec, found, "Floats are not cast into an integer input: send whole numbers."
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


def _ml_iinfo(target: np.dtype) -> Any:
    import ml_dtypes

    return ml_dtypes.iinfo(target)


def _column(series: Any) -> Any:
    """A DataFrame column as an array: scalar cells -> 1-D, array/list cells -> stacked."""
    values = series.to_numpy()
    if values.dtype == object and len(values) and isinstance(values[0], list | tuple | np.ndarray):
        try:
            return np.stack([np.asarray(v) for v in values])
        except ValueError:
            return values  # ragged: refused by convert
    return values


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
    ) -> None:
        import jax

        from jaxexp_mlflow.flavors import signature

        self.model = model
        self.model_config = dict(model_config or {})
        saved = dict(saved_config or {})
        if inputs is None or outputs is None:
            inputs, outputs = signature.leaf_specs(model.exported, has_params=model.has_params)
        self.inputs = inputs
        self.outputs = outputs
        self._names = [s.name for s in inputs]
        self._by_name = {s.name: s for s in inputs}
        allow = self.model_config.get(
            "allow_nan", os.environ.get(ENV_ALLOW_NAN, saved.get("allow_nan"))
        )
        self.allow_nan = str(allow).lower() in ("1", "true", "on", "yes")
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
        self._bucketed = self.policy.enabled and self.batch_symbol is not None
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

            def flat_call(params: Any, *leaves: Any) -> list:
                args, kwargs = unflatten(leaves)
                if has_params:
                    return jax.tree.leaves(exported.call(params, *args, **kwargs))
                return jax.tree.leaves(exported.call(*args, **kwargs))

            self._flat = jax.jit(flat_call)
        self._out_wire = [None if s.wire_dtype == s.dtype else s.wire_dtype for s in self.outputs]
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

    def _records(self, data: list) -> dict[str, Any]:
        columns: dict[str, list] = {}
        for rec in data:
            for key, val in rec.items():
                columns.setdefault(key, []).append(val)
        return columns

    def named_inputs(self, data: Any) -> dict[str, Any]:
        """Map any accepted input form to ``{input name: raw value}``."""
        import pandas as pd

        if isinstance(data, pd.DataFrame):
            cols = [str(c) for c in data.columns]
            if set(self._names) <= set(cols) or len(self.inputs) > 1:
                return {str(c): _column(data[c]) for c in data.columns}
            spec = self.inputs[0]
            if len(spec.shape) == 2 and len(cols) > 1:
                return {spec.name: data.to_numpy()}
            return {spec.name: _column(data[data.columns[0]])}
        if isinstance(data, Mapping):
            return {str(k): v for k, v in data.items()}
        if isinstance(data, list) and data and all(isinstance(r, Mapping) for r in data):
            return self._records(data)
        if len(self.inputs) == 1:
            return {self._names[0]: data}
        raise InputError(
            f"This model takes {len(self.inputs)} inputs ({self._expected()}), so send a dict "
            f"{{name: array}} (or a DataFrame with those columns); found a {type(data).__name__}."
        )

    def _expected(self) -> str:
        return "; ".join(s.describe() for s in self.inputs)

    def convert_inputs(self, data: Any, *, wire: bool = False) -> list[np.ndarray]:
        """Validate and cast inputs into a list of leaves (exported dtypes, or wire dtypes)."""
        allow_nan = self.allow_nan
        if len(self.inputs) == 1 and isinstance(data, np.ndarray):
            spec = self.inputs[0]
            return [
                convert(data, spec, dtype=spec.wire_dtype if wire else None, allow_nan=allow_nan)
            ]
        if (
            type(data) is dict
            and len(data) == len(self.inputs)
            and all(n in data for n in self._names)
        ):  # the form MLflow's schema enforcement hands over
            leaves = [
                convert(data[s.name], s, dtype=s.wire_dtype if wire else None, allow_nan=allow_nan)
                for s in self.inputs
            ]
            if len(leaves) > 1:
                self._check_symbols(leaves)
            return leaves
        named = self.named_inputs(data)
        unknown = [k for k in named if k not in self._by_name]
        missing = [n for n in self._names if n not in named]
        if missing or unknown:
            parts = []
            if missing:
                parts.append(
                    "missing input(s) " + "; ".join(self._by_name[n].describe() for n in missing)
                )
            if unknown:
                parts.append(f"unknown input(s) {unknown[:10]}")
            raise InputError(
                f"{' and '.join(parts).capitalize()}. The model takes: {self._expected()}."
            )
        leaves = []
        for spec in self.inputs:
            dt = spec.wire_dtype if wire else None
            leaves.append(convert(named[spec.name], spec, dtype=dt, allow_nan=self.allow_nan))
        self._check_symbols(leaves)
        return leaves

    def _check_symbols(self, leaves: list[np.ndarray]) -> None:
        seen: dict[str, tuple[int, str]] = {}
        for spec, arr in zip(self.inputs, leaves, strict=True):
            for axis, sym in enumerate(spec.symbols):
                if sym is None:
                    continue
                size = arr.shape[axis]
                if sym in seen and seen[sym][0] != size:
                    first_size, first = seen[sym]
                    raise InputError(
                        f"Inputs '{first}' and '{spec.name}' share the dimension {sym!r} but "
                        f"have {first_size} and {size} along it. Expected: {self._expected()}."
                    )
                seen.setdefault(sym, (size, spec.name))

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
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as err:
            raise InputError(
                f"The request body is not valid JSON ({err.msg} at line {err.lineno} column "
                f"{err.colno}). Send a JSON object with one of the keys {list(_FORMATS)} for "
                f"the inputs: {impl._expected()}."
            ) from None
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
        data = _from_split(impl, payload)
    else:
        data = _from_records(impl, payload)
    return impl.convert_inputs(data, wire=True), params


def _from_split(impl: JaxExpPyfunc, payload: Any) -> Any:
    if not isinstance(payload, dict) or not isinstance(payload.get("data"), list):
        raise InputError(
            "dataframe_split must be an object {'columns': [...], 'data': [[...], ...]}; "
            f"inputs: {impl._expected()}."
        )
    rows = payload["data"]
    columns = payload.get("columns")
    if len(impl.inputs) == 1 and columns != impl._names:
        return {impl._names[0]: rows}  # scalar columns: the rows are the rows of the input
    if not isinstance(columns, list) or any(
        not isinstance(r, list) or len(r) != len(columns) for r in rows
    ):
        raise InputError(
            "dataframe_split needs 'columns' naming the inputs and rows with one value per "
            f"column; inputs: {impl._expected()}."
        )
    return {str(c): [r[i] for r in rows] for i, c in enumerate(columns)}


def _from_records(impl: JaxExpPyfunc, payload: Any) -> Any:
    if not isinstance(payload, list) or not all(isinstance(r, dict) for r in payload):
        raise InputError(
            "dataframe_records must be a list of objects {column: value}; "
            f"inputs: {impl._expected()}."
        )
    if not payload:
        return {n: [] for n in impl._names}
    cols = list(payload[0])
    if len(impl.inputs) == 1 and cols != impl._names:
        return {impl._names[0]: [[r.get(c) for c in cols] for r in payload]}
    return impl._records(payload)


def _short(message: str, limit: int = 600) -> str:
    return message if len(message) <= limit else message[:limit] + " ..."


def install_serving_guard() -> bool:
    """Wrap the scoring server's JSON parsing and invocations for jaxexp models (idempotent).

    Called by the pyfunc loader when it runs inside MLflow's scoring server or ``mlflow models
    predict`` (``mlflow.pyfunc.scoring_server`` imported). Turn off with
    ``JAXEXP_SERVING_GUARD=0``.
    """
    server = sys.modules.get("mlflow.pyfunc.scoring_server")
    if server is None or os.environ.get("JAXEXP_SERVING_GUARD", "1").lower() in ("0", "off"):
        return False
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

    server._parse_json_data = _parse_json_data
    server.invocations = invocations
    server._jaxexp_guarded = True
    return True
