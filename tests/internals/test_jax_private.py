"""The private jax names of ``internals/jax_private``: present in the installed jax (named when
not), and each fallback gives what the private path gives."""

from __future__ import annotations

import importlib
import os

import jax
import jax.export
import jax.numpy as jnp
import numpy as np
import pytest

from jaxexp_mlflow.internals import jax_private

#: where each name of PRIVATE_NAMES is looked up, and the releases that lack it on purpose
LOOKUPS = {
    "serialization._SERIALIZATION_VERSION": (
        "jax._src.export.serialization",
        "_SERIALIZATION_VERSION",
    ),
    "xla_client.OpSharding": ("jax._src.lib", "xla_client.OpSharding"),
    "xla_client.custom_call_targets": ("jax._src.lib", "xla_client.custom_call_targets"),
    "xla_bridge.backends_are_initialized": ("jax._src.xla_bridge", "backends_are_initialized"),
    "shape_poly.all_dim_vars": ("jax._src.export.shape_poly", "all_dim_vars"),
    "_DimExpr._evaluate": ("jax._src.export.shape_poly", "_DimExpr._evaluate"),
    "Exported._get_vjp": ("jax._src.export._export", "Exported._get_vjp"),
    "Exported._has_named_shardings": ("jax._src.export._export", "Exported._has_named_shardings"),
    "Exported._in_named_shardings / _out_named_shardings": (
        "jax._src.export._export",
        "Exported._in_named_shardings",
    ),
    "mlir.make_ir_context, _jax.mlir.(de)serialize_portable_artifact": (
        "jax._src.interpreters.mlir",
        "make_ir_context",
    ),
    "hlo.get_current_version": ("jax._src.lib.mlir.dialects", "hlo.get_current_version"),
    "_export._module_to_bytecode": ("jax._src.export._export", "_module_to_bytecode"),
    "passmanager.PassManager": ("jax._src.lib.mlir", "passmanager.PassManager"),
}
#: the jax releases that have each name on purpose: (first, last) (read from the wheels:
#: named shardings arrived in 0.9 and 0.12 dropped ``_has_named_shardings``, reading them only)
HELD_BY = {
    "Exported._has_named_shardings": ((0, 9), (0, 11)),
    "Exported._in_named_shardings / _out_named_shardings": ((0, 9), (99, 0)),
}


def _present(module: str, attr: str) -> bool:
    try:
        obj = importlib.import_module(module)
    except ImportError:
        return False
    for part in attr.split("."):
        fields = getattr(obj, "__dataclass_fields__", {})
        if part in fields:
            obj = fields[part]
            continue
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def test_every_private_name_is_known_and_present():
    assert set(LOOKUPS) == set(jax_private.PRIVATE_NAMES), "PRIVATE_NAMES and this test differ"
    version = tuple(int(x) for x in jax.__version__.split(".")[:2])
    missing = [
        name
        for name, (module, attr) in LOOKUPS.items()
        if not _present(module, attr)
        and not (name in HELD_BY and not HELD_BY[name][0] <= version <= HELD_BY[name][1])
    ]
    if missing and os.environ.get("JAXEXP_STRICT_PRIVATE") == "1":
        pytest.fail(f"jax {jax.__version__} lacks private name(s) {missing}: their fallbacks run")
    # CI runs strict: a release that removes one is named here the day it is out
    assert missing == [] or os.environ.get("JAXEXP_STRICT_PRIVATE") != "1"


def test_private_paths_work_on_this_jax():
    assert jax_private.serialization_schema() >= 2  # the number jax writes: 2 up to jax 0.7
    lister = jax_private.custom_call_lister()
    jax.devices()
    assert lister is not None and "lapack_sgetrf_ffi" in set(lister("cpu"))
    assert jax_private.backends_initialized() is True
    assert jax_private.portable_artifact_api() is not None
    from jaxlib.mlir.dialects import stablehlo  # the public jaxlib module jax aliases as hlo

    assert jax_private.stablehlo_version() == stablehlo.get_current_version()


def test_dimension_fallbacks_agree_with_jax():
    a, b = jax.export.symbolic_shape("a, b")
    exp = jax.export.export(jax.jit(lambda x, y: jnp.concatenate([x, x]) @ y))(
        jax.ShapeDtypeStruct((a, 3), jnp.float32), jax.ShapeDtypeStruct((3, b), jnp.float32)
    )
    avals = list(exp.in_avals) + list(exp.out_avals)
    assert jax_private.dim_vars(avals) == ["a", "b"]
    sizes = {"a": 5, "b": 7}
    for aval in avals:
        for d in aval.shape:
            want = jax_private.eval_dim(d, sizes)  # _DimExpr._evaluate where present
            assert jax_private._eval_text(str(d), sizes) == want  # the public-text fallback
    assert jax_private.eval_dim(exp.out_avals[0].shape[0], sizes) == 10
    assert jax_private.is_constant_dim(3) and not jax_private.is_constant_dim(a)
    with pytest.raises(ValueError, match="cannot evaluate"):
        jax_private._eval_text("__import__('os')", sizes)


def test_exported_fields_and_their_fallbacks():
    exp = jax.export.export(jax.jit(jnp.sin))(jax.ShapeDtypeStruct((2,), jnp.float32))
    assert jax_private.get_vjp(exp) is not None
    replaced = jax_private.with_vjp(exp, lambda e: "sentinel")
    assert jax_private.get_vjp(replaced)(None) == "sentinel"
    assert jax_private.shardings(exp, "in") == (None,)

    class Plain:  # an Exported without the private fields: left unchanged, public fields used
        in_shardings_hlo = ("hlo",)

    assert jax_private.with_vjp(Plain, lambda e: e) is Plain
    assert jax_private.shardings(Plain(), "in") == ("hlo",)
    # make_exported fills in what this jax requires, and the result serializes and runs
    rebuilt = jax_private.make_exported(
        **{
            k: getattr(exp, k)
            for k in exp.__dataclass_fields__
            if not k.startswith("_") or k == "_get_vjp"
        }
    )
    back = jax.export.deserialize(rebuilt.serialize())
    np.testing.assert_allclose(back.call(np.ones(2, np.float32)), np.sin(np.ones(2)), rtol=1e-6)
