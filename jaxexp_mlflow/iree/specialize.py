"""Specialize a symbolic-batch StableHLO module to static shapes, without JAX.

IREE 3.13 cannot compile some ops of a ``jax.export`` module whose batch dimension is symbolic:
a ``gather`` with a symbolic result (embedding lookups) and a ``dynamic_reshape`` (a flatten
``x.reshape(x.shape[0], -1)``). JAX itself runs such a module by refining its shapes for the
actual arguments (``stablehlo-refine-shapes``, a pass IREE links but does not register, and that
JAX offers only privately). This module does the same for one static batch, with the IREE
compiler's own MLIR bindings and passes:

1. :func:`stablehlo_text`: the portable artifact (VHLO) as StableHLO text, printed by
   ``iree-compile`` after IREE's input pipeline legalized VHLO (``--mlir-print-ir-after=
   chlo-legalize-to-stablehlo``, whole module, into a temporary directory);
2. :func:`specialize` (in a child process: :func:`static_main`): the private functions
   inlined into ``main`` (JAX passes the dimension variable to them as an argument),
   ``main``'s arguments given their static types, IREE's StableHLO canonicalizer run
   (``get_dimension_size`` becomes a constant, the shape arithmetic
   folds, ``dynamic_broadcast_in_dim`` and ``dynamic_reshape`` of constant shapes become static
   ops) and, until nothing changes, every result type refined from its operands: by the op's own
   type inference (``Operation.create(..., infer_type=True)``), or here for the ops without one
   (``dot_general``, ``convolution``, ``reduce``, ``real_dynamic_slice``, the ``dynamic_*`` ops
   of constant shapes). A module left with a dynamic type anywhere is refused
   (:class:`SpecializeError`, naming the op): nothing half-specialized reaches the compiler.
   Then the rewrites of ``rewrites`` (same math, faster IREE code: single-input-channel
   convolutions as im2col), the narrowing float converts made to keep their rounding
   (``roundings``; :func:`rounded_text` does the same for a module compiled as it is) and,
   where asked, the params made module parameters (:func:`bind_arguments`).

The result is compiled like any StableHLO text (``compiler.compile_module`` with a
:data:`STATIC` entry); the compile cache keys it by the original module and the static shapes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from jaxexp_mlflow.iree import rewrites, roundings

#: The ``compiler.Entry`` name that means: ``main`` itself, specialized to the entry's shapes.
#: Part of the compile cache key: its suffix is bumped whenever what is compiled changes.
STATIC = "jaxexp_static_main.4"
#: The pass after which IREE's input pipeline prints the module (VHLO is legalized before it).
_PRINT_AFTER = "chlo-legalize-to-stablehlo"
_MAX_ROUNDS = 8
#: Ops whose regions are branches (not isolated from ``main``: they read its values, and their
#: results are what the taken branch returns): ``lax.cond`` and a multi-platform export's
#: dispatch on the platform index lower to ``stablehlo.case``.
_BRANCHING = frozenset({"stablehlo.case", "stablehlo.if"})
#: Ops whose result has their first operand's shape but whose type is not inferred (the result
#: element type is the op's choice).
_SAME_SHAPE = frozenset(
    {
        "stablehlo.convert",
        "stablehlo.reduce_precision",
        "stablehlo.is_finite",
        "stablehlo.real",
        "stablehlo.imag",
        "stablehlo.complex",
        "stablehlo.uniform_quantize",
        "stablehlo.uniform_dequantize",
        "chlo.is_inf",
        "chlo.is_neg_inf",
        "chlo.is_pos_inf",
    }
)
_SHAPE_OPERAND = {
    "stablehlo.dynamic_broadcast_in_dim": 1,
    "stablehlo.dynamic_reshape": 1,
    "stablehlo.dynamic_iota": 0,
}


class SpecializeError(Exception):
    """The module could not be specialized to static shapes (the message says where)."""


def stablehlo_text(module: bytes, timeout: float = 600.0) -> str:
    """The StableHLO text of ``module`` (a portable artifact, or StableHLO bytecode or text), as
    ``iree-compile``'s input pipeline sees it once VHLO is legalized."""
    from iree.compiler.tools.binaries import find_tool

    with tempfile.TemporaryDirectory(prefix="jaxexp-iree-") as tmp:
        src = Path(tmp, "module.mlirbc")
        src.write_bytes(module)
        tree = Path(tmp, "tree")
        command = [
            find_tool("iree-compile"),
            "--iree-input-type=stablehlo",
            "--iree-hal-target-backends=llvm-cpu",
            "--compile-to=input",
            f"--mlir-print-ir-after={_PRINT_AFTER}",
            "--mlir-print-ir-module-scope",
            "--mlir-disable-threading",
            f"--mlir-print-ir-tree-dir={tree}",
            str(src),
            "-o",
            str(Path(tmp, "out.mlir")),
        ]
        # the input pipeline may fail further on (the very ops this works around): the dump
        # written before that is what is wanted
        run = subprocess.run(command, capture_output=True, timeout=timeout, check=False)
        dumps = sorted(tree.rglob("*.mlir")) if tree.is_dir() else []
        if not dumps:
            raise SpecializeError(
                "iree-compile printed no StableHLO for the module (exit "
                f"{run.returncode}): {run.stderr.decode(errors='replace')[:500]}"
            )
        text = dumps[0].read_text()
    return text[text.index("\n") + 1 :] if text.startswith("//") else text


def static_main(
    module: bytes,
    inputs: tuple[tuple[int, ...], ...],
    outputs: tuple[tuple[int, ...], ...],
    bound: tuple[int, ...] = (),
    timeout: float = 600.0,
) -> str:
    """``module`` (as stored) specialized to the static argument shapes ``inputs``; its results
    must come out of the shapes ``outputs`` (else :class:`SpecializeError`). The arguments at
    the positions ``bound`` become module parameters (:func:`bind_arguments`).

    :func:`specialize` runs in a child process: the MLIR bindings parse, inline and
    canonicalize the module (untrusted input) in-process, so a crash there ends the child and
    is a :class:`SpecializeError` here, as a crash of ``iree-compile`` is (a subprocess too)."""
    text = stablehlo_text(module, timeout)
    header = {"inputs": [list(s) for s in inputs], "outputs": [list(s) for s in outputs]}
    header["bound"] = list(bound)
    request = json.dumps(header).encode() + b"\n" + text.encode()
    return run_child(request, timeout)


def run_child(request: bytes, timeout: float = 600.0) -> str:
    """The text :func:`child_main` writes for ``request`` (a JSON header line, then a module's
    text), run in a child process; its refusal or crash is a :class:`SpecializeError`."""
    root = str(Path(__file__).resolve().parents[2])
    code = (
        f"import sys; sys.path.insert(0, {root!r}); "
        "from jaxexp_mlflow.iree.specialize import child_main; child_main()"
    )
    try:
        run = subprocess.run(
            [sys.executable, "-c", code], input=request, capture_output=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        raise SpecializeError(f"the specialization took over {timeout:.0f} s") from None
    if run.returncode == 0:
        return run.stdout.decode()
    err = run.stderr.decode(errors="replace").strip()
    if run.returncode == _REFUSED and _PREFIX in err:
        raise SpecializeError(err.split(_PREFIX, 1)[1][:2000])
    raise SpecializeError(
        f"the specialization ended with exit status {run.returncode}: {err[-1000:]}"
    )


_REFUSED = 3
_PREFIX = "SpecializeError: "


def child_main() -> None:
    """The child of :func:`static_main`: a JSON header line and the module text on stdin, the
    specialized text on stdout; a :class:`SpecializeError` on stderr with exit status 3."""
    header, _, text = sys.stdin.buffer.read().partition(b"\n")
    spec = json.loads(header)
    try:
        if spec.get("roundings"):
            sys.stdout.write(rounded_module(text.decode()))
            return
        out = specialize(
            text.decode(),
            tuple(tuple(s) for s in spec["inputs"]),
            tuple(tuple(s) for s in spec["outputs"]),
            tuple(spec["bound"]),
        )
    except SpecializeError as err:
        sys.stderr.write(f"{_PREFIX}{err}\n")
        sys.exit(_REFUSED)
    sys.stdout.write(out)


def rounded_module(text: str) -> str:
    """The StableHLO module ``text`` with its narrowing float converts keeping their rounding
    (``roundings.keep_roundings``), "" where it has none; parsed here, so run in a child
    (:func:`rounded_text`)."""
    from iree.compiler import ir

    with ir.Context(), ir.Location.unknown():
        try:
            module = ir.Module.parse(text)
            if not roundings.keep_roundings(module, ir):
                return ""  # nothing to keep: the module is compiled as stored
        except Exception as err:  # MLIRError
            raise SpecializeError(f"keeping the roundings: {str(err)[:500]}") from None
        if not module.operation.verify():
            raise SpecializeError("the module with its roundings kept does not verify")
        return str(module)


def rounded_text(module: bytes, timeout: float = 600.0) -> bytes | str:
    """``module`` as compiled: its StableHLO text with the roundings kept where it has a
    float convert, else ``module`` itself (unchanged, as stored)."""
    text = stablehlo_text(module, timeout)
    if "stablehlo.convert" not in text:
        return module
    request = json.dumps({"roundings": True}).encode() + b"\n" + text.encode()
    return run_child(request, timeout) or module


#: The parameter scope of the arguments :func:`bind_arguments` binds; each is named ``arg<i>``
#: (its position among ``main``'s arguments as exported).
SCOPE = "jaxexp"


def parameter_name(position: int) -> str:
    """The parameter key of ``main``'s argument ``position`` once bound."""
    return f"arg{position}"


def bind_arguments(module: Any, main: Any, positions: tuple[int, ...], ir: Any) -> None:
    """Make ``main``'s arguments at ``positions`` immutable globals read from the parameter
    ``SCOPE::arg<i>`` (``util.global`` + ``#flow.parameter.named``), no longer arguments.

    IREE then treats them as constants: with data tiling their packing into the CPU's tile
    layout is hoisted into the module's initializer, done once when the module is loaded,
    where an argument is repacked at every call. The runtime supplies the values (the params
    uploaded once, ``rt.ParameterIndex``); the ``.vmfb`` holds no weights."""
    block = main.regions[0].blocks[0]
    args = list(block.arguments)
    body = module.body
    first = list(body.operations)[0]
    loads = {}
    start = list(block.operations)[0]
    for position in positions:
        arg = args[position]
        name = f"__jaxexp_{parameter_name(position)}"
        value = ir.Attribute.parse(
            f'#flow.parameter.named<"{SCOPE}"::"{parameter_name(position)}"> : {arg.type}'
        )
        ir.Operation.create(
            "util.global",
            attributes={
                "sym_name": ir.StringAttr.get(name),
                "sym_visibility": ir.StringAttr.get("private"),
                "type": ir.TypeAttr.get(arg.type),
                "initial_value": value,
            },
            ip=ir.InsertionPoint(first),
        )
        load = ir.Operation.create(
            "util.global.load",
            results=[arg.type],
            attributes={
                "global": ir.FlatSymbolRefAttr.get(name),
                "is_immutable": ir.UnitAttr.get(),
            },
            ip=ir.InsertionPoint(start),
        )
        arg.replace_all_uses_with(load.results[0])
        loads[position] = load
    for position in sorted(positions, reverse=True):
        block.erase_argument(position)
    for key in ("arg_attrs",):
        if key in main.attributes:
            kept = [
                a for i, a in enumerate(ir.ArrayAttr(main.attributes[key])) if i not in positions
            ]
            main.attributes[key] = ir.ArrayAttr.get(kept)


def specialize(
    text: str,
    inputs: tuple[tuple[int, ...], ...],
    outputs: tuple[tuple[int, ...], ...] | None = None,
    bound: tuple[int, ...] = (),
) -> str:
    """The StableHLO module ``text`` with ``main`` taking the static shapes ``inputs`` (one per
    argument) and every type in it static; :class:`SpecializeError` if that cannot be done."""
    from iree.compiler import ir, passmanager

    with ir.Context(), ir.Location.unknown():
        try:
            module = ir.Module.parse(text)
            passmanager.PassManager.parse("builtin.module(inline,symbol-dce)").run(module.operation)
        except Exception as err:  # MLIRError
            raise SpecializeError(f"parsing and inlining the module: {str(err)[:500]}") from None
        main = _main(module, ir)
        block = main.regions[0].blocks[0]
        args = list(block.arguments)
        if len(args) != len(inputs):
            raise SpecializeError(f"main takes {len(args)} arguments, expected {len(inputs)}")
        static = []
        for i, (arg, shape) in enumerate(zip(args, inputs, strict=True)):
            t = _ranked(arg.type, ir)
            if (
                t is None
                or t.rank != len(shape)
                or any(
                    not t.is_dynamic_dim(d) and t.get_dim_size(d) != s for d, s in enumerate(shape)
                )
            ):
                raise SpecializeError(f"main's argument {i} is {arg.type}, not of shape {shape}")
            new = ir.RankedTensorType.get(list(shape), t.element_type)
            arg.set_type(new)
            static.append(new)
        canonicalize = passmanager.PassManager.parse(
            "builtin.module(func.func(iree-stablehlo-canonicalize,canonicalize,cse))"
        )
        for _ in range(_MAX_ROUNDS):
            _set_results(main, static, ir)
            try:
                canonicalize.run(module.operation)
            except Exception as err:  # MLIRError
                raise SpecializeError(f"canonicalizing: {str(err)[:500]}") from None
            if not _refine_block(block, ir):
                break
        _set_results(main, static, ir)
        left = _dynamic_op(main, ir)
        if left is not None:
            raise SpecializeError(f"a dynamic type is left: {left[:300]}")
        rewrites.single_channel_convolutions(module, ir)
        roundings.keep_roundings(module, ir)
        ret = list(block.operations)[-1].operation
        found = [tuple(ir.RankedTensorType(v.type).shape) for v in ret.operands]
        if outputs is not None and found != [tuple(o) for o in outputs]:
            raise SpecializeError(f"main returns shapes {found}, expected {list(outputs)}")
        if bound:
            bind_arguments(module, main, tuple(bound), ir)
            static = [t for i, t in enumerate(static) if i not in bound]
            _set_results(main, static, ir)
        if not module.operation.verify():
            raise SpecializeError("the specialized module does not verify")
        return str(module)


def _main(module: Any, ir: Any) -> Any:
    for op in module.body.operations:
        op = op.operation
        if op.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == "main":
            return op
    raise SpecializeError("the module has no func.func @main")


def _ranked(t: Any, ir: Any) -> Any:
    try:
        return ir.RankedTensorType(t)
    except ValueError:
        return None


def _dynamic(t: Any, ir: Any) -> bool:
    r = _ranked(t, ir)
    return r is not None and not r.has_static_shape


def _set_results(main: Any, inputs: list, ir: Any) -> None:
    """``main``'s type from its arguments and what its ``return`` returns now."""
    ret = list(main.regions[0].blocks[0].operations)[-1].operation
    results = [v.type for v in ret.operands]
    main.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(inputs, results))


def _dynamic_op(op: Any, ir: Any) -> str | None:
    """The first op (or block argument) under ``op`` with a dynamic type, printed; else None."""
    for region in op.regions:
        for block in region.blocks:
            for arg in block.arguments:
                if _dynamic(arg.type, ir):
                    return f"a block argument of {op.name}: {arg.type}"
            for child in block.operations:
                child = child.operation
                if any(_dynamic(r.type, ir) for r in child.results):
                    return str(child)
                found = _dynamic_op(child, ir)
                if found is not None:
                    return found
    return None


def _refine_block(block: Any, ir: Any) -> int:
    """Give every op of ``block`` with a dynamic result the static types its operands imply;
    returns how many results changed."""
    changed = 0
    for op in block.operations:
        op = op.operation
        if op.name in _BRANCHING:  # the branches first: the results are what they return
            for region in op.regions:
                for inner in region.blocks:
                    changed += _refine_block(inner, ir)
        if not any(_dynamic(r.type, ir) for r in op.results):
            continue
        found = _branch_results(op, ir) if op.name in _BRANCHING else _inferred(op, ir)
        for result, t in zip(op.results, found or (), strict=False):
            if t is not None and not _dynamic(t, ir) and str(result.type) != str(t):
                result.set_type(t)
                changed += 1
    return changed


def _branch_results(op: Any, ir: Any) -> list | None:
    """The result types of a ``case`` / ``if`` whose branches all return the same static
    types (None where one does not: refined in a later round, or left and refused)."""
    found: list | None = None
    for region in op.regions:
        ret = list(region.blocks[0].operations)[-1].operation
        types = [v.type for v in ret.operands]
        if found is None:
            found = types
        elif list(map(str, types)) != list(map(str, found)):
            return None
    if found is None or any(_dynamic(t, ir) for t in found):
        return None
    return found


def _ints(value: Any, ir: Any) -> list[int] | None:
    """The values of a 1-d integer ``stablehlo.constant``; else None."""
    owner = value.owner
    op = getattr(owner, "operation", owner)
    if getattr(op, "name", None) != "stablehlo.constant":
        return None
    try:
        attr = ir.DenseIntElementsAttr(op.attributes["value"])
        n = ir.RankedTensorType(value.type).get_dim_size(0)
    except (ValueError, IndexError):
        return None
    if attr.is_splat:
        return [int(attr.get_splat_value().value)] * n
    return [int(attr[i]) for i in range(len(attr))]


def _like(result: Any, shape: list[int], ir: Any) -> Any:
    return ir.RankedTensorType.get(shape, ir.RankedTensorType(result.type).element_type)


def _dims(op: Any, name: str, ir: Any) -> list[int]:
    return [int(x) for x in ir.DenseI64ArrayAttr(op.attributes[name])]


def _field(text: str, name: str) -> list[int]:
    m = re.search(rf"\b{name}\s*=\s*\[([-0-9, ]*)\]", text)
    return [int(x) for x in m.group(1).split(",") if x.strip()] if m else []


def _inferred(op: Any, ir: Any) -> list | None:
    """The result types of ``op`` implied by its operands (None entries: unknown)."""
    name = op.name
    if name in _SHAPE_OPERAND:
        shape = _ints(op.operands[_SHAPE_OPERAND[name]], ir)
        return None if shape is None else [_like(op.results[0], shape, ir)]
    if name == "stablehlo.real_dynamic_slice":
        start, limit, stride = (_ints(op.operands[i], ir) for i in (1, 2, 3))
        if start is None or limit is None or stride is None:
            return None
        shape = [-(-(hi - lo) // s) for lo, hi, s in zip(start, limit, stride, strict=True)]
        return [_like(op.results[0], shape, ir)]
    operands = [_ranked(v.type, ir) for v in op.operands]
    if any(t is not None and not t.has_static_shape for t in operands):
        return None  # refined once its operands are
    if name in _SAME_SHAPE and operands and operands[0] is not None:
        return [_like(op.results[0], list(operands[0].shape), ir)]
    if name == "stablehlo.dot_general":
        return [_like(op.results[0], _dot_shape(op, operands, ir), ir)]
    if name == "stablehlo.convolution":
        return [_like(op.results[0], _conv_shape(op, operands, ir), ir)]
    if name == "stablehlo.reduce":
        n = len(op.operands) // 2
        dims = set(_dims(op, "dimensions", ir))
        shape = [s for d, s in enumerate(operands[0].shape) if d not in dims]
        return [_like(r, shape, ir) for r in list(op.results)[:n]]
    if name == "stablehlo.reduce_window":
        shape = _window_shape(op, list(operands[0].shape), ir)
        return [_like(r, shape, ir) for r in op.results]
    if op.regions:  # sort, scatter, while, case...: their own inference needs the regions
        if name in ("stablehlo.sort", "stablehlo.scatter", "stablehlo.select_and_scatter"):
            first = operands[0]
            return [_like(r, list(first.shape), ir) for r in op.results]
        return None
    attrs = {op.attributes[i].name: op.attributes[i].attr for i in range(len(op.attributes))}
    try:
        clone = ir.Operation.create(
            name,
            operands=list(op.operands),
            attributes=attrs,
            loc=op.location,
            ip=ir.InsertionPoint(op),
            infer_type=True,
        )
    except Exception:  # the op has no type inference (MLIRError / ValueError)
        return None
    types = [r.type for r in clone.results]
    clone.erase()
    return types


def _dot_shape(op: Any, operands: list, ir: Any) -> list[int]:
    text = str(op.attributes["dot_dimension_numbers"])
    lb, rb = _field(text, "lhs_batching_dimensions"), _field(text, "rhs_batching_dimensions")
    lc, rc = _field(text, "lhs_contracting_dimensions"), _field(text, "rhs_contracting_dimensions")
    lhs, rhs = list(operands[0].shape), list(operands[1].shape)
    return (
        [lhs[d] for d in lb]
        + [s for d, s in enumerate(lhs) if d not in lb and d not in lc]
        + [s for d, s in enumerate(rhs) if d not in rb and d not in rc]
    )


def _window_shape(op: Any, shape: list[int], ir: Any) -> list[int]:
    """``stablehlo.reduce_window``'s result shape (the StableHLO spec's shape function)."""
    n = len(shape)

    def array(name: str) -> list[int]:
        return _dims(op, name, ir) if name in op.attributes else [1] * n

    window, strides = array("window_dimensions"), array("window_strides")
    base, dilation = array("base_dilations"), array("window_dilations")
    padding = [(0, 0)] * n
    if "padding" in op.attributes:
        attr = ir.DenseIntElementsAttr(op.attributes["padding"])
        flat = [int(attr[i]) for i in range(len(attr))]
        padding = [(flat[2 * i], flat[2 * i + 1]) for i in range(n)]
    out = []
    for i in range(n):
        x = (shape[i] - 1) * base[i] + 1 + padding[i][0] + padding[i][1]
        k = (window[i] - 1) * dilation[i] + 1
        out.append(0 if x < k else (x - k) // strides[i] + 1)
    return out


def _conv_shape(op: Any, operands: list, ir: Any) -> list[int]:
    """``stablehlo.convolution``'s result shape (the StableHLO spec's shape function)."""
    text = str(op.attributes["dimension_numbers"])
    m = re.search(r"\[([^\]]*)\]x\[([^\]]*)\]->\[([^\]]*)\]", text.replace(" ", ""))
    if m is None:
        raise SpecializeError(f"unreadable convolution dimension numbers {text[:200]}")
    lhs_l, rhs_l, out_l = (p.split(",") for p in m.groups())
    lhs, rhs = list(operands[0].shape), list(operands[1].shape)
    spatial = [c for c in lhs_l if c.isdigit()]
    n = len(spatial)

    def array(name: str, default: int) -> list[int]:
        if name not in op.attributes:
            return [default] * n
        return [int(x) for x in ir.DenseI64ArrayAttr(op.attributes[name])]

    strides, lhs_dil, rhs_dil = (
        array("window_strides", 1),
        array("lhs_dilation", 1),
        array("rhs_dilation", 1),
    )
    if "padding" in op.attributes:
        pad_attr = ir.DenseIntElementsAttr(op.attributes["padding"])
        flat = [int(pad_attr[i]) for i in range(len(pad_attr))]
        padding = [(flat[2 * i], flat[2 * i + 1]) for i in range(n)]
    else:
        padding = [(0, 0)] * n
    batch_groups = int(ir.IntegerAttr(op.attributes["batch_group_count"]).value)
    size = {}
    for d in map(str, range(n)):
        i = int(d)
        x = (lhs[lhs_l.index(d)] - 1) * lhs_dil[i] + 1 + padding[i][0] + padding[i][1]
        k = (rhs[rhs_l.index(d)] - 1) * rhs_dil[i] + 1
        size[d] = 0 if x < k else (x - k) // strides[i] + 1
    size["b"] = lhs[lhs_l.index("b")] // batch_groups
    size["f"] = rhs[rhs_l.index("o")]
    return [size[c] for c in out_l]
