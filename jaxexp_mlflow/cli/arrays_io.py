"""Read model inputs from ``.npz``/``.npy``/``.json`` files and write outputs to them.

A file holds the model's inputs *after* its params in any form of the input contract
(``serving/inputs.py``, the table in docs/serving/pyfunc-rest.md), the same as ``pyfunc.predict``
and serving take: ``.npz`` keyed by the signature's input names (or ``in_0``, ``in_1``, ... by
position), ``.npy`` for a single input, ``.json`` as an object keyed by names, a list, or the
model's own ``input_example.json`` / ``serving_input_example.json`` (``{"inputs": ...}``,
``{"dataframe_split": ...}``...). Casts are lossless only. bfloat16 stored as raw ``uint16`` bits
(the reference-file convention) is viewed back. Outputs are flat leaves ``out_0``, ``out_1``, ...;
no pickle anywhere.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from jaxexp_mlflow.cli._common import InputProblem

SUFFIXES = (".npz", ".npy", ".json")


def _check_suffix(path: Path, what: str) -> str:
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise InputProblem(
            f"{what} {path} has suffix {suffix or '(none)'!r}; expected one of "
            f"{', '.join(SUFFIXES)}"
        )
    return suffix


def check_output_path(path: Path) -> None:
    """Refuse an output file whose suffix we cannot write or whose directory does not exist or
    is not writable: before the model runs, not after."""
    _check_suffix(path, "output file")
    parent = path.resolve().parent
    if not parent.is_dir():
        raise InputProblem(
            f"output file {path}: expected an existing directory to write it in, found no "
            f"directory {parent}; create it first or choose another path"
        )
    if not os.access(parent, os.W_OK):
        raise InputProblem(
            f"output file {path}: expected a writable directory, found {parent} read-only for "
            "this user; choose another path"
        )
    if path.is_dir():
        raise InputProblem(f"output file {path}: expected a file path, found a directory")


def read_payload(path: Path) -> Any:
    """The content of an input file: a dict of arrays (.npz), an array (.npy), decoded JSON."""
    suffix = _check_suffix(path, "input file")
    try:
        if suffix == ".npy":
            return np.load(path, allow_pickle=False)
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as data:
                return {k: data[k] for k in data.files}
        return json.loads(path.read_text())
    except FileNotFoundError as err:
        raise InputProblem(f"input file {path} does not exist") from err
    except (OSError, ValueError) as err:
        raise InputProblem(f"cannot read input file {path}: {str(err)[:200]}") from err


def _raw_bits(value: Any, dtype: np.dtype) -> Any:
    """ml_dtypes values (bfloat16...) stored as raw unsigned bits, viewed back."""
    if (
        isinstance(value, np.ndarray)
        and value.dtype.kind == "u"
        and dtype.kind == "V"
        and value.dtype.itemsize == dtype.itemsize
    ):
        return value.view(dtype)
    return value


def input_leaves(payload: Any, specs: list) -> list[np.ndarray]:
    """The model's input leaves from a file's content, by the input contract."""
    from jaxexp_mlflow.serving.inputs import InputContract

    contract = InputContract(specs)
    named = contract.named(payload)
    named = {
        k: _raw_bits(v, contract.by_name[k].dtype) if k in contract.by_name else v
        for k, v in named.items()
    }
    return contract.leaves(named)


def iree_input_specs(model: Any, flavor: dict | None) -> list:
    """The input ``LeafSpec`` list of an ``IreeModel``, without JAX: the names stored in the
    MLmodel, else (a bare blob) the blob's avals named by position (``in_0``, ...)."""
    from jaxexp_mlflow.codec.arrays import resolve_dtype
    from jaxexp_mlflow.serving.signature import LeafSpec, specs_from_conf, wire_dtype

    stored = specs_from_conf(flavor or {})
    if stored is not None:
        return stored[0]
    specs = []
    for i, aval in enumerate(model.in_avals[model.n_param_leaves :]):
        dtype = np.dtype(resolve_dtype(aval.dtype))
        shape = tuple(d if isinstance(d, int) else None for d in aval.dims)
        symbols = tuple(None if isinstance(d, int) else d for d in aval.dims)
        specs.append(LeafSpec(f"in_{i}", dtype, wire_dtype(dtype), shape, symbols))
    return specs


def call_args(exported: Any, has_params: bool, leaves: list[np.ndarray]) -> tuple[tuple, dict]:
    """``(args, kwargs)`` to call the model with (params excluded) from its input leaves."""
    from jaxexp_mlflow.serving.signature import input_structure

    treedef, _, _ = input_structure(exported, has_params)
    args, kwargs = treedef.unflatten(leaves)
    return tuple(args), kwargs


def input_specs(exported: Any, has_params: bool, flavor: dict | None) -> list:
    """The input ``LeafSpec`` list: the names stored in the MLmodel, else inferred."""
    from jaxexp_mlflow.serving.signature import leaf_specs, specs_from_conf

    stored = specs_from_conf(flavor or {})
    if stored is not None:
        return stored[0]
    return leaf_specs(exported, has_params=has_params)[0]


def write_outputs(path: Path, leaves: list[np.ndarray]) -> None:
    """Write flat output leaves: ``.npz`` (out_i), ``.npy`` (single output) or ``.json``."""
    from jaxexp_mlflow.codec.arrays import save_arrays

    suffix = _check_suffix(path, "output file")
    if suffix == ".npz":
        save_arrays(path, leaves, "out")
    elif suffix == ".npy":
        if len(leaves) != 1:
            raise InputProblem(
                f"the model returns {len(leaves)} output leaves; .npy holds one array: use "
                ".npz or .json"
            )
        np.save(path, leaves[0], allow_pickle=False)
    else:
        payload = {f"out_{i}": to_json_value(a) for i, a in enumerate(leaves)}
        path.write_text(json.dumps(payload))


def to_json_value(arr: np.ndarray) -> Any:
    """Nested lists of Python numbers (non-native float types go through float32)."""
    a = np.asarray(arr)
    if a.dtype.kind not in "biufc":
        a = a.astype(np.float32)
    return a.tolist()
