"""Every private name of jax and jaxlib that the package uses, in one place.

``jax.export`` leaves a few things to its internals that an archive tool needs: the running
serialization schema, the custom-call registry, how to evaluate a symbolic dimension, the
``Exported`` fields that carry the VJP and the named shardings, the MLIR context that reads a
portable artifact. Each is reached here and nowhere else, each lookup is guarded, and each has a
fallback for the release that removes it: the public path where there is one, else ``None``
("unknown") that the callers treat as "skip this check" (a new release costs a check or some
speed, never a wrong answer). ``PRIVATE_NAMES`` lists them (docs/internals.md shows the table;
``tests/internals/test_jax_private.py`` checks each against the installed jax and names the one that
vanished). Versions checked: jax/jaxlib 0.6.2, 0.10.2 and 0.12.0.1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

#: name -> (module it lives in, what we use it for, what happens without it)
PRIVATE_NAMES: dict[str, tuple[str, str, str]] = {
    "serialization._SERIALIZATION_VERSION": (
        "jax._src.export.serialization",
        "the newest blob schema this jax reads (a newer blob would be misread)",
        "None: the schema check is skipped; the calling-convention range still applies",
    ),
    "xla_client.OpSharding": (
        "jax._src.lib.xla_client",
        "tests only: the jax-free reader's HLO sharding text checked against XLA's",
        "the test fails naming the move",
    ),
    "xla_client.custom_call_targets": (
        "jax._src.lib.xla_client",
        "the kernels this jaxlib registers, to refuse a module calling a removed kernel",
        "None: the custom-call check is skipped (the call fails at compile time instead)",
    ),
    "xla_bridge.backends_are_initialized": (
        "jax._src.xla_bridge",
        "tag a run with devices without starting a backend (on GPU that allocates memory)",
        "False: the run is tagged with versions only",
    ),
    "shape_poly.all_dim_vars": (
        "jax._src.export.shape_poly",
        "the symbolic dimension names of an Exported's avals (probe inputs)",
        "names read from str(aval.shape) (public repr of symbolic dims)",
    ),
    "_DimExpr._evaluate": (
        "jax._src.export.shape_poly",
        "a symbolic dimension's size for given variable values (probe inputs)",
        "the dimension's text evaluated as integer arithmetic over the variables",
    ),
    "Exported._get_vjp": (
        "jax._src.export._export",
        "replace JAX's bare 'No VJP is available' past vjp_order by an actionable error",
        "JAX's own error is left as it is",
    ),
    "Exported._has_named_shardings": (
        "jax._src.export._export",
        "whether a deserialized Exported carries NamedShardings (jax 0.8-0.11); gone in 0.12",
        "True: jax 0.12 reads named shardings only",
    ),
    "Exported._in_named_shardings / _out_named_shardings": (
        "jax._src.export._export",
        "the NamedShardings of an Exported (jax >= 0.8)",
        "the public in_shardings_hlo / out_shardings_hlo",
    ),
    "mlir.make_ir_context, _jax.mlir.(de)serialize_portable_artifact": (
        "jax._src.interpreters.mlir, jax._src.lib",
        "read and rewrite the blob's StableHLO for the IREE backend",
        "the IREE backend compiles the stored module without the rewrite",
    ),
    "hlo.get_current_version": (
        "jax._src.lib.mlir.dialects",
        "the newest StableHLO version this jaxlib reads (a module using a newer VHLO op fails)",
        "None: the stablehlo check is skipped (the first call fails instead)",
    ),
    "_export._module_to_bytecode": (
        "jax._src.export._export",
        "remesh: serialize a rewritten module with jax.export's own StableHLO target and Shardy",
        "the remesh route is closed, saying which name moved",
    ),
    "passmanager.PassManager": (
        "jax._src.lib.mlir",
        "remesh: run Shardy's import passes (lift inlined meshes) as Exported.call does",
        "the remesh route is closed, saying which name moved",
    ),
}


def serialization_schema() -> int | None:
    """The serialization schema version this jax writes (and the newest it reads), or None."""
    try:
        from jax._src.export import serialization
    except ImportError:
        return None
    version = getattr(serialization, "_SERIALIZATION_VERSION", None)
    return int(version) if isinstance(version, int) else None


def xla_client() -> Any:
    """jaxlib's ``xla_client`` module (custom-call registry, ``OpSharding``), or None."""
    try:
        from jax._src.lib import xla_client as client
    except ImportError:
        return None
    return client


def custom_call_lister() -> Callable[[str], Any] | None:
    """jaxlib's ``custom_call_targets(platform)`` registry reader, or None."""
    return getattr(xla_client(), "custom_call_targets", None)


def backends_initialized() -> bool:
    """Whether a JAX backend is already running (False when this jax cannot tell)."""
    try:
        from jax._src import xla_bridge
    except ImportError:
        return False
    probe = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(probe()) if probe is not None else False


def is_constant_dim(d: Any) -> bool:
    """Whether a dimension is a plain integer (not symbolic)."""
    import operator

    try:
        operator.index(d)
    except Exception:  # symbolic dimensions are not integers
        return False
    return True


def dim_vars(avals: Sequence[Any]) -> list[str]:
    """The symbolic dimension variables appearing in ``avals`` (sorted)."""
    try:
        from jax._src.export import shape_poly

        return sorted(shape_poly.all_dim_vars(list(avals)))
    except (ImportError, AttributeError):
        import re

        names: set[str] = set()
        for a in avals:
            for d in a.shape:
                if not is_constant_dim(d):
                    names.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", str(d)))
        return sorted(names - {"mod", "floordiv", "max", "min", "non_negative"})


def eval_dim(d: Any, sizes: dict[str, int]) -> int:
    """The size of dimension ``d`` when each variable takes its value in ``sizes``."""
    if is_constant_dim(d):
        return int(d)
    evaluate = getattr(d, "_evaluate", None)
    if evaluate is not None:
        return int(evaluate(sizes))
    return _eval_text(str(d), sizes)


def _eval_text(text: str, sizes: dict[str, int]) -> int:
    """Integer arithmetic of a symbolic dimension's text (``2*b + 1``, ``floordiv(b, 2)``)."""
    import ast
    import operator

    ops = {
        ast.Add: operator.add,
        ast.Sub: operator.sub,
        ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod,
    }
    funcs = {"max": max, "min": min, "floordiv": operator.floordiv, "mod": operator.mod}

    def ev(n: ast.AST) -> int:
        if isinstance(n, ast.Constant) and isinstance(n.value, int):
            return n.value
        if isinstance(n, ast.Name) and n.id in sizes:
            return int(sizes[n.id])
        if isinstance(n, ast.BinOp) and type(n.op) in ops:
            return ops[type(n.op)](ev(n.left), ev(n.right))
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            return -ev(n.operand)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in funcs:
            return funcs[n.func.id](*(ev(a) for a in n.args))
        raise ValueError(f"cannot evaluate the symbolic dimension {text!r}")

    return ev(ast.parse(text, mode="eval").body)


def get_vjp(exported: Any) -> Any:
    """The ``Exported``'s VJP builder (None when it has none or this jax hides it)."""
    return getattr(exported, "_get_vjp", None)


def with_vjp(exported: Any, get_vjp_fn: Callable[[Any], Any]) -> Any:
    """A copy of ``exported`` whose VJP builder is ``get_vjp_fn`` (unchanged if impossible)."""
    if "_get_vjp" not in getattr(exported, "__dataclass_fields__", {}):
        return exported
    return dataclasses.replace(exported, _get_vjp=get_vjp_fn)


def named_shardings(exported: Any, side: str) -> tuple[Any, ...] | None:
    """The ``Exported``'s ``side`` ("in"/"out") NamedShardings (jax >= 0.9), or None where this
    jax has none (the caller then works from the public HLO shardings)."""
    named = getattr(exported, f"_{side}_named_shardings", None)
    return None if named is None else tuple(named)


def shardings(exported: Any, side: str) -> tuple[Any, ...]:
    """The ``Exported``'s ``side`` ("in"/"out") shardings: NamedShardings where it has them
    (jax >= 0.8 when deserialized from named shardings, always in jax 0.12), else HLO ones."""
    named = getattr(exported, f"_{side}_named_shardings", None)
    if named is not None and getattr(exported, "_has_named_shardings", True):
        return tuple(named)
    return tuple(getattr(exported, f"{side}_shardings_hlo"))


def make_exported(**fields: Any) -> Any:
    """An ``Exported`` from its fields, as JAX's own back-compat harness builds one; fields this
    jax does not have are dropped, and the named-sharding fields are filled in as unspecified
    where this jax requires them."""
    from jax._src.export import _export

    names = set(_export.Exported.__dataclass_fields__)
    n_in, n_out = len(fields["in_avals"]), len(fields["out_avals"])
    if "_in_named_shardings" in names:
        fields.setdefault("_in_named_shardings", (None,) * n_in)
        fields.setdefault("_out_named_shardings", (None,) * n_out)
    if "_has_named_shardings" in names:
        fields.setdefault("_has_named_shardings", True)
    return _export.Exported(**{k: v for k, v in fields.items() if k in names})


def portable_artifact_api() -> tuple[Any, Any, Any] | None:
    """``(make_ir_context, ir, api)`` of this jaxlib, ``api`` having
    ``deserialize_portable_artifact`` and ``serialize_portable_artifact``; or None."""
    try:
        from jax._src.interpreters import mlir as jax_mlir
        from jax._src.lib.mlir import ir
    except ImportError:
        return None
    try:
        from jax._src.lib import _jax
    except ImportError:  # jaxlib < 0.7 names the extension xla_extension
        try:
            from jax._src.lib import xla_client

            _jax = xla_client._xla
        except (ImportError, AttributeError):
            return None
    api = getattr(_jax, "mlir", None)
    if not all(hasattr(api, f"{d}serialize_portable_artifact") for d in ("", "de")):
        return None
    return jax_mlir.make_ir_context, ir, api


def stablehlo_version() -> str | None:
    """The StableHLO version this jaxlib reads and writes at most (``"1.17.0"`` for jaxlib
    0.10.2, ``"1.22.0"`` for 0.12.0.1), or None."""
    try:
        from jax._src.lib.mlir.dialects import hlo
    except ImportError:
        return None
    get = getattr(hlo, "get_current_version", None)
    try:
        version = get() if get is not None else None
    except Exception:  # a binding that changed its signature: unknown, the check is skipped
        return None
    return version if isinstance(version, str) and version.count(".") == 2 else None


@dataclasses.dataclass(frozen=True)
class ModuleTools:
    """What the remesh route needs from jax to read, rewrite and write an exported module."""

    make_ir_context: Callable[[], Any]
    ir: Any
    pass_manager: Any
    deserialize: Callable[[bytes], Any]
    to_bytecode: Callable[[Any], bytes]


def module_tools() -> tuple[ModuleTools | None, str]:
    """(the tools, "") or (None, why not): the private names the module rewrite needs, looked
    up in this jax; a release that moves one closes the remesh route, naming it."""
    found = portable_artifact_api()
    if found is None:
        return None, "this jaxlib has no mlir.(de)serialize_portable_artifact"
    make_ir_context, ir, api = found
    try:
        from jax._src.lib.mlir import passmanager
    except ImportError:
        return None, "this jax has no jax._src.lib.mlir.passmanager"
    try:
        from jax._src.export import _export
    except ImportError:
        return None, "this jax has no jax._src.export._export"
    to_bytecode = getattr(_export, "_module_to_bytecode", None)
    if to_bytecode is None or not hasattr(passmanager, "PassManager"):
        return None, (
            "this jax has no _export._module_to_bytecode (the serializer of jax.export)"
            if to_bytecode is None
            else "this jax has no passmanager.PassManager"
        )
    return (
        ModuleTools(
            make_ir_context,
            ir,
            passmanager.PassManager,
            api.deserialize_portable_artifact,
            to_bytecode,
        ),
        "",
    )


def exported_fields(exported: Any) -> set[str]:
    """The dataclass field names of an ``Exported`` (they differ between jax releases)."""
    return set(getattr(exported, "__dataclass_fields__", {}))


#: the ``Exported`` fields :func:`replace_exported` maps to this jax's private names
_PRIVATE_FIELDS = {
    "in_named_shardings": "_in_named_shardings",
    "out_named_shardings": "_out_named_shardings",
    "has_named_shardings": "_has_named_shardings",
    "get_vjp": "_get_vjp",
}


def has_named_shardings(exported: Any) -> bool:
    """Whether ``exported`` carries NamedShardings (jax 0.9-0.11 say so; jax 0.12 always)."""
    return bool(getattr(exported, "_has_named_shardings", True))


def replace_exported(exported: Any, **changes: Any) -> Any:
    """A copy of ``exported`` with ``changes``, the private fields named without their
    underscore (``in_named_shardings``, ``has_named_shardings``, ``get_vjp``...); a change to a
    field this jax does not have is dropped."""
    fields = exported_fields(exported)
    mapped = {_PRIVATE_FIELDS.get(k, k): v for k, v in changes.items()}
    return dataclasses.replace(exported, **{k: v for k, v in mapped.items() if k in fields})
