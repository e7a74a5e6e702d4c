"""Save-time preparation for the IREE backend, while JAX is at hand (imports jax and jaxlib).

Stores beside the original blob (kept byte-for-byte) what IREE needs and only JAX can produce:

* the module with the Shardy dialect stripped (IREE 3.13 cannot parse ``sdy``): ``sdy.mesh``
  ops removed, ``sdy.*`` attributes dropped from functions, arguments, results and ops,
  ``sdy.sharding_constraint``/``sdy.reshard`` replaced by their operand. Only for single-device
  exports, where shardings carry no computation. Written as a StableHLO portable artifact at the
  original's StableHLO version (``iree/module.mlirbc``), so it lasts as long as the original;
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

from jaxexp_mlflow.codec import mlir_bytecode, reader

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


def _strip_op(op: Any, ir: Any) -> None:
    for region in op.regions:
        for block in region.blocks:
            for child in list(block.operations):
                child = child.operation
                name = child.name
                if name == "sdy.mesh":
                    child.erase()
                elif name in _PASS_THROUGH:
                    child.results[0].replace_all_uses_with(child.operands[0])
                    child.erase()
                elif name.startswith("sdy."):
                    raise _CannotStrip(name)
                else:
                    _strip_attrs(child, ir)
                    _strip_op(child, ir)


def strip_sdy(module: bytes, target_version: str) -> bytes:
    """The portable artifact ``module`` without the Shardy dialect, at ``target_version``."""
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib import _jax
    from jax._src.lib.mlir import ir

    with jax_mlir.make_ir_context():
        parsed = _jax.mlir.deserialize_portable_artifact(module)
        _strip_attrs(parsed.operation, ir)
        _strip_op(parsed.operation, ir)
        out = _jax.mlir.serialize_portable_artifact(parsed, target_version)
    return bytes(out)


def _param_leaf_names(exported: Any, n_param_leaves: int) -> list[str] | None:
    if not n_param_leaves:
        return None
    import jax

    from jaxexp_mlflow.artifact import params_treedef
    from jaxexp_mlflow.codec.params import _key_token, _param_dir_name

    placeholder = jax.tree.unflatten(params_treedef(exported), [0] * n_param_leaves)
    paths = jax.tree_util.tree_flatten_with_path(placeholder)[0]
    return [_param_dir_name(tuple(_key_token(k) for k in path)) for path, _ in paths]


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

    from jaxexp_mlflow.codec.metadata import package_version

    description = reader.read_blob(data)
    module = reader.read_module(data)
    section: dict[str, Any] = {
        "module": None,
        "module_sha256": None,
        "changes": [],
        "param_leaves": _param_leaf_names(exported, n_param_leaves),
        "shape_constraints": _shape_constraints(exported),
        "prepared_with": {"jax": jax.__version__, "jaxlib": package_version("jaxlib")},
    }
    dialects = mlir_bytecode.module_dialects(module) or ()
    if "sdy" in dialects and description.nr_devices == 1:
        producer = description.stablehlo_producer or ""
        target = producer.rsplit("_v", 1)[-1] if "_v" in producer else "1.0.0"
        try:
            stripped = strip_sdy(module, target)
        except _CannotStrip as err:
            section["problem"] = f"the module uses {err}, which carries computation"
        except Exception as err:  # jaxlib raises assorted types on modules it cannot rewrite
            section["problem"] = f"stripping sdy failed: {type(err).__name__}: {err}"[:500]
        else:
            path = Path(model_dir, PREPARED_MODULE)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(stripped)
            section["module"] = PREPARED_MODULE
            section["module_sha256"] = hashlib.sha256(stripped).hexdigest()
            section["changes"] = ["sdy stripped"]
        if "problem" in section:
            _logger.warning("jaxexp: IREE preparation: %s", section["problem"])
    return section
