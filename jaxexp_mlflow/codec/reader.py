"""Read a ``jax.export`` serialized blob without JAX: a typed, JSON-able description.

``read_blob(data)`` parses the flatbuffer written by ``Exported.serialize()`` (any writer from
jax 0.4.x to 0.10.x, see ``docs/codec.md``) and returns a :class:`BlobDescription`: function name,
platforms, device count, input/output avals and pytree structures, shardings, effects, safety
checks, versions, the vjp chain depth, the StableHLO producer and the custom-call targets of the
module. It imports only the standard library (``struct``, ``hashlib``, ``dataclasses``), so it
runs in a few hundred microseconds in a process that never loads jax, jaxlib, numpy or mlflow.

Every malformed input (truncated, bit-flipped, random, cyclic, oversized counts, bad UTF-8)
raises :class:`BlobFormatError` naming the field at fault, in time and memory linear in the blob
size. ``jax.export.deserialize`` trusts its input; validate with this reader first.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

from jaxexp_mlflow.codec import mlir_bytecode
from jaxexp_mlflow.codec.schema import (
    DTYPE_NAMES,
    FIRST_KEY_DTYPE,
    MAX_DEPTH,
    MEMORY_SPACES,
    PYTREE_KINDS,
    SCHEMA_CUSTOM_NODES,
    SCHEMA_JAX_VERSION,
    SCHEMA_KEY_DTYPES,
    SCHEMA_NR_DEVICES_32,
    SCHEMA_UNIQUE_TABLES,
    AbstractValueSlots,
    BlobFormatError,
    Budget,
    DisabledSafetyCheckSlots,
    EffectSlots,
    ExportedSlots,
    GenerationEvidence,
    PyTreeDefSlots,
    Table,
    root_table,
)
from jaxexp_mlflow.codec.shardings import read_mesh, read_named_sharding, read_shardings

__all__ = [
    "BlobFormatError",
    "BlobDescription",
    "TreeNode",
    "read_blob",
    "read_blob_file",
    "read_module",
    "MAX_BLOB_FILE_BYTES",
]

# read_blob_file refuses larger files rather than reading them whole into memory.
MAX_BLOB_FILE_BYTES = 2 * 1024**3


@dataclass(frozen=True)
class TreeNode:
    """One node of a serialized PyTreeDef.

    ``kind`` is one of ``leaf``, ``none``, ``tuple``, ``list``, ``dict``, ``custom``; ``keys`` holds
    the dict keys (in the order written, which JAX sorts); ``custom_name`` the name a custom node
    was registered under with ``jax.export.register_pytree_node_serialization`` and
    ``custom_auxdata`` its serialized auxiliary data.
    """

    kind: str
    children: tuple[TreeNode, ...] = ()
    keys: tuple[str, ...] | None = None
    custom_name: str | None = None
    custom_auxdata: bytes | None = None

    @property
    def num_leaves(self) -> int:
        """Number of ``leaf`` nodes under (and including) this node."""
        if self.kind == "leaf":
            return 1
        return sum(c.num_leaves for c in self.children)

    def _str(self) -> str:
        kind = self.kind
        if kind == "leaf":
            return "*"
        if kind == "none":
            return "None"
        parts = [c._str() for c in self.children]
        if kind == "tuple":
            return f"({parts[0]},)" if len(parts) == 1 else f"({', '.join(parts)})"
        if kind == "list":
            return f"[{', '.join(parts)}]"
        if kind == "dict":
            keys = self.keys or ()
            return "{" + ", ".join(f"{k!r}: {p}" for k, p in zip(keys, parts, strict=False)) + "}"
        aux = len(self.custom_auxdata or b"")
        return f"CustomNode({self.custom_name}[{aux} bytes], [{', '.join(parts)}])"

    def tree_str(self) -> str:
        """The structure as JAX prints a PyTreeDef, e.g. ``PyTreeDef(((*, *), {}))``.

        Identical to ``str(jax.tree.structure(...))`` for trees of tuples, lists, dicts and None;
        custom nodes print as ``CustomNode(<registered name>[<n> bytes], [...])`` since their
        Python type is unknown without JAX.
        """
        return f"PyTreeDef({self._str()})"

    def to_dict(self) -> dict[str, Any]:
        """JSON-able nested form."""
        d: dict[str, Any] = {"kind": self.kind}
        if self.children:
            d["children"] = [c.to_dict() for c in self.children]
        if self.keys is not None:
            d["keys"] = list(self.keys)
        if self.custom_name is not None:
            d["custom_name"] = self.custom_name
        if self.custom_auxdata is not None:
            d["custom_auxdata_hex"] = self.custom_auxdata.hex()
        return d


@dataclass(frozen=True)
class BlobDescription:
    """What a ``jax.export`` blob says about itself. All fields are plain Python values.

    Avals are ``"<dtype>[<dims>]"`` strings as JAX prints them (``"float32[b,784]"``,
    ``"bfloat16[]"``), symbolic dimensions kept. Shardings are ``None`` when unspecified, else
    the HLO sharding text for blobs of schema generation < 6 (``"{devices=[4,1]<=[4]}"``,
    ``"{replicated}"``) and the ``NamedSharding(...)`` repr JAX prints for newer ones.
    ``serialization_version`` is the number written in the file; ``schema_generation`` the
    oldest JAX serialization schema version that can have written the fields present (see
    ``docs/codec.md``). ``custom_call_targets`` is ``None`` when the module could not be read
    (``module_error`` says why).
    """

    fun_name: str
    platforms: tuple[str, ...]
    nr_devices: int
    in_avals: tuple[str, ...]
    out_avals: tuple[str, ...]
    in_tree: TreeNode
    out_tree: TreeNode
    in_shardings: tuple[str | None, ...]
    out_shardings: tuple[str | None, ...]
    ordered_effects: tuple[str, ...]
    unordered_effects: tuple[str, ...]
    disabled_safety_checks: tuple[str, ...]
    calling_convention_version: int
    serialization_version: int
    schema_generation: int
    module_kept_var_idx: tuple[int, ...]
    uses_global_constants: bool
    vjp_order: int
    stablehlo_producer: str | None
    custom_call_targets: tuple[str, ...] | None
    size: int
    sha256: str
    in_memory_spaces: tuple[str, ...] = ()
    out_memory_spaces: tuple[str, ...] = ()
    mlir_bytecode_version: int | None = None
    module_size: int = 0
    module_error: str | None = None
    unknown_fields: tuple[int, ...] = field(default=())
    #: ``(target, operand count, result count)`` of each custom call, or None (unreadable).
    custom_calls: tuple[tuple[str, int, int], ...] | None = None
    #: VHLO op names the module uses (``("add_v1", "custom_call_v2", ...)``), or None.
    vhlo_ops: tuple[str, ...] | None = None
    #: ``Exported.jax_version``: the jax that wrote the blob (schema >= 12), else None.
    jax_version: str | None = None

    def in_tree_str(self) -> str:
        """``in_tree`` as JAX prints it."""
        return self.in_tree.tree_str()

    def out_tree_str(self) -> str:
        """``out_tree`` as JAX prints it."""
        return self.out_tree.tree_str()

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict of every field (trees nested, plus their ``*_tree_str``)."""
        d: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, TreeNode):
                d[name] = value.to_dict()
                d[name + "_str"] = value.tree_str()
            elif isinstance(value, tuple):
                d[name] = list(value)
            else:
                d[name] = value
        return d


def read_blob(data: bytes | bytearray | memoryview) -> BlobDescription:
    """Describe a blob written by ``jax.export.Exported.serialize()``, without JAX.

    Raises :class:`BlobFormatError` (a ``ValueError``) for anything that is not a well-formed
    blob, with the faulty field named; ``TypeError`` if ``data`` is not bytes-like.
    """
    if isinstance(data, bytes):
        buf = data
    elif isinstance(data, (bytearray, memoryview)):
        buf = bytes(data)
    else:
        raise TypeError(f"read_blob expects bytes, bytearray or memoryview, got {type(data)}")
    budget = Budget(len(buf) // 2 + 1024)
    root = root_table(buf, "Exported", budget)
    state = GenerationEvidence()
    desc = _read_exported(root, state, depth=0)
    vjp_order = 0
    vjp = root.table(ExportedSlots.vjp, "vjp")
    while vjp is not None:
        vjp_order += 1
        if vjp_order > MAX_DEPTH:
            raise BlobFormatError(
                f"Exported.vjp: chain deeper than {MAX_DEPTH} levels (cyclic offsets?)"
            )
        _read_exported(vjp, GenerationEvidence(), depth=vjp_order)
        vjp = vjp.table(ExportedSlots.vjp, "vjp")

    module = desc.pop("_module")
    info = mlir_bytecode.scan_module(module)
    return BlobDescription(
        **desc,
        schema_generation=state.generation(desc["serialization_version"]),
        vjp_order=vjp_order,
        stablehlo_producer=info.producer,
        custom_call_targets=info.custom_call_targets,
        mlir_bytecode_version=info.bytecode_version,
        module_size=len(module),
        module_error=info.error,
        custom_calls=info.custom_calls,
        vhlo_ops=info.vhlo_ops,
        size=len(buf),
        sha256=hashlib.sha256(buf).hexdigest(),
    )


def read_module(data: bytes | bytearray | memoryview) -> bytes:
    """The ``mlir_module_serialized`` bytes of a blob (a StableHLO portable artifact), no JAX.

    Call :func:`read_blob` first to validate the whole blob; this only walks to the one field.
    """
    buf = bytes(data)
    root = root_table(buf, "Exported", Budget(len(buf) // 2 + 1024))
    module = root.bytes_(ExportedSlots.mlir_module_serialized, "mlir_module_serialized")
    if module is None:
        raise BlobFormatError("Exported.mlir_module_serialized: missing")
    return module


def read_blob_file(path: str | os.PathLike[str]) -> BlobDescription:
    """:func:`read_blob` on a file's bytes: a regular file (no link, FIFO or device followed),
    at most ``MAX_BLOB_FILE_BYTES`` (``FileNotFoundError`` if it is missing)."""
    from jaxexp_mlflow.codec import files

    if not os.path.lexists(path):
        raise FileNotFoundError(os.fspath(path))
    data = files.read_file(path, what="serialized function", max_bytes=MAX_BLOB_FILE_BYTES)
    return read_blob(data)


# -- internals ------------------------------------------------------------------------------------


def _read_exported(t: Table, gen: GenerationEvidence, depth: int) -> dict[str, Any]:
    S = ExportedSlots
    nslots = t.nslots()
    unknown = tuple(range(S.KNOWN, nslots)) if nslots > S.KNOWN else ()
    serialization_version = t.u16(S.serialization_version, "serialization_version")
    if t.has(S.nr_devices):
        gen.saw(SCHEMA_NR_DEVICES_32)
    if any(t.has(s) for s in range(S.unique_avals, S.out_shardings_idxs + 1)):
        gen.saw(SCHEMA_UNIQUE_TABLES)
    if t.has(S.jax_version):
        gen.saw(SCHEMA_JAX_VERSION)

    fun_name = t.string(S.function_name, "function_name")
    if fun_name is None:
        raise BlobFormatError("Exported.function_name: missing (required by jax.export)")

    # Avals: v10+ writes unique_avals plus index vectors; older writers the avals inline.
    unique_avals = [_aval(a, gen) for a in t.tables(S.unique_avals, "unique_avals")]
    in_avals = _avals(t, S.in_avals_idxs, S.in_avals, "in_avals", unique_avals, gen)
    out_avals = _avals(t, S.out_avals_idxs, S.out_avals, "out_avals", unique_avals, gen)

    # Shardings.
    meshes = [
        read_mesh(m, gen) for m in t.tables(S.unique_abstract_meshes, "unique_abstract_meshes")
    ]
    unique_shardings = [
        read_named_sharding(s, meshes, gen)
        for s in t.tables(S.unique_named_shardings, "unique_named_shardings")
    ]
    in_shardings = read_shardings(
        t, S.in_shardings_idxs, S.in_shardings, "in_shardings", unique_shardings, meshes, gen
    )
    out_shardings = read_shardings(
        t, S.out_shardings_idxs, S.out_shardings, "out_shardings", unique_shardings, meshes, gen
    )
    in_shardings = _fit(in_shardings, len(in_avals), t.path + ".in_shardings")
    out_shardings = _fit(out_shardings, len(out_avals), t.path + ".out_shardings")

    in_tree_t = t.table(S.in_tree, "in_tree")
    out_tree_t = t.table(S.out_tree, "out_tree")
    if in_tree_t is None or out_tree_t is None:
        raise BlobFormatError(
            f"{t.path}.{'in_tree' if in_tree_t is None else 'out_tree'}: missing "
            "(required by jax.export)"
        )
    in_tree = _tree(in_tree_t, 0, gen)
    out_tree = _tree(out_tree_t, 0, gen)
    for name, tree, avals in (("in", in_tree, in_avals), ("out", out_tree, out_avals)):
        if tree.num_leaves != len(avals):
            raise BlobFormatError(
                f"{t.path}.{name}_tree: has {tree.num_leaves} leaves but {name}_avals has "
                f"{len(avals)} entries"
            )

    nr_devices = t.u32(S.nr_devices, "nr_devices") or t.i16(S.nr_devices_short, "nr_devices_short")
    if nr_devices < 1:
        raise BlobFormatError(f"{t.path}.nr_devices: {nr_devices}, expected at least 1")

    platforms = t.strings(S.platforms, "platforms")
    ordered = tuple(_effect(e) for e in t.tables(S.ordered_effects, "ordered_effects"))
    unordered = tuple(_effect(e) for e in t.tables(S.unordered_effects, "unordered_effects"))
    checks = tuple(_check(c) for c in t.tables(S.disabled_checks, "disabled_checks"))
    module = t.bytes_(S.mlir_module_serialized, "mlir_module_serialized")
    if module is None:
        raise BlobFormatError(f"{t.path}.mlir_module_serialized: missing")
    kept = t.ints(S.module_kept_var_idx, "module_kept_var_idx", 2)
    for i in kept:
        if i >= len(in_avals):
            raise BlobFormatError(
                f"{t.path}.module_kept_var_idx: index {i} but there are {len(in_avals)} inputs"
            )

    return {
        "fun_name": fun_name,
        "platforms": platforms,
        "nr_devices": nr_devices,
        "in_avals": tuple(a for a, _ in in_avals),
        "out_avals": tuple(a for a, _ in out_avals),
        "in_memory_spaces": tuple(m for _, m in in_avals),
        "out_memory_spaces": tuple(m for _, m in out_avals),
        "in_tree": in_tree,
        "out_tree": out_tree,
        "in_shardings": in_shardings,
        "out_shardings": out_shardings,
        "ordered_effects": ordered,
        "unordered_effects": unordered,
        "disabled_safety_checks": checks,
        "calling_convention_version": t.u16(
            S.calling_convention_version, "calling_convention_version"
        ),
        "serialization_version": serialization_version,
        "module_kept_var_idx": kept,
        "uses_global_constants": bool(t.u8(S.uses_global_constants, "uses_global_constants")),
        "unknown_fields": unknown,
        "jax_version": t.string(S.jax_version, "jax_version"),
        "_module": module,
    }


def _fit(shardings: tuple[str | None, ...], n: int, path: str) -> tuple[str | None, ...]:
    if not shardings:
        return (None,) * n
    if len(shardings) != n:
        raise BlobFormatError(f"{path}: {len(shardings)} shardings for {n} avals")
    return shardings


def _avals(
    t: Table, idx_slot: int, inline_slot: int, name: str, unique: list, gen: GenerationEvidence
) -> list[tuple[str, str]]:
    idxs = t.ints(idx_slot, name + "_idxs", 4)
    if idxs:
        out = []
        for i in idxs:
            if i >= len(unique):
                raise BlobFormatError(
                    f"{t.path}.{name}_idxs: index {i} but unique_avals has {len(unique)} entries"
                )
            out.append(unique[i])
        return out
    return [_aval(a, gen) for a in t.tables(inline_slot, name)]


def _aval(a: Table, gen: GenerationEvidence) -> tuple[str, str]:
    S = AbstractValueSlots
    kind = a.u8(S.kind, "kind")
    if kind != 0:
        raise BlobFormatError(f"{a.path}.kind: {kind}, only 0 (shapedArray) is defined")
    code = a.u8(S.dtype, "dtype")
    dtype = DTYPE_NAMES.get(code)
    if dtype is None:
        raise BlobFormatError(f"{a.path}.dtype: unknown DType code {code}")
    if code >= FIRST_KEY_DTYPE:
        gen.saw(SCHEMA_KEY_DTYPES)
    mem_code = a.u8(S.memory_space, "memory_space")
    if mem_code not in MEMORY_SPACES:
        raise BlobFormatError(f"{a.path}.memory_space: unknown MemorySpace code {mem_code}")
    if mem_code:
        gen.saw(SCHEMA_NR_DEVICES_32)
    dims = a.strings(S.shape, "shape")
    for i, d in enumerate(dims):
        if not d or "," in d or "[" in d or "]" in d:
            raise BlobFormatError(f"{a.path}.shape[{i}]: {d!r} is not a dimension expression")
    return f"{dtype}[{','.join(dims)}]", MEMORY_SPACES[mem_code] or "Device"


def _tree(p: Table, depth: int, gen: GenerationEvidence) -> TreeNode:
    if depth > MAX_DEPTH:
        raise BlobFormatError(f"{p.path}: PyTreeDef nested deeper than {MAX_DEPTH} levels")
    S = PyTreeDefSlots
    code = p.u8(S.kind, "kind")
    if code >= len(PYTREE_KINDS):
        raise BlobFormatError(f"{p.path}.kind: unknown PyTreeDefKind {code}")
    kind = PYTREE_KINDS[code]
    children = tuple(_tree(c, depth + 1, gen) for c in p.tables(S.children, "children"))
    keys = None
    custom_name = None
    aux = None
    if kind in ("leaf", "none") and children:
        raise BlobFormatError(f"{p.path}: a {kind} node has {len(children)} children")
    if kind == "dict":
        keys = p.strings(S.children_names, "children_names")
        if len(keys) != len(children):
            raise BlobFormatError(
                f"{p.path}.children_names: {len(keys)} keys for {len(children)} children"
            )
    elif kind == "custom":
        gen.saw(SCHEMA_CUSTOM_NODES)
        custom_name = p.string(S.custom_name, "custom_name")
        if custom_name is None:
            raise BlobFormatError(f"{p.path}.custom_name: missing for a custom node")
        aux = p.bytes_(S.custom_auxdata, "custom_auxdata") or b""
    return TreeNode(kind, children, keys, custom_name, aux)


def _effect(e: Table) -> str:
    name = e.string(EffectSlots.type_name, "type_name")
    if name is None:
        raise BlobFormatError(f"{e.path}.type_name: missing")
    return name


def _check(c: Table) -> str:
    S = DisabledSafetyCheckSlots
    kind = c.u8(S.kind, "kind")
    if kind == 0:
        return "platform"
    if kind == 1:
        target = c.string(S.custom_call_target, "custom_call_target")
        if target is None:
            raise BlobFormatError(f"{c.path}.custom_call_target: missing for a custom_call check")
        return f"custom_call:{target}"
    if kind == 2:
        return "shape_assertions"
    raise BlobFormatError(f"{c.path}.kind: unknown DisabledSafetyCheckKind {kind}")


# -- xla.OpSharding (protobuf) to HLO sharding text ----------------------------------------------
