"""Save-time preparation for the IREE backend, while JAX is at hand (imports jax and jaxlib).

Stores beside the original blob (kept byte-for-byte) what IREE needs and only JAX can produce:

* the module with the Shardy dialect stripped (IREE 3.13 cannot parse ``sdy``): ``sdy.mesh``
  ops removed, ``sdy.*`` attributes dropped from functions, arguments, results and ops,
  ``sdy.sharding_constraint``/``sdy.reshard`` replaced by their operand. Only for single-device
  exports, where shardings carry no computation. Written as a StableHLO portable artifact at the
  original's StableHLO version (``iree/module.mlirbc``), so it lasts as long as the original;
* shapes made explicit where IREE needs it: ``dynamic_broadcast_in_dim`` ops of symbolic-batch
  exports get ``known_nonexpanding_dimensions`` (IREE refuses to lower them otherwise; JAX never
  expands a dimension of unknown size), so one compiled module still serves every batch size;
* ``dot_general`` algorithms dropped where the operand and result types already say it
  (``bf16 x bf16 -> f32`` with ``accumulation_type = f32``, what ``jax.nn.dot_product_attention``
  writes for bfloat16): IREE 3.13 cannot legalize the ``algorithm`` attribute; the op computes
  the same without it;
* the ops IREE cannot compile, found while walking (``unsupported``): a ``gather`` (or
  ``dynamic_gather``) whose result has a symbolic dimension (embedding lookups of
  symbolic-batch exports), and a ``dynamic_reshape`` with a symbolic result (a reshape that
  merges or splits the batch dimension). The IREE verdict sends such a model to the
  per-batch-size route (``iree.static``: ``main`` specialized to static shapes, no JAX) where
  the inputs have one dimension variable, and refuses it up front otherwise, naming the op and
  the way out (save with ``batch_polymorphic=False``);
* the calling-convention facts: the Orbax directory names of the params leaves (custom pytree
  nodes such as Flax's ``FrozenDict`` have key paths only JAX can compute), the exporter's
  symbolic shape constraints (checked before each call, since IREE drops shape assertions), the
  platform index and the kept inputs.

The result is the MLmodel ``jaxexp.iree`` section (see :func:`prepare`).
"""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path
from typing import Any

from jaxexp_mlflow.codec import reader

_logger = logging.getLogger(__name__)

PREPARED_MODULE = "iree/module.mlirbc"
#: sdy ops that only annotate a value: replaced by their operand on single-device exports.
_PASS_THROUGH = ("sdy.sharding_constraint", "sdy.reshard")


class _CannotStrip(Exception):
    """The module uses sdy in a way that carries computation (e.g. ``manual_computation``)."""


def _strip_attrs(op: Any, ir: Any) -> None:
    attrs = op.attributes
    for name in [attrs[i].name for i in range(len(attrs))]:
        if name.startswith("sdy."):
            del attrs[name]
    for key in ("arg_attrs", "res_attrs"):
        if key not in attrs:
            continue
        dicts = []
        for entry in ir.ArrayAttr(attrs[key]):
            d = ir.DictAttr(entry)
            kept = {d[i].name: d[i].attr for i in range(len(d)) if not d[i].name.startswith("sdy.")}
            dicts.append(ir.DictAttr.get(kept))
        attrs[key] = ir.ArrayAttr.get(dicts)


def _explicit_broadcast(op: Any, ir: Any) -> bool:
    """Make a ``dynamic_broadcast_in_dim`` of a dynamic operand say which dimensions expand.

    IREE lowers the op only when it knows which dimensions broadcast, and folds a broadcast of a
    broadcast into one op without that knowledge; so chains are composed here first. JAX never
    broadcasts a dimension of unknown size: only static 1s expand, symbolic sizes must match.
    """
    attrs = op.attributes
    if "known_nonexpanding_dimensions" in attrs or "known_expanding_dimensions" in attrs:
        return False
    dims = list(ir.DenseI64ArrayAttr(attrs["broadcast_dimensions"]))
    changed = False
    inner = op.operands[0].owner
    if getattr(inner, "name", None) == "stablehlo.dynamic_broadcast_in_dim":
        inner_dims = list(ir.DenseI64ArrayAttr(inner.attributes["broadcast_dimensions"]))
        dims = [dims[d] for d in inner_dims]
        op.operands[0] = inner.operands[0]
        attrs["broadcast_dimensions"] = ir.DenseI64ArrayAttr.get(dims)
        changed = True
    operand = ir.RankedTensorType(op.operands[0].type)
    result = ir.RankedTensorType(op.result.type)
    if not any(operand.is_dynamic_dim(i) for i in range(operand.rank)):
        return changed
    expanding = [
        i
        for i in range(operand.rank)
        if not operand.is_dynamic_dim(i)
        and operand.get_dim_size(i) == 1
        and (result.is_dynamic_dim(dims[i]) or result.get_dim_size(dims[i]) != 1)
    ]
    attrs["known_expanding_dimensions"] = ir.DenseI64ArrayAttr.get(expanding)
    attrs["known_nonexpanding_dimensions"] = ir.DenseI64ArrayAttr.get(
        [i for i in range(operand.rank) if i not in expanding]
    )
    return True


#: What the IREE verdict says about a gather of a symbolic-batch export (IREE 3.13 lowers a gather
#: through a reshape that must be static, and fails on dynamic ones).
SYMBOLIC_GATHER = "gather with a symbolic batch dimension"
#: A ``dynamic_reshape`` (a reshape of a symbolic dimension: merging the batch into another
#: dimension, ``x.reshape(-1)``, flax ``nn.scan``'s carry, or splitting it): IREE 3.13 fails to
#: legalize every one measured ("failed to legalize operation 'stablehlo.dynamic_reshape'").
SYMBOLIC_RESHAPE = "reshape of a symbolic batch dimension"


def _implied_algorithm(op: Any, ir: Any) -> bool:
    """Drop a ``dot_general``'s ``algorithm`` when the types already state it: one primitive
    operation, each operand's precision its own element type, accumulation in the result's
    element type (the default dot of those types). IREE 3.13 cannot legalize the attribute."""
    attrs = op.attributes
    if "algorithm" not in attrs:
        return False
    text = str(attrs["algorithm"])

    def field(name: str) -> str | None:
        m = re.search(rf"\b{name}\s*=\s*([A-Za-z0-9_]+)", text)
        return m.group(1) if m else None

    def element(value: Any) -> str:
        return str(ir.RankedTensorType(value.type).element_type)

    implied = (
        field("lhs_precision_type") == element(op.operands[0])
        and field("rhs_precision_type") == element(op.operands[1])
        and field("accumulation_type") == element(op.results[0])
        and field("lhs_component_count") in (None, "1")
        and field("rhs_component_count") in (None, "1")
        and field("num_primitive_operations") in (None, "1")
        and field("allow_imprecise_accumulation") in (None, "false")
    )
    if implied:
        del attrs["algorithm"]
    return implied


def _symbolic_result(op: Any, ir: Any) -> bool:
    try:
        result = ir.RankedTensorType(op.results[0].type)
    except (ValueError, TypeError, IndexError):
        return False
    return any(result.is_dynamic_dim(i) for i in range(result.rank))


def _rewrite_op(op: Any, ir: Any, changes: set[str], unsupported: set[str]) -> None:
    for region in op.regions:
        for block in region.blocks:
            for child in list(block.operations):
                child = child.operation
                name = child.name
                if name == "sdy.mesh":
                    child.erase()
                    changes.add("sdy stripped")
                elif name in _PASS_THROUGH:
                    child.results[0].replace_all_uses_with(child.operands[0])
                    child.erase()
                    changes.add("sdy stripped")
                elif name.startswith("sdy."):
                    raise _CannotStrip(name)
                else:
                    if any(
                        child.attributes[i].name.startswith("sdy.")
                        for i in range(len(child.attributes))
                    ):
                        changes.add("sdy stripped")
                    _strip_attrs(child, ir)
                    if name == "stablehlo.dynamic_broadcast_in_dim" and _explicit_broadcast(
                        child, ir
                    ):
                        changes.add("dynamic broadcasts made explicit")
                    elif name == "stablehlo.dot_general" and _implied_algorithm(child, ir):
                        changes.add("dot algorithms implied by the types dropped")
                    elif name in ("stablehlo.gather", "stablehlo.dynamic_gather") and (
                        _symbolic_result(child, ir)
                    ):
                        unsupported.add(SYMBOLIC_GATHER)
                    elif name == "stablehlo.dynamic_reshape" and _symbolic_result(child, ir):
                        unsupported.add(SYMBOLIC_RESHAPE)
                    _rewrite_op(child, ir, changes, unsupported)


def analyse(module: bytes, target_version: str) -> tuple[bytes, list[str], list[str] | None]:
    """The portable artifact ``module`` as IREE needs it, at ``target_version``, the changes
    (the Shardy dialect stripped, dynamic broadcasts' expanding dimensions made explicit, implied
    dot algorithms dropped) and the ops IREE cannot compile (None: the module was not walked)."""
    from jaxexp_mlflow.internals.jax_private import portable_artifact_api

    api = portable_artifact_api()
    if api is None:
        return module, ["kept as stored (this jaxlib offers no portable-artifact reader)"], None
    make_ir_context, ir, artifacts = api
    changes: set[str] = set()
    unsupported: set[str] = set()
    with make_ir_context():
        parsed = artifacts.deserialize_portable_artifact(module)
        text_api = isinstance(parsed, str)  # jaxlib < 0.7 passes modules as text
        if text_api:
            parsed = ir.Module.parse(parsed)
        _strip_attrs(parsed.operation, ir)
        _rewrite_op(parsed.operation, ir, changes, unsupported)
        if not changes:
            return module, [], sorted(unsupported)
        out = artifacts.serialize_portable_artifact(
            str(parsed) if text_api else parsed, target_version
        )
    return bytes(out), sorted(changes), sorted(unsupported)


def rewrite(module: bytes, target_version: str) -> tuple[bytes, list[str]]:
    """The portable artifact ``module`` as IREE needs it and the changes (see :func:`analyse`)."""
    out, changes, _ = analyse(module, target_version)
    return out, changes


def _param_leaf_names(exported: Any, n_param_leaves: int) -> list[str] | None:
    if not n_param_leaves:
        return None
    import jax

    from jaxexp_mlflow.params.layout import dir_name, key_token
    from jaxexp_mlflow.store.artifact import params_treedef

    placeholder = jax.tree.unflatten(params_treedef(exported), [0] * n_param_leaves)
    paths = jax.tree_util.tree_flatten_with_path(placeholder)[0]
    return [dir_name(tuple(key_token(k) for k in path)) for path, _ in paths]


_CONSTRAINT_MESSAGE = re.compile(r"the symbolic shape constraint (.+?)\. Expected ")


def _shape_constraints(exported: Any) -> list[str]:
    """The exporter's explicit symbolic constraints (``b >= 4``).

    From the avals' symbolic scope, or (for a deserialized blob, whose scope has lost them) from
    the messages of the module's ``shape_assertion`` calls, which name each constraint.
    """
    for aval in exported.in_avals:
        for dim in aval.shape:
            scope = getattr(dim, "scope", None)
            explicit = getattr(scope, "_explicit_constraints", None)
            if explicit:
                return [str(c.debug_str) for c in explicit]
    if not any(not isinstance(d, int) for a in exported.in_avals for d in a.shape):
        return []
    return sorted(set(_CONSTRAINT_MESSAGE.findall(exported.mlir_module())))


def prepare(
    exported: Any, data: bytes, model_dir: str | Path, *, n_param_leaves: int
) -> dict[str, Any]:
    """Write what IREE needs into ``model_dir`` and return the MLmodel ``iree`` section.

    ``data`` is the blob exactly as stored (never rewritten). Preparation never fails a save:
    what cannot be prepared is recorded (``problem``) and the IREE verdict refuses it later.
    """
    import jax

    from jaxexp_mlflow.store.section import package_version

    description = reader.read_blob(data)
    module = reader.read_module(data)
    section: dict[str, Any] = {
        "module": None,
        "module_sha256": None,
        # ties the section and its module to this blob (checked before the module is compiled)
        "blob_sha256": hashlib.sha256(data).hexdigest(),
        "changes": [],
        "param_leaves": _param_leaf_names(exported, n_param_leaves),
        "shape_constraints": _shape_constraints(exported),
        "prepared_with": {"jax": jax.__version__, "jaxlib": package_version("jaxlib")},
    }
    if description.nr_devices == 1:
        producer = description.stablehlo_producer or ""
        target = producer.rsplit("_v", 1)[-1] if "_v" in producer else "1.0.0"
        try:
            rewritten, changes, unsupported = analyse(module, target)
        except _CannotStrip as err:
            section["problem"] = f"the module uses {err}, which carries computation"
            _logger.warning("jaxexp: IREE preparation: %s", section["problem"])
        except Exception as err:  # jaxlib raises assorted types on modules it cannot rewrite
            section["problem"] = f"rewriting the module failed: {type(err).__name__}: {err}"[:500]
            _logger.warning("jaxexp: IREE preparation: %s", section["problem"])
        else:
            if unsupported is not None:
                section["unsupported"] = unsupported
            if changes:
                path = Path(model_dir, PREPARED_MODULE)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(rewritten)
                section["module"] = PREPARED_MODULE
                section["module_sha256"] = hashlib.sha256(rewritten).hexdigest()
                section["changes"] = changes
    return section
