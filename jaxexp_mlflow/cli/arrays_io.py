"""Read model inputs from ``.npz``/``.npy``/``.json`` files and write outputs to them.

Inputs are the model's inputs *after* its params, in the order of the exported ``in_tree``:

- ``.npz`` with keys ``in_0``, ``in_1``, ... (the reference/corpus convention): the flat leaves;
  with other keys: one positional input per array, in file order;
- ``.npy``: the single input array;
- ``.json``: a list (the single input), ``{"in_0": ..., ...}`` (flat leaves), ``{"inputs": X}``
  (MLflow serving style, X a list or such a dict), or any other object (positional inputs in key
  order).

Leaves are converted to the dtypes the model expects (bfloat16 stored as raw ``uint16`` bits is
viewed back). Outputs are flat leaves ``out_0``, ``out_1``, ...; no pickle anywhere.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from jaxexp_mlflow.cli._common import InputProblem

_FLAT_KEY = re.compile(r"^in_(\d+)$")
SUFFIXES = (".npz", ".npy", ".json")


def aval_dtype(aval: str) -> np.dtype:
    """The numpy dtype of an aval string such as ``float32[b,8]`` or ``bfloat16[]``."""
    from jaxexp_mlflow.codec.arrays import resolve_dtype

    return resolve_dtype(aval.split("[", 1)[0])


def _check_suffix(path: Path, what: str) -> str:
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise InputProblem(
            f"{what} {path} has suffix {suffix or '(none)'!r}; expected one of "
            f"{', '.join(SUFFIXES)}"
        )
    return suffix


def _flat_or_positional(named: dict[str, Any]) -> tuple[str, list[Any]]:
    keys = list(named)
    flat = [_FLAT_KEY.match(k) for k in keys]
    if keys and all(flat):
        order = sorted(range(len(keys)), key=lambda i: int(flat[i].group(1)))  # type: ignore[union-attr]
        idx = [int(flat[i].group(1)) for i in order]  # type: ignore[union-attr]
        if idx != list(range(len(keys))):
            raise InputProblem(f"flat input keys must be in_0..in_{len(keys) - 1}, found {keys}")
        return "flat", [named[keys[i]] for i in order]
    return "positional", [named[k] for k in keys]


def read_inputs(path: Path) -> tuple[str, list[Any]]:
    """``("flat" | "positional", arrays)`` from an input file (see the module docstring)."""
    suffix = _check_suffix(path, "input file")
    try:
        if suffix == ".npy":
            return "positional", [np.load(path, allow_pickle=False)]
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as data:
                return _flat_or_positional({k: data[k] for k in data.files})
        payload = json.loads(path.read_text())
    except FileNotFoundError as err:
        raise InputProblem(f"input file {path} does not exist") from err
    except (OSError, ValueError) as err:
        raise InputProblem(f"cannot read input file {path}: {err}") from err
    if isinstance(payload, dict) and set(payload) == {"inputs"}:
        payload = payload["inputs"]
    if isinstance(payload, list):
        return "positional", [payload]
    if isinstance(payload, dict) and payload:
        return _flat_or_positional(payload)
    raise InputProblem(
        f"{path}: expected a JSON list (the input array) or an object of arrays, found "
        f"{type(payload).__name__}"
    )


def coerce(value: Any, dtype: np.dtype, where: str) -> np.ndarray:
    """``value`` as an array of ``dtype`` (raw-bits views for bfloat16 and friends)."""
    arr = np.asarray(value)
    if arr.dtype == dtype:
        return arr
    if arr.dtype.kind == "u" and dtype.kind == "V" and arr.dtype.itemsize == dtype.itemsize:
        return arr.view(dtype)  # ml_dtypes (bfloat16...) stored as raw bits
    if arr.dtype.kind in "OUS":
        raise InputProblem(f"{where}: expected numbers of dtype {dtype}, found {arr.dtype}")
    try:
        return arr.astype(dtype)
    except (TypeError, ValueError) as err:
        raise InputProblem(f"{where}: cannot convert {arr.dtype} to {dtype}: {err}") from err


def build_args(exported: Any, n_param_leaves: int, mode: str, arrays: list[Any]) -> tuple:
    """``(args, kwargs)`` to call the model with (params excluded) from the file's arrays."""
    import jax

    expected = exported.in_avals[n_param_leaves:]
    args_tree, kwargs_tree = exported.in_tree.children()
    if mode == "positional":
        n_args = len(args_tree.children()) - (1 if n_param_leaves else 0)
        if kwargs_tree.num_leaves == 0 and len(arrays) == n_args:
            leaves_per_arg = (
                [c.num_leaves for c in args_tree.children()[-n_args:]] if n_args else []
            )
            if all(n == 1 for n in leaves_per_arg):
                mode = "flat"  # one array per positional input: same as flat leaves
        if mode == "positional":
            raise InputProblem(
                f"the model takes {len(expected)} input leaves ({[str(a) for a in expected]}, "
                f"in_tree {exported.in_tree}), the file holds {len(arrays)} array(s); store the "
                "flat leaves as in_0, in_1, ... (.npz or JSON object)"
            )
    if len(arrays) != len(expected):
        raise InputProblem(
            f"the model takes {len(expected)} input leaves {[str(a) for a in expected]}, the "
            f"file holds {len(arrays)}"
        )
    leaves = [
        coerce(a, np.dtype(aval_dtype(str(e))), f"input {i} ({e})")
        for i, (a, e) in enumerate(zip(arrays, expected, strict=True))
    ]
    full = [None] * n_param_leaves + leaves
    args, kwargs = jax.tree.unflatten(exported.in_tree, full)
    if n_param_leaves:
        args = args[1:]
    return tuple(args), kwargs


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
