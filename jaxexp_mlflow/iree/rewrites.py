"""Rewrites of a static-shaped StableHLO module that make IREE's CPU code faster, same math.

Applied by ``specialize`` once every shape is static. Each rewrite computes the same sums of the
same products, in another order (results within float rounding: measured identical to 1e-7 on
the benchmark CNN).

* :func:`single_channel_convolutions`: a 2-d convolution with **one input feature** (the first
  layer of a CNN on grey images: ``nnx.Conv(1, 32, (3, 3))``), unit strides and dilations and no
  feature groups becomes pad + one slice per kernel tap + concatenate + ``dot_general`` with the
  kernel reshaped to ``[taps, outputs]`` (im2col). IREE 3.13's direct convolution code for one
  input channel is pathological: 128 of 190 ms at batch 256 (``iree-benchmark-module`` per
  dispatch), 0.60 -> 0.18 ms for the whole benchmark CNN at batch 1. IREE's own
  ``--iree-global-opt-use-im2col-for-convs`` applies to every convolution and made the 32-channel
  one slower, so it is not used.
"""

from __future__ import annotations

from typing import Any

#: The layout the rewrite handles: NHWC input, HWIO kernel, NHWC output (Flax's and JAX's).
_LAYOUT = "[b,0,1,f]x[0,1,i,o]->[b,0,1,f]"


def single_channel_convolutions(module: Any, ir: Any) -> int:
    """Rewrite every eligible convolution of ``module`` (see the module docstring); returns
    how many were rewritten."""
    count = 0
    for op in module.body.operations:
        for region in op.operation.regions:
            for block in region.blocks:
                count += _rewrite_block(block, ir)
    return count


def _ones(op: Any, name: str, ir: Any) -> bool:
    return name not in op.attributes or all(
        int(x) == 1 for x in ir.DenseI64ArrayAttr(op.attributes[name])
    )


def _eligible(op: Any, ir: Any) -> bool:
    if op.name != "stablehlo.convolution" or len(op.operands) != 2:
        return False
    if str(op.attributes["dimension_numbers"]).replace(" ", "").find(_LAYOUT) < 0:
        return False
    lhs = ir.RankedTensorType(op.operands[0].type)
    rhs = ir.RankedTensorType(op.operands[1].type)
    if not (lhs.has_static_shape and rhs.has_static_shape) or lhs.rank != 4:
        return False
    if lhs.get_dim_size(3) != 1 or str(lhs.element_type) not in ("f16", "bf16", "f32", "f64"):
        return False
    out = ir.RankedTensorType(op.results[0].type)
    if rhs.element_type != lhs.element_type or out.element_type != lhs.element_type:
        return False
    groups = ("feature_group_count", "batch_group_count")
    if any(int(ir.IntegerAttr(op.attributes[g]).value) != 1 for g in groups):
        return False
    return all(_ones(op, k, ir) for k in ("window_strides", "lhs_dilation", "rhs_dilation"))


def _rewrite_block(block: Any, ir: Any) -> int:
    count = 0
    for op in list(block.operations):
        op = op.operation
        for region in op.regions:
            for inner in region.blocks:
                count += _rewrite_block(inner, ir)
        if _eligible(op, ir):
            _im2col(op, ir)
            count += 1
    return count


def _im2col(op: Any, ir: Any) -> None:
    lhs, rhs = op.operands[0], op.operands[1]
    lt, kt = ir.RankedTensorType(lhs.type), ir.RankedTensorType(rhs.type)
    batch, height, width, _ = lt.shape
    kh, kw, _, outs = kt.shape
    et = lt.element_type
    pad = [(0, 0), (0, 0)]
    if "padding" in op.attributes:
        attr = ir.DenseIntElementsAttr(op.attributes["padding"])
        pad = [(int(attr[0]), int(attr[1])), (int(attr[2]), int(attr[3]))]
    ph, pw = height + pad[0][0] + pad[0][1], width + pad[1][0] + pad[1][1]
    oh, ow = ph - kh + 1, pw - kw + 1
    ip = ir.InsertionPoint(op)
    scalar = ir.RankedTensorType.get([], et)

    def create(name: str, shape: list[int], operands: list, attributes: dict) -> Any:
        result = ir.RankedTensorType.get(shape, et)
        return ir.Operation.create(
            name, results=[result], operands=operands, attributes=attributes, ip=ip
        ).results[0]

    zero = create(
        "stablehlo.constant",
        [],
        [],
        {"value": ir.DenseElementsAttr.get_splat(scalar, ir.FloatAttr.get(et, 0.0))},
    )
    i64 = ir.DenseI64ArrayAttr.get
    padded = create(
        "stablehlo.pad",
        [batch, ph, pw, 1],
        [lhs, zero],
        {
            "edge_padding_low": i64([0, pad[0][0], pad[1][0], 0]),
            "edge_padding_high": i64([0, pad[0][1], pad[1][1], 0]),
            "interior_padding": i64([0, 0, 0, 0]),
        },
    )
    taps = [
        create(
            "stablehlo.slice",
            [batch, oh, ow, 1],
            [padded],
            {
                "start_indices": i64([0, i, j, 0]),
                "limit_indices": i64([batch, i + oh, j + ow, 1]),
                "strides": i64([1, 1, 1, 1]),
            },
        )
        for i in range(kh)
        for j in range(kw)
    ]
    patches = create(
        "stablehlo.concatenate",
        [batch, oh, ow, kh * kw],
        taps,
        {"dimension": ir.IntegerAttr.get(ir.IntegerType.get_signless(64), 3)},
    )
    kernel = create("stablehlo.reshape", [kh * kw, outs], [rhs], {})
    numbers = ir.Attribute.parse(
        "#stablehlo.dot<lhs_contracting_dimensions = [3], rhs_contracting_dimensions = [0]>"
    )
    out = ir.Operation.create(
        "stablehlo.dot_general",
        results=[op.results[0].type],
        operands=[patches, kernel],
        attributes={"dot_dimension_numbers": numbers},
        ip=ip,
    ).results[0]
    op.results[0].replace_all_uses_with(out)
    op.erase()
