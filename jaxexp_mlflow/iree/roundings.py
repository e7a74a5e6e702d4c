"""Narrowing float converts made to keep their rounding on IREE, without JAX.

IREE 3.13 folds ``convert(convert(x, bf16), f32)`` into ``x``, with its speed flags off and at
``-O0`` too: ``x * jnp.sqrt(w).astype(jnp.bfloat16)`` (the embedder scale of recurrentgemma)
then multiplies by 5.656854 where JAX multiplies by 5.65625. So every narrowing float convert
(:data:`PAIRS`) of the module is replaced by a call of a private function
(``jaxexp_round_<src>_<dst>_<n>``, one per operand type; IREE inlines it) that computes the
narrower value from the operand's bits with integer arithmetic only, which no float folding
removes:

* round to nearest, ties to even, at the narrower type's precision: the rounding bias
  ``0x7FFF + ((bits >> 16) & 1)`` for f32 -> bf16, ``2^(d-1) - 1 + lsb`` for ``d`` dropped
  mantissa bits in general, the dropped bits masked off (a carry moves to the next binade), the
  exponent rebiased, infinity past the largest finite value;
* where the narrower type has a narrower exponent range (f32 -> f16, f64 -> f32), values
  below its smallest normal number become its subnormals: the significand shifted by the
  per-element distance and rounded the same way, underflow giving a signed zero;
* NaN stays NaN (quiet, its sign kept); infinities stay infinities.

The numbers are JAX's on CPU, bit for bit (``tests/iree/test_iree_roundings.py``), including two
choices of XLA's CPU backend: float64 to float16/bfloat16 is rounded through float32 (twice),
and a float32 subnormal result of float64 -> float32 is flushed to (signed) zero. The function
uses elementwise StableHLO ops on tensors of the operand's shape only (constants broadcast over
the operand's own sizes where they are symbolic), so symbolic shapes work as static ones.
"""

from __future__ import annotations

from typing import Any

#: Part of the compile cache key (``compiler.cache_key``): bumped whenever the rewrite changes,
#: so no module compiled without it (or with an older one) is read from the cache.
VERSION = 1
#: Float type -> (exponent bits, mantissa bits).
FLOATS = {"f64": (11, 52), "f32": (8, 23), "f16": (5, 10), "bf16": (8, 7)}
#: The narrowing converts whose rounding is kept: (source, target) element types.
PAIRS = frozenset(
    {("f32", "bf16"), ("f32", "f16"), ("f64", "f32"), ("f64", "bf16"), ("f64", "f16")}
)
_PREFIX = "jaxexp_round_"


def keep_roundings(module: Any, ir: Any) -> int:
    """Route the operand of every narrowing convert of ``module`` (:data:`PAIRS`) through a
    rounding function added to the module; returns how many converts were rewritten.

    Args:
        module: a parsed StableHLO module (``iree.compiler.ir.Module``).
        ir: the ``iree.compiler.ir`` bindings of the module's context.

    Returns:
        The number of converts rewritten (0: the module is unchanged).
    """
    helpers: dict[str, tuple[str, str]] = {}  # (src, dst, type) -> (name, text)
    count = 0
    for op in module.body.operations:
        for region in op.operation.regions:
            for block in region.blocks:
                count += _rewrite_block(block, ir, helpers)
    if helpers:
        extra = ir.Module.parse("\n".join(text for _, text in helpers.values()))
        for fn in list(extra.body.operations):
            fn.operation.detach_from_parent()
            module.body.append(fn)
    return count


def _element(value: Any, ir: Any) -> tuple[Any, str] | None:
    try:
        t = ir.RankedTensorType(value.type)
    except (ValueError, TypeError):
        return None
    return t, str(t.element_type)


def _rewrite_block(block: Any, ir: Any, helpers: dict[str, tuple[str, str]]) -> int:
    count = 0
    for op in list(block.operations):
        op = op.operation
        for region in op.regions:
            for inner in region.blocks:
                count += _rewrite_block(inner, ir, helpers)
        if op.name != "stablehlo.convert":
            continue
        src, dst = _element(op.operands[0], ir), _element(op.results[0], ir)
        if src is None or dst is None or (src[1], dst[1]) not in PAIRS:
            continue
        value = op.operands[0]
        for step in _steps(src[1], dst[1]):
            value = _call(value, step, helpers, ir, op)
        op.results[0].replace_all_uses_with(value)
        op.erase()
        count += 1
    return count


def _steps(src: str, dst: str) -> list[tuple[str, str]]:
    """The conversions JAX's CPU backend makes of ``src`` to ``dst``: float64 to a 16-bit type
    goes through float32 (rounded twice, as XLA does)."""
    if src == "f64" and dst in ("bf16", "f16"):
        return [("f64", "f32"), ("f32", dst)]
    return [(src, dst)]


def _call(value: Any, step: tuple[str, str], helpers: dict, ir: Any, before: Any) -> Any:
    """``value`` converted by the rounding function of ``step`` (added to ``helpers`` once per
    operand type), the call inserted before the op ``before``."""
    ttype = ir.RankedTensorType(value.type)
    element = {"f32": ir.F32Type, "f16": ir.F16Type, "bf16": ir.BF16Type}[step[1]].get()
    rtype = ir.RankedTensorType.get(list(ttype.shape), element)
    key = f"{step[0]}|{step[1]}|{ttype}"
    if key not in helpers:
        name = f"{_PREFIX}{step[0]}_{step[1]}_{len(helpers)}"
        helpers[key] = (name, _helper_text(name, ttype, rtype, step[0], step[1], ir))
    call = ir.Operation.create(
        "func.call",
        results=[rtype],
        operands=[value],
        attributes={"callee": ir.FlatSymbolRefAttr.get(helpers[key][0])},
        ip=ir.InsertionPoint(before),
    )
    return call.results[0]


class _Emitter:
    """MLIR text of one rounding function, a value per line (``%v<n>``): StableHLO ops on
    tensors of the operand's shape only, every constant broadcast to it (over the operand's
    own dimension sizes where they are symbolic), so nothing is left for IREE to broadcast."""

    def __init__(self, ttype: Any, int_type: str, bool_type: str, width: int) -> None:
        self.lines: list[str] = []
        self.it, self.bt, self.width = int_type, bool_type, width
        self.scalar = f"tensor<i{width}>"
        self.shape: str | None = None
        dims = list(ttype.shape)
        self.rank = len(dims)
        self.dynamic = [i for i in range(len(dims)) if ttype.is_dynamic_dim(i)]
        if self.dynamic:
            parts = []
            for i, n in enumerate(dims):
                if i in self.dynamic:
                    size = self._new(
                        f"stablehlo.get_dimension_size %arg0, dim = {i} : ({ttype}) -> tensor<i32>"
                    )
                    parts.append(
                        self._new(f"stablehlo.reshape {size} : (tensor<i32>) -> tensor<1xi32>")
                    )
                else:
                    parts.append(self._new(f"stablehlo.constant dense<{n}> : tensor<1xi32>"))
            joined = ", ".join(parts)
            types = ", ".join(["tensor<1xi32>"] * len(parts))
            self.shape = self._new(
                f"stablehlo.concatenate {joined}, dim = 0 : ({types}) -> tensor<{len(dims)}xi32>"
            )
        self._consts: dict[int, str] = {}

    def _new(self, text: str) -> str:
        name = f"%v{len(self.lines)}"
        self.lines.append(f"    {name} = {text}")
        return name

    def const(self, value: int) -> str:
        """``value`` in every element (one op per distinct value)."""
        if value in self._consts:
            return self._consts[value]
        if self.shape is None:
            out = self._new(f"stablehlo.constant dense<{value}> : {self.it}")
        else:
            c = self._new(f"stablehlo.constant dense<{value}> : {self.scalar}")
            out = self._new(
                f"stablehlo.dynamic_broadcast_in_dim {c}, {self.shape}, dims = [] : "
                f"({self.scalar}, tensor<{self.rank}xi32>) -> {self.it}"
            )
        self._consts[value] = out
        return out

    def _operand(self, a: str | int) -> str:
        return self.const(a) if isinstance(a, int) else a

    def binary(self, op: str, a: str | int, b: str | int) -> str:
        a, b = self._operand(a), self._operand(b)
        return self._new(f"stablehlo.{op} {a}, {b} : {self.it}")

    def compare(self, direction: str, a: str, b: int) -> str:
        c = self._operand(b)
        sig = f"({self.it}, {self.it}) -> {self.bt}"
        return self._new(f"stablehlo.compare {direction}, {a}, {c}, SIGNED : {sig}")

    def select(self, pred: str, a: str | int, b: str | int) -> str:
        a, b = self._operand(a), self._operand(b)
        return self._new(
            f"stablehlo.select {pred}, {a}, {b} : ({self.bt}, {self.it}, {self.it}) -> {self.it}"
        )

    def cast(self, op: str, a: str, from_type: str, to_type: str) -> str:
        return self._new(f"stablehlo.{op} {a} : ({from_type}) -> {to_type}")


def _helper_text(name: str, ttype: Any, rtype: Any, src: str, dst: str, ir: Any) -> str:
    """The rounding function ``name``: ``ttype`` (of element type ``src``) converted to
    ``rtype`` (element type ``dst``) by integer arithmetic on its bits, rounded to nearest even
    at ``dst``'s precision and range."""
    (se, sm), (de, dm) = FLOATS[src], FLOATS[dst]
    width, dwidth = 1 + se + sm, 1 + de + dm
    shape = list(ttype.shape)
    it = str(ir.RankedTensorType.get(shape, ir.IntegerType.get_signless(width)))
    bt = str(ir.RankedTensorType.get(shape, ir.IntegerType.get_signless(1)))
    ut = str(ir.RankedTensorType.get(shape, ir.IntegerType.get_unsigned(dwidth)))
    ft, rt = str(ttype), str(rtype)
    sbias, dbias = (1 << (se - 1)) - 1, (1 << (de - 1)) - 1
    demin = 1 - dbias  # the target's smallest normal exponent, unbiased
    d = sm - dm
    dinf = ((1 << de) - 1) << dm  # the target's infinity, its bits
    e = _Emitter(ttype, it, bt, width)
    bits = e.cast("bitcast_convert", "%arg0", ft, it)
    mag = e.binary("and", bits, (1 << (width - 1)) - 1)
    sign = e.binary(
        "shift_right_logical", e.binary("and", bits, -(1 << (width - 1))), width - dwidth
    )
    # normal range: the magnitude's bits rounded at d dropped bits, ties to even (a carry
    # moves to the next binade), the exponent rebiased; past the largest finite: infinity
    lsb = e.binary("and", e.binary("shift_right_logical", mag, d), 1)
    biased = e.binary("add", e.binary("add", mag, (1 << (d - 1)) - 1), lsb)
    rounded = e.binary("and", biased, -(1 << d))
    out = e.binary("subtract", e.binary("shift_right_logical", rounded, d), (sbias - dbias) << dm)
    over = e.compare("GE", rounded, (sbias - dbias + (1 << de) - 1) << sm)
    out = e.select(over, dinf, out)
    if se > de:  # below the target's smallest normal: its subnormals, counted in units
        exp = e.binary("shift_right_logical", mag, sm)
        normal = e.compare("GE", exp, demin + sbias)
        distance = e.binary("subtract", sm - dm + demin + sbias, e.binary("maximum", exp, 1))
        shift = e.binary("minimum", distance, sm + 2)
        implicit = e.binary("shift_left", e.binary("minimum", exp, 1), sm)
        mant = e.binary("or", e.binary("and", mag, (1 << sm) - 1), implicit)
        half = e.binary("subtract", e.binary("shift_left", 1, e.binary("subtract", shift, 1)), 1)
        low = e.binary("and", e.binary("shift_right_logical", mant, shift), 1)
        units = e.binary(
            "shift_right_logical", e.binary("add", e.binary("add", mant, half), low), shift
        )
        if dst == "f32":  # XLA's CPU backend flushes a float32 subnormal result to zero
            units = e.select(e.compare("EQ", units, 1 << dm), units, 0)
        out = e.select(normal, out, units)  # units: the subnormal's bits (2^dm: the min normal)
    nan = e.compare("GT", mag, ((1 << se) - 1) << sm)
    out = e.binary("or", e.select(nan, dinf | (1 << (dm - 1)), out), sign)
    narrow = e.cast("convert", out, it, ut)
    result = e.cast("bitcast_convert", narrow, ut, rt)
    body = "\n".join(e.lines)
    return (
        f"func.func private @{name}(%arg0: {ft}) -> {rt} {{\n{body}\n    return {result} : {rt}\n}}"
    )
