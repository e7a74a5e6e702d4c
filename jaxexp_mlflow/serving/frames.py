"""Row forms of the input contract: DataFrame columns, JSON-list text cells and one-value inputs.

A DataFrame column becomes an array (:func:`column`: scalar cells 1-D, list or array cells
stacked), CSV's text cells holding JSON lists are decoded with a bound on their nesting
(:func:`list_cells`), and an input that is one value for the whole batch, sent once per row by
a row form, is checked to repeat one value and taken once (:func:`once`). They depend on no
``InputContract``, so they live below ``serving/inputs.py``, which applies them and re-exports
them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxexp_mlflow.errors import InputError
from jaxexp_mlflow.serving.casts import convert
from jaxexp_mlflow.serving.signature import LeafSpec, input_error


def once(value: Any, spec: LeafSpec, allow_nan: bool = False) -> Any:
    """The one value of an input that is the same for the whole batch (``spec.batched`` is
    False: a PRNG key beside batched inputs). Sent once, it is taken as it is; sent once per
    row (a column of a row form: ``dataframe_split``, ``dataframe_records``, records, CSV),
    its rows must all be equal and the first is taken: it is never sliced per row.

    Args:
        value: the raw value sent for the input (array, nested list, scalar).
        spec: the input's ``LeafSpec`` (``batched`` False).
        allow_nan: whether NaN/inf pass the cast of a repeated value (``convert``).

    Returns:
        The value to convert: as sent, or the first of its equal rows.

    Raises:
        InputError: the rows sent for it differ.
    """
    if isinstance(value, np.ndarray):
        rank = value.ndim
    elif isinstance(value, list | tuple):
        rank = _list_rank(value)
    else:
        return value
    if rank != len(spec.shape) + 1 or len(value) == 0:
        return value
    rows = convert(value, _per_row(spec), allow_nan=allow_nan)
    if not (rows == rows[:1]).all():
        raise input_error(
            spec,
            f"{len(rows)} rows that differ",
            "It is one value for the whole batch (batched: false in MLmodel's io): send it "
            "once, or the same value in every row.",
        )
    return rows[0]


def _per_row(spec: LeafSpec) -> LeafSpec:
    """``spec`` with one leading batch axis more: how a row form carries a one-value input."""
    import dataclasses

    return dataclasses.replace(
        spec, shape=(None, *spec.shape), symbols=(None, *spec.symbols), batched=True
    )


def _list_rank(value: Any) -> int:
    rank = 0
    while isinstance(value, list | tuple):
        if not value:
            return rank + 1
        rank, value = rank + 1, value[0]
    return rank


#: Deepest list a CSV/DataFrame text cell may hold: XLA's arrays have far fewer dimensions.
MAX_CELL_DEPTH = 64


def _nesting(text: str) -> int:
    """How deep the brackets of a text cell nest (its strings aside: cells hold numbers)."""
    depth = deepest = 0
    for ch in text:
        if ch == "[":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == "]":
            depth -= 1
    return deepest


def list_cells(values: Any, name: Any = None) -> np.ndarray | None:
    """Text cells that are all JSON lists (``"[1, 2]"``, CSV's form of an array cell) decoded,
    or None where they are not all such text. A cell that starts like a list but is not JSON, or
    nests deeper than the JSON parser goes, is an ``InputError`` naming the column and row."""
    import json

    if len(values) == 0 or not isinstance(values[0], str):
        return None
    if not all(isinstance(v, str) and v.lstrip().startswith("[") for v in values):
        return None
    out = np.empty(len(values), dtype=object)  # one list per cell, never broadcast
    for row, text in enumerate(values):
        try:
            if _nesting(text) > MAX_CELL_DEPTH:  # before the parser: Python 3.12+ parses deeper
                raise RecursionError
            out[row] = json.loads(text)
        except (ValueError, RecursionError) as err:
            what = "nests too deeply" if isinstance(err, RecursionError) else "is not JSON"
            where = f"column {str(name)[:40]!r}, " if name is not None else ""
            raise InputError(
                "Rule: a text cell holding an array is a JSON list of numbers. Expected cells "
                f'like "[1, 2]", as deep as the input\'s rank. Found in {where}row {row} a cell '
                f"that {what}."
            ) from None
    return out


def column(series: Any) -> Any:
    """A DataFrame column as an array: scalar cells -> 1-D, array/list cells -> stacked
    (text cells holding JSON lists, as CSV carries arrays, decoded first)."""
    values = series.to_numpy()
    if values.dtype == object:
        decoded = list_cells(values, series.name)
        if decoded is not None:
            values = decoded
    if values.dtype == object and len(values) and isinstance(values[0], list | tuple | np.ndarray):
        first = values[0]
        if isinstance(first, np.ndarray) and first.ndim and set(map(type, values)) == {np.ndarray}:
            # Arrow's list cells (Spark): one concatenation, ~6x faster than a stack of rows
            if len(set(map(len, values))) == 1:
                try:
                    flat = np.concatenate(values)
                except ValueError:
                    return values  # ragged: refused by convert
                return flat.reshape(len(values), *first.shape)
        try:
            return np.stack([np.asarray(v) for v in values])
        except ValueError:
            return values  # ragged: refused by convert
    return values
