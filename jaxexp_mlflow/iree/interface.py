"""The compiled module's interface against the blob's avals: element-type tables and checks.

IREE's HAL and MLIR element type for each numpy dtype the backend passes, the check of a compiled
function's ABI declaration (element types, ranks, static sizes) against the blob's avals at load,
and the HAL element types a result may come back as, which the per-call buffer checks use. Kept
apart from the callable model (``iree/model.py``) so each stays small; nothing here imports JAX
or the IREE runtime.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from jaxexp_mlflow.errors import ArtifactError
from jaxexp_mlflow.iree import shapes

#: numpy dtype name -> IREE HAL element type name (the runtime's own map lacks the ml_dtypes).
_ELEMENT_TYPES = {
    "bool": "BOOL_8",
    "int8": "SINT_8",
    "int16": "SINT_16",
    "int32": "SINT_32",
    "int64": "SINT_64",
    "uint8": "UINT_8",
    "uint16": "UINT_16",
    "uint32": "UINT_32",
    "uint64": "UINT_64",
    "float16": "FLOAT_16",
    "bfloat16": "BFLOAT_16",
    "float32": "FLOAT_32",
    "float64": "FLOAT_64",
    "complex64": "COMPLEX_64",
    "complex128": "COMPLEX_128",
    "float8_e4m3fn": "FLOAT_8_E4M3_FN",
    "float8_e4m3fnuz": "FLOAT_8_E4M3_FNUZ",
    "float8_e5m2": "FLOAT_8_E5M2",
    "float8_e5m2fnuz": "FLOAT_8_E5M2_FNUZ",
}

#: numpy dtype name -> MLIR element type (as StableHLO and IREE's ABI declaration print it).
_MLIR_TYPES = {
    "bool": "i1",
    "int8": "i8",
    "int16": "i16",
    "int32": "i32",
    "int64": "i64",
    "uint8": "ui8",
    "uint16": "ui16",
    "uint32": "ui32",
    "uint64": "ui64",
    "float16": "f16",
    "bfloat16": "bf16",
    "float32": "f32",
    "float64": "f64",
    "complex64": "complex<f32>",
    "complex128": "complex<f64>",
    "float8_e4m3fn": "f8E4M3FN",
    "float8_e4m3fnuz": "f8E4M3FNUZ",
    "float8_e5m2": "f8E5M2",
    "float8_e5m2fnuz": "f8E5M2FNUZ",
}
_TENSOR = r"tensor<((?:[^<>]|<[^<>]*>)*)>"
_ENCODING = re.compile(r"iree\.abi\.encoding\s*=\s*" + _TENSOR)

MISMATCH_HINT = (
    "The compiled module does not compute what the blob declares: the model's prepared module "
    "(iree/) or an entry of the IREE compile cache was altered or belongs to another model. "
    "Download the model again (or run `jaxexp refresh` where JAX is installed to prepare it "
    "anew), or clear the IREE cache (JAXEXP_IREE_CACHE); the JAX backend reads the blob itself."
)


def _tensor_types(text: str, label: str) -> list[tuple[list[str], str]] | None:
    """The ``%input0: tensor<?x3xf32>`` items of one side of an ABI declaration as
    ``(["?", "3"], "f32")`` (the ``iree.abi.encoding`` type where IREE records one, e.g. for
    unsigned ints); ``([], "?")`` for a non-tensor item; None when the side is not labelled."""
    segments = re.split(rf"%{label}\d+\s*:", text)
    if len(segments) < 2:
        return None
    out = []
    for segment in segments[1:]:
        match = _ENCODING.search(segment) or re.search(_TENSOR, segment)
        if match is None:
            out.append(([], "?"))
            continue
        parts = re.split(r"x(?![^<]*>)", match.group(1))  # not inside complex<...>
        out.append((parts[:-1], parts[-1]))
    return out


def _accepted(rt: Any, dtype: str) -> frozenset[int]:
    """The HAL element types a result of ``dtype`` may come back as (IREE returns signless
    ints: ``INT_32`` for an ``int32`` result)."""
    names = {_ELEMENT_TYPES[dtype]}
    if dtype.startswith(("int", "uint")):
        names.add(f"INT_{np.dtype(dtype).itemsize * 8}")
    return frozenset(int(getattr(rt.HalElementType, n)) for n in names)


def _fits(aval: shapes.Aval, tensor: tuple[list[str], str]) -> bool:
    dims, element = tensor
    want = _MLIR_TYPES.get(aval.dtype)
    if want is not None and element != want:
        return False
    if len(dims) != len(aval.dims):
        return False
    pairs = zip(aval.dims, dims, strict=True)
    return all(not isinstance(a, int) or d in ("?", str(a)) for a, d in pairs)


def _mlir(aval: shapes.Aval) -> str:
    dims = ["?" if isinstance(d, str) else str(d) for d in aval.dims]
    return f"tensor<{'x'.join([*dims, _MLIR_TYPES.get(aval.dtype, aval.dtype)])}>"


def check_interface(
    function: Any,
    inputs: list[shapes.Aval],
    outputs: list[shapes.Aval],
    source: str,
) -> None:
    """Refuse (``ArtifactError``) a compiled ``function`` whose declared interface is not
    ``inputs -> outputs``: element types, ranks and static sizes, from IREE's ABI declaration.

    A function without a readable declaration is left to the call-time buffer checks.
    """
    declaration = (getattr(function, "reflection", None) or {}).get("iree.abi.declaration")
    if not isinstance(declaration, str) or "->" not in declaration:
        return
    args, results = declaration.split("->", 1)
    for side, avals, found in (
        ("input", inputs, _tensor_types(args, "input")),
        ("output", outputs, _tensor_types(results, "output")),
    ):
        if found is None:  # a declaration form this check does not know: left to the call
            if avals:
                continue
            found = []
        if len(found) != len(avals):
            raise ArtifactError(
                f"{source}: expected {len(avals)} {side}s as the blob declares "
                f"({[str(a) for a in avals]}), found a module with {len(found)} "
                f"({declaration[:300]}). {MISMATCH_HINT}"
            )
        for i, (aval, tensor) in enumerate(zip(avals, found, strict=True)):
            if not _fits(aval, tensor):
                got = f"tensor<{'x'.join([*tensor[0], tensor[1]])}>"
                raise ArtifactError(
                    f"{source}: {side} {i} is {got}, expected {aval} ({_mlir(aval)}) as the "
                    f"blob declares. {MISMATCH_HINT}"
                )


DTYPES_HINT = (
    f"which the IREE backend does not pass: expected some of {sorted(_ELEMENT_TYPES)}. Load it "
    "with the JAX backend."
)


def unsupported_dtypes(description: Any) -> list[str]:
    """The dtypes of the blob's inputs and outputs IREE's runtime cannot take or return."""
    avals = (*description.in_avals, *description.out_avals)
    return sorted({a.split("[", 1)[0] for a in avals} - set(_ELEMENT_TYPES))
