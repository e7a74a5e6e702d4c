"""The input contract of a jaxexp model: one set of rules for every door.

``pyfunc.predict`` (in-process), the scoring server (``jaxexp serve``: the four JSON formats and
CSV; ``mlflow models serve``: MLflow's ``inputs`` format), ``mlflow models predict``,
``spark_udf``, MLServer and ``jaxexp predict`` all turn what they receive into the exported input
leaves with ``InputContract.leaves``; the table in docs/serving/pyfunc-rest.md ("The input
contract") is this module in prose.

Forms (``InputContract.named``), for inputs named as in the signature:

* by name: a dict / JSON object / npz ``{name: array or nested list}``; nested objects are
  joined with ``.`` (``{"a": {"image": ...}}`` is ``a.image``); a DataFrame with those columns;
  a list of ``{name: value}`` records;
* by position: ``in_0``, ``in_1``, ... keys (the reference-file convention), or a list/tuple
  with one value per input (models with several inputs);
* a single input: the array / nested list itself; for an input ``[-1, n]`` also a DataFrame of
  ``n`` scalar feature columns (any names);
* the MLflow envelopes ``{"inputs": ...}``, ``{"instances": ...}``, ``{"dataframe_split": ...}``,
  ``{"dataframe_records": ...}`` (``serving_input_example.json`` as saved), unless an input is
  itself named like the envelope key;
* one example without its batch axis (every input one rank short of a batched spec) is a batch
  of 1;
* an input that is one value for the whole batch (``batched: false`` in MLmodel's ``io``: a
  PRNG key beside batched inputs) is sent once, never per row; a row form that repeats it in
  every row must repeat the same value (:func:`once`).

Casting rules: ``serving/casts.py`` (``convert``, re-exported here).
Row forms (DataFrame columns, JSON-list text cells, one-value inputs): ``serving/frames.py``
(``column``, ``list_cells``, ``once``, re-exported here).
Every refusal is an ``InputError`` (HTTP 400, CLI exit 2) stating the rule, the expected spec
and what was found, in a few hundred characters: never the input itself.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxexp_mlflow.errors import InputError
from jaxexp_mlflow.serving.casts import ENV_ALLOW_NAN, convert, is_ml_float
from jaxexp_mlflow.serving.frames import MAX_CELL_DEPTH as MAX_CELL_DEPTH
from jaxexp_mlflow.serving.frames import _list_rank
from jaxexp_mlflow.serving.frames import column as column
from jaxexp_mlflow.serving.frames import list_cells as list_cells
from jaxexp_mlflow.serving.frames import once as once
from jaxexp_mlflow.serving.signature import LeafSpec, input_error

__all__ = ["ENV_ALLOW_NAN", "ENVELOPES", "InputContract", "convert", "is_ml_float"]

ENVELOPES = ("inputs", "instances", "dataframe_split", "dataframe_records")
_FLAT_KEY = re.compile(r"^in_(\d+)$")
_MAX_LISTED = 8


def _shorten(keys: list[str]) -> str:
    shown = ", ".join(repr(k[:40]) for k in keys[:_MAX_LISTED])
    return shown + (f" and {len(keys) - _MAX_LISTED} more" if len(keys) > _MAX_LISTED else "")


def _flatten(mapping: Mapping, names: set[str], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"image": v}}`` -> ``{"a.image": v}`` (a key that is an input name stays whole)."""
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and name not in names:
            out.update(_flatten(value, names, name + "."))
        else:
            out[name] = value
    return out


class InputContract:
    """The inputs of one model (``LeafSpec`` list, signature names) and how forms map to them."""

    def __init__(self, specs: list[LeafSpec], *, allow_nan: bool = False) -> None:
        self.specs = list(specs)
        self.names = [s.name for s in self.specs]
        self.by_name = {s.name: s for s in self.specs}
        self.allow_nan = allow_nan

    def expected(self) -> str:
        """``ids: int32[-1]; num: float32[-1,3]`` (cut after a few inputs)."""
        text = "; ".join(s.describe() for s in self.specs[:_MAX_LISTED])
        extra = len(self.specs) - _MAX_LISTED
        return text + (f"; and {extra} more" if extra > 0 else "")

    # -- forms -> {name: raw value} ---------------------------------------------------------------

    def named(self, data: Any) -> dict[str, Any]:
        """Map any accepted form to ``{input name: raw value}`` (see the module docstring)."""
        import pandas as pd

        if isinstance(data, pd.DataFrame):
            return self._frame(data)
        if isinstance(data, Mapping):
            return self._mapping(data)
        if isinstance(data, list) and data and all(isinstance(r, Mapping) for r in data):
            return records(data, self)
        if len(self.specs) == 1:
            return {self.names[0]: data}
        if isinstance(data, list | tuple) and len(data) == len(self.specs):
            return dict(zip(self.names, data, strict=True))  # by position
        raise InputError(
            f"Rule: a model with {len(self.specs)} inputs takes them by name (a dict or "
            f"DataFrame keyed {_shorten(self.names)}) or by position (a list of "
            f"{len(self.specs)}). Expected: {self.expected()}. Found: a "
            f"{type(data).__name__}{_len_of(data)}."
            + (
                " One array is one input: name each (over MLflow's JSON formats, which turn "
                'a list into one array: {"inputs": {"<name>": ..}}).'
                if isinstance(data, np.ndarray)
                else ""
            )
        )

    def _frame(self, frame: Any) -> dict[str, Any]:
        cols = frame_columns(frame, self)
        positions = [str(i) for i in range(len(self.specs))]
        if len(self.specs) > 1 and cols == positions and not set(cols) & set(self.names):
            # columns "0", "1", ...: by position (spark_udf names the columns it is given so
            # when the signature declares no inputs)
            return {n: column(frame[c]) for n, c in zip(self.names, frame.columns, strict=True)}
        if set(self.names) <= set(cols) or len(self.specs) > 1:
            return {str(c): column(frame[c]) for c in frame.columns}
        spec = self.specs[0]
        if len(spec.shape) == 2 and len(cols) > 1:
            return {spec.name: frame.to_numpy()}  # n scalar feature columns
        if len(cols) != 1:
            shown = f" {_shorten(cols)}" if cols else ""
            raise input_error(spec, f"a DataFrame with {len(cols)} columns{shown}")
        return {spec.name: column(frame[frame.columns[0]])}

    def _mapping(self, data: Mapping) -> dict[str, Any]:
        keys = [str(k) for k in data]
        envelope = [k for k in keys if k in ENVELOPES and k not in self.by_name]
        if envelope and len(envelope) == 1 and set(keys) <= {envelope[0], "params"}:
            payload = data[envelope[0]]
            if envelope[0] == "dataframe_split":
                return self.named(from_split(self, payload))
            if envelope[0] == "dataframe_records":
                return self.named(from_records(self, payload))
            return self.named(payload)
        flat = [_FLAT_KEY.match(k) for k in keys]
        if keys and all(flat) and not (set(keys) & set(self.names)):
            by_index = {int(m.group(1)): data[k] for m, k in zip(flat, data, strict=True)}
            if sorted(by_index) != list(range(len(self.specs))):
                raise InputError(
                    f"Rule: positional keys are in_0..in_{len(self.specs) - 1}, one per input. "
                    f"Expected: {self.expected()}. Found keys: {_shorten(keys)}."
                )
            return {self.names[i]: by_index[i] for i in range(len(self.specs))}
        if len(self.specs) == 1 and self.names[0] not in keys and len(keys) == 1:
            return {self.names[0]: next(iter(data.values()))}  # one input under another name
        return _flatten(data, set(self.names))

    # -- {name: raw} -> leaves --------------------------------------------------------------------

    def leaves(self, data: Any, *, wire: bool = False) -> list[np.ndarray]:
        """Validate and cast ``data`` into the input leaves (exported dtypes, or wire dtypes)."""
        named = self.named(data)
        unknown = [k for k in named if k not in self.by_name]
        missing = [n for n in self.names if n not in named]
        if missing or unknown:
            parts = []
            if missing:
                parts.append(f"missing {_shorten(missing)}")
            if unknown:
                parts.append(f"unknown {_shorten(unknown)}")
            raise InputError(
                f"Rule: every input by its signature name (or by position). Found "
                f"{' and '.join(parts)}. Expected: {self.expected()}."
            )
        values = [
            once(v, s, self.allow_nan) if not s.batched else v
            for v, s in zip((named[n] for n in self.names), self.specs, strict=True)
        ]
        if self._unbatched(values):
            values = [
                np.expand_dims(np.asarray(v), 0) if s.batched else v
                for v, s in zip(values, self.specs, strict=True)
            ]
        out = [
            convert(v, s, dtype=s.wire_dtype if wire else None, allow_nan=self.allow_nan)
            for v, s in zip(values, self.specs, strict=True)
        ]
        if len(out) > 1:
            self.check_symbols(out)
        return out

    def _unbatched(self, values: list[Any]) -> bool:
        """Whether every input is one example: one rank short of a batched (``-1``) spec (an
        input that is one value for the whole batch, ``batched=False``, aside)."""
        batched = [(v, s) for v, s in zip(values, self.specs, strict=True) if s.batched]
        if len(batched) < len(values) and not batched:
            return False  # only one-value inputs: nothing to add a batch axis to
        for v, s in batched:
            if not s.shape or s.shape[0] is not None:
                return False
            if isinstance(v, np.ndarray):
                rank = v.ndim
            elif isinstance(v, list | tuple | int | float | bool | np.generic):
                rank = _list_rank(v)
            else:
                return False
            if rank != len(s.shape) - 1:
                return False
        return True

    def check_symbols(self, leaves: list[np.ndarray]) -> None:
        """Refuse inputs that share a symbolic dimension with different sizes along it."""
        seen: dict[str, tuple[int, str]] = {}
        for spec, arr in zip(self.specs, leaves, strict=True):
            for axis, sym in enumerate(spec.symbols):
                if sym is None:
                    continue
                size = arr.shape[axis]
                if sym in seen and seen[sym][0] != size:
                    first_size, first = seen[sym]
                    raise InputError(
                        f"Rule: inputs sharing a dimension have one size along it. Found "
                        f"inputs '{first}' and '{spec.name}' sharing dimension {sym!r} with sizes "
                        f"{first_size} and {size}. Expected: {self.expected()}."
                    )
                seen.setdefault(sym, (size, spec.name))


def _unnamed(label: Any) -> bool:
    """A column label that names nothing: None, NaN or empty text."""
    return label is None or (isinstance(label, float) and label != label) or label == ""


def frame_columns(frame: Any, contract: InputContract) -> list[str]:
    """A DataFrame's column names as text, each a single, present name used once.

    MLflow's server builds the DataFrame of ``dataframe_split`` / ``dataframe_records`` (and
    parquet, CSV) as sent: ``columns`` may repeat a name (``frame[name]`` is then a DataFrame,
    not a column), nest lists (a MultiIndex: tuple labels), hold ``null`` (a None/NaN label)
    or numbers, which their text may collide with (``1`` and ``"1"``). Every such shape is an
    ``InputError`` stating the rule before a column is read.
    """
    import pandas as pd

    if isinstance(frame.columns, pd.MultiIndex) or frame.columns.nlevels != 1:
        raise InputError(
            "Rule: a DataFrame's columns are one level of names, one per input (or feature). "
            f"Found {frame.columns.nlevels} levels of column labels (nested lists in "
            f"'columns'). Expected inputs: {contract.expected()}."
        )
    labels = list(frame.columns)
    unnamed = [i for i, c in enumerate(labels) if _unnamed(c)]
    if unnamed:
        raise InputError(
            "Rule: every DataFrame column has a name (an input name, or a feature name). "
            f"Found {len(unnamed)} column(s) without one (null or empty), the first at position "
            f"{unnamed[0]}. Expected inputs: {contract.expected()}."
        )
    cols = [str(c) for c in labels]
    if len(set(cols)) != len(cols):
        seen: set[str] = set()
        repeated = [c for c in cols if c in seen or seen.add(c)]
        raise InputError(
            "Rule: a DataFrame names each column once. Found "
            f"{len(cols)} columns with repeated names {_shorten(sorted(set(repeated)))}. "
            f"Expected inputs: {contract.expected()}."
        )
    return cols


def _len_of(data: Any) -> str:
    return f" of length {len(data)}" if isinstance(data, list | tuple) else ""


def _keys_of(rec: Mapping) -> list[str]:
    return [str(k) for k in rec]


def records(data: list, contract: InputContract | None = None) -> dict[str, list]:
    """A list of ``{name: value}`` records as ``{name: [values]}``.

    Every record must have exactly the keys of the first (with ``contract``: the signature's
    input names), checked record by record before anything is gathered: a record with other
    keys or another count is an ``InputError``, never a column padded or misaligned.
    """
    if not data:
        return {}
    if contract is not None:
        expected_keys = contract.names
        expected_set = set(expected_keys)
        first_ok = set(_keys_of(data[0])) == expected_set and len(data[0]) == len(expected_keys)
        if not first_ok:
            _record_error(contract, 0, data[0], expected_keys, "the signature's input names")
    _check_uniform(data, contract)
    columns: dict[str, list] = {str(k): [] for k in data[0]}
    for rec in data:
        for key, val in rec.items():
            columns[str(key)].append(val)
    return columns


def _check_uniform(data: list, contract: InputContract | None) -> None:
    """Every record has the keys of the first (same count, same names): linear in the input."""
    first = data[0]
    keys = first.keys()
    n = len(first)
    for i, rec in enumerate(data):
        if len(rec) != n or rec.keys() != keys:
            _record_error(contract, i, rec, _keys_of(first), "the keys of the first record")


def _record_error(
    contract: InputContract | None, index: int, rec: Mapping, expected_keys: list[str], what: str
) -> None:
    shown = ", ".join(repr(str(k)[:40]) for k in itertools.islice(rec, _MAX_LISTED))
    if len(rec) > _MAX_LISTED:
        shown += f" and {len(rec) - _MAX_LISTED} more"
    inputs = f" Inputs: {contract.expected()}." if contract is not None else ""
    raise InputError(
        f"Rule: every record holds one value per column, keyed by {what}. Expected "
        f"{len(expected_keys)} keys: {_shorten(expected_keys)}. Found record {index} with "
        f"{len(rec)} keys: {shown or 'none'}.{inputs}"
    )


def from_split(contract: InputContract, payload: Any) -> Any:
    """MLflow's ``dataframe_split`` object as ``{name: rows}`` (or the rows of a single input)."""
    if not isinstance(payload, dict) or not isinstance(payload.get("data"), list):
        found = "an object without a 'data' list" if isinstance(payload, dict) else "not one"
        raise InputError(
            "Rule: dataframe_split is an object {'columns': [...], 'data': [[...], ...]}. "
            f"Found {found}. Expected inputs: {contract.expected()}."
        )
    rows = payload["data"]
    columns = payload.get("columns")
    if len(contract.specs) == 1 and columns != contract.names:
        return {contract.names[0]: rows}  # scalar columns: the rows are the rows of the input
    if not isinstance(columns, list):
        raise InputError(
            "Rule: dataframe_split needs 'columns' naming the inputs and rows with one value per "
            f"column. Found no 'columns' list. Expected inputs: {contract.expected()}."
        )
    for i, r in enumerate(rows):
        if not isinstance(r, list) or len(r) != len(columns):
            cells = f"{len(r)} cells" if isinstance(r, list) else "not a list"
            raise InputError(
                "Rule: dataframe_split needs 'columns' naming the inputs and rows with one value "
                f"per column. Found row {i} with {cells} for {len(columns)} columns. Expected "
                f"inputs: {contract.expected()}."
            )
    return {str(c): [r[i] for r in rows] for i, c in enumerate(columns)}


def from_records(contract: InputContract, payload: Any) -> Any:
    """MLflow's ``dataframe_records`` list as ``{name: values}``."""
    if not isinstance(payload, list) or not all(isinstance(r, dict) for r in payload):
        found = "a list holding other values" if isinstance(payload, list) else "not a list"
        raise InputError(
            f"Rule: dataframe_records is a list of objects {{column: value}}. Found {found}. "
            f"Expected inputs: {contract.expected()}."
        )
    if not payload:
        return {n: [] for n in contract.names}
    cols = list(payload[0])
    if len(contract.specs) == 1 and [str(c) for c in cols] != contract.names:
        # feature columns of the single input: checked for width before the rows are built
        spec = contract.specs[0]
        width = spec.shape[1] if len(spec.shape) == 2 else None
        if width is not None and len(cols) != width:
            raise input_error(
                spec,
                f"records of {len(cols)} columns",
                f"Send records of {width} feature columns, or records keyed {spec.name!r}.",
            )
        _check_uniform(payload, contract)
        return {contract.names[0]: [[r[c] for c in cols] for r in payload]}
    return records(payload, contract)


def read_csv(csv_input: Any, contract: InputContract | None = None) -> Any:
    """A CSV body as a DataFrame for the contract: numbers as read, JSON-list cells decoded.

    MLflow's own CSV parser cannot read a tensor-signature model's input (it asks the schema for
    pandas dtypes, which a ``TensorSpec`` schema does not have) and answers with a stack trace.
    Scalar feature columns feed a ``[-1, n]`` input; a column of ``"[1, 2]"`` cells feeds a
    ``[-1, 2]`` input; strings are refused by ``convert`` like anywhere else.

    Before pandas sees the body, every row is checked to have one cell per header column (and,
    with ``contract``, the header to fit the inputs): pandas pads short rows to the header's
    width, so a long header over many one-cell rows would cost rows x columns.
    """
    import io

    import pandas as pd

    text = _csv_text(csv_input)
    check_csv_width(text, contract)
    try:
        frame = pd.read_csv(io.StringIO(text))
    except (ValueError, pd.errors.ParserError) as err:
        raise InputError(
            f"Rule: a CSV body is a header row of input names and one row per example. "
            f"Found unreadable CSV ({str(err)[:120]})."
        ) from None
    for col in frame.columns:
        values = frame[col]
        text_col = values.dtype == object or pd.api.types.is_string_dtype(values.dtype)
        if text_col:
            decoded = list_cells(values.to_numpy(dtype=object), col)
            if decoded is not None:
                frame[col] = decoded
    return frame


def _csv_text(csv_input: Any) -> str:
    """The CSV as text: a stream's content, bytes as UTF-8, or the file a path names."""
    import os

    if hasattr(csv_input, "read"):
        data = csv_input.read()
    elif isinstance(csv_input, str | os.PathLike):
        with open(csv_input, "rb") as fh:
            data = fh.read()
    else:
        data = csv_input
    if isinstance(data, bytes | bytearray):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError:
            raise InputError(
                "Rule: a CSV body is UTF-8 text: a header row of input names and one row per "
                "example. Found bytes that are not UTF-8."
            ) from None
    if not isinstance(data, str):
        raise InputError(f"Rule: a CSV body is text. Found a {type(data).__name__}.")
    return data


def check_csv_width(text: str, contract: InputContract | None = None) -> None:
    """Refuse CSV rows with another cell count than the header, and headers the inputs cannot
    take (with ``contract``), reading one row at a time: linear in the text, nothing widened."""
    import csv
    import io

    reader = csv.reader(io.StringIO(text, newline=""))
    header: list[str] | None = None
    try:
        for row in reader:
            if not row or (len(row) == 1 and not row[0].strip()):
                continue  # blank lines, skipped as pandas does
            if header is None:
                header = row
                if contract is not None:
                    _check_csv_header(header, contract)
                continue
            if len(row) != len(header):
                inputs = f" Inputs: {contract.expected()}." if contract is not None else ""
                raise InputError(
                    "Rule: a CSV body is a header row and one row per example, with one cell "
                    f"per header column. Expected {len(header)} cells per row (header: "
                    f"{_shorten(header)}). Found line {reader.line_num} with {len(row)} "
                    f"cells.{inputs}"
                )
    except csv.Error as err:
        raise InputError(
            f"Rule: a CSV body is a header row of input names and one row per example. "
            f"Found unreadable CSV ({str(err)[:120]})."
        ) from None


def _check_csv_header(header: list[str], contract: InputContract) -> None:
    names = contract.names
    if len(header) == len(names) and set(header) == set(names):
        return
    if len(contract.specs) == 1:
        spec = contract.specs[0]
        if len(header) == 1:
            return  # one column: the input's values (scalars or JSON-list cells)
        if len(spec.shape) == 2 and spec.shape[1] in (None, len(header)):
            return  # n scalar feature columns, any names
        width = spec.shape[1] if len(spec.shape) == 2 else None
        hint = (
            f"Send {width} feature columns or one column of JSON lists."
            if width is not None
            else f"Send one column {spec.name!r}."
        )
        raise input_error(spec, f"a CSV header of {len(header)} columns", hint)
    missing = [n for n in names if n not in set(header)]
    unknown = [h for h in header if h not in contract.by_name]
    parts = [f"missing {_shorten(missing)}"] if missing else []
    parts += [f"unknown {_shorten(unknown)}"] if unknown else []
    if len(header) != len(set(header)):
        parts.append("repeated columns")
    raise InputError(
        f"Rule: a CSV header names every input once (one column per input). Found a header of "
        f"{len(header)} columns: {' and '.join(parts)}. Expected: {contract.expected()}."
    )
