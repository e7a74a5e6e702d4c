"""Shardings as a blob states them, read without JAX: named shardings over meshes,
partition specs, and ``HloSharding`` protos decoded to the text ``jax`` prints.

``reader`` reads a blob's ``in_shardings``/``out_shardings`` and its meshes here;
every count and depth is bounded before it is used (a blob is untrusted input).
"""

from __future__ import annotations

from typing import Any

from jaxexp_mlflow.codec.schema import (
    AXIS_TYPES,
    SCHEMA_ABSTRACT_DEVICE,
    SCHEMA_DEVICE_PLATFORM,
    SCHEMA_NAMED_SHARDINGS,
    SCHEMA_UNIQUE_TABLES,
    AbstractDeviceSlots,
    AbstractMeshSlots,
    BlobFormatError,
    GenerationEvidence,
    NamedShardingSlots,
    PartitionSpecOneAxisSlots,
    PartitionSpecSlots,
    ShardingSlots,
    Table,
)


def read_shardings(
    t: Table,
    idx_slot: int,
    inline_slot: int,
    name: str,
    unique: list[str],
    meshes: list[str],
    gen: GenerationEvidence,
) -> tuple[str | None, ...]:
    """``in_shardings``/``out_shardings``: indices into ``unique`` where the blob has them, else
    inline tables."""
    idxs = t.ints(idx_slot, name + "_idxs", 4)
    if idxs:
        out: list[str | None] = []
        for i in idxs:
            if i > len(unique):
                raise BlobFormatError(
                    f"{t.path}.{name}_idxs: index {i} but unique_named_shardings has "
                    f"{len(unique)} entries"
                )
            out.append(unique[i - 1] if i else None)
        return tuple(out)
    return tuple(_sharding(s, meshes, gen) for s in t.tables(inline_slot, name))


def _sharding(s: Table, meshes: list[str], gen: GenerationEvidence) -> str | None:
    S = ShardingSlots
    kind = s.u8(S.kind, "kind")
    if kind > 2:
        raise BlobFormatError(f"{s.path}.kind: unknown ShardingKind {kind}")
    named = s.table(S.named_sharding, "named_sharding")
    if named is not None:
        return read_named_sharding(named, meshes, gen)
    if s.has(S.hlo_sharding_proto):
        proto = s.bytes_(S.hlo_sharding_proto, "hlo_sharding_proto") or b""
        return hlo_sharding_str(proto, s.path + ".hlo_sharding_proto")
    return None


def read_named_sharding(s: Table, meshes: list[str], gen: GenerationEvidence) -> str:
    """A ``NamedSharding`` table as jax prints it, its mesh taken from ``meshes`` by index."""
    gen.saw(SCHEMA_NAMED_SHARDINGS)
    S = NamedShardingSlots
    if meshes:
        gen.saw(SCHEMA_UNIQUE_TABLES)
        idx = s.u32(S.abstract_mesh_idx, "abstract_mesh_idx")
        if idx >= len(meshes):
            raise BlobFormatError(
                f"{s.path}.abstract_mesh_idx: {idx} but there are {len(meshes)} meshes"
            )
        mesh = meshes[idx]
    else:
        m = s.table(S.mesh, "mesh")
        if m is None:
            raise BlobFormatError(f"{s.path}.mesh: missing")
        mesh = read_mesh(m, gen)
    spec_t = s.table(S.spec, "spec")
    if spec_t is None:
        raise BlobFormatError(f"{s.path}.spec: missing")
    spec = _partition_spec(spec_t)
    memory_kind = s.string(S.memory_kind, "memory_kind")
    mem = "" if memory_kind is None else f", memory_kind={memory_kind}"
    return f"NamedSharding(mesh={mesh}, spec={spec}{mem})"


def read_mesh(m: Table, gen: GenerationEvidence) -> str:
    """An ``AbstractMesh`` table as jax prints it (axis names, sizes, types, devices)."""
    S = AbstractMeshSlots
    sizes = m.ints(S.axis_sizes, "axis_sizes", 4)
    names = m.strings(S.axis_names, "axis_names")
    types = m.ints(S.axis_types, "axis_types", 1)
    if not (len(sizes) == len(names) == len(types)):
        raise BlobFormatError(
            f"{m.path}: {len(sizes)} axis sizes, {len(names)} names and {len(types)} types"
        )
    type_names = []
    for i, code in enumerate(types):
        tn = AXIS_TYPES.get(code)
        if tn is None:
            raise BlobFormatError(f"{m.path}.axis_types[{i}]: unknown AxisType code {code}")
        type_names.append(tn)
    shape = ", ".join(f"{n!r}: {s}" for n, s in zip(names, sizes, strict=True)) if names else "()"
    atr = "(" + ", ".join(type_names) + ("," if len(type_names) == 1 else "") + ")"
    dev = ""
    d = m.table(S.abstract_device, "abstract_device")
    if d is not None:
        gen.saw(SCHEMA_ABSTRACT_DEVICE)
        kind = d.string(AbstractDeviceSlots.device_kind, "device_kind")
        if kind is None:
            raise BlobFormatError(f"{d.path}.device_kind: missing")
        cores = (
            d.u32(AbstractDeviceSlots.num_cores, "num_cores")
            if d.has(AbstractDeviceSlots.num_cores)
            else None
        )
        platform = d.string(AbstractDeviceSlots.platform, "platform")
        if platform:
            gen.saw(SCHEMA_DEVICE_PLATFORM)
        else:
            platform = _platform_from_device_kind(kind)
        dev = f", device_kind={kind}, num_cores={cores}, platform={platform}"
    return f"AbstractMesh({shape}, axis_types={atr}{dev})"


def _platform_from_device_kind(kind: str) -> str:
    # What jax does for blobs written before AbstractDevice.platform existed (schema < 11).
    k = kind.lower()
    if "cpu" in k:
        return "cpu"
    if "tpu" in k:
        return "tpu"
    if any(x in k for x in ("nvidia", "tesla", "amd")):
        return "gpu"
    return "unknown"


def _partition_spec(p: Table) -> str:
    S = PartitionSpecSlots
    parts: list[Any] = []
    for one in p.tables(S.partitions, "partitions"):
        axes = one.strings(PartitionSpecOneAxisSlots.axes, "axes")
        parts.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    reduced = sorted(set(p.strings(S.reduced, "reduced")))
    unreduced = sorted(set(p.strings(S.unreduced, "unreduced")))
    pr = repr(tuple(parts))[1:-1]
    if not reduced and not unreduced:
        return f"P({pr})"

    def fmt(xs: list[str]) -> str:
        return "{" + ", ".join(repr(x) for x in xs) + "}"

    extra = []
    if unreduced:
        extra.append(f"unreduced={fmt(unreduced)}")
    if reduced:
        extra.append(f"reduced={fmt(reduced)}")
    pr = "" if not pr else f"{pr} " if pr.endswith(",") else f"{pr}, "
    return f"P({pr}{', '.join(extra)})"


_OP_SHARDING_UNKNOWN, _OP_SHARDING_UNREDUCED = 5, 6
_LAST_TILE_DIM_NAMES = {0: "replicated", 1: "maximal", 3: "other", 4: "manual", 6: "unreduced"}


def _proto_varint(b: bytes, p: int, path: str) -> tuple[int, int]:
    result = shift = 0
    while True:
        if p >= len(b) or shift > 63:
            raise BlobFormatError(f"{path}: truncated or overlong protobuf varint")
        c = b[p]
        p += 1
        result |= (c & 0x7F) << shift
        if not c & 0x80:
            return result, p
        shift += 7


def _proto_fields(b: bytes, path: str) -> dict[int, list[Any]]:
    """Decode a protobuf message into {field number: [values]} (varints and byte strings)."""
    out: dict[int, list[Any]] = {}
    p = 0
    while p < len(b):
        key, p = _proto_varint(b, p, path)
        num, wire = key >> 3, key & 7
        if num == 0:
            raise BlobFormatError(f"{path}: protobuf field number 0")
        if wire == 0:
            v, p = _proto_varint(b, p, path)
        elif wire == 2:
            n, p = _proto_varint(b, p, path)
            if n > len(b) - p:
                raise BlobFormatError(f"{path}: protobuf field {num} longer than the message")
            v, p = b[p : p + n], p + n
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            if n > len(b) - p:
                raise BlobFormatError(f"{path}: truncated protobuf fixed field {num}")
            v, p = int.from_bytes(b[p : p + n], "little"), p + n
        else:
            raise BlobFormatError(f"{path}: unsupported protobuf wire type {wire}")
        out.setdefault(num, []).append(v)
    return out


def _proto_ints(fields: dict[int, list[Any]], num: int, path: str) -> list[int]:
    """A repeated integer field, packed or not; int64 negatives come back as signed."""
    vals: list[int] = []
    for v in fields.get(num, ()):
        if isinstance(v, bytes):
            p = 0
            while p < len(v):
                x, p = _proto_varint(v, p, path)
                vals.append(x)
        else:
            vals.append(v)
    return [x - (1 << 64) if x >= 1 << 63 else x for x in vals]


def hlo_sharding_str(proto: bytes, path: str = "hlo_sharding_proto", depth: int = 0) -> str:
    """XLA's text form of a serialized ``xla.OpSharding`` (as ``str(HloSharding)`` prints it).

    Covers replicated, maximal, manual, unknown, tuple and tiled shardings, with iota or explicit
    device lists, ``last_tile_dim_replicate`` and ``last_tile_dims``; sharding metadata and
    shard groups are not rendered.
    """
    if depth > 16:
        raise BlobFormatError(f"{path}: tuple shardings nested too deep")
    f = _proto_fields(proto, path)
    typ = (f.get(1) or [0])[-1]
    if typ == 0:
        return "{replicated}"
    if typ == 4:
        return "{manual}"
    if typ == _OP_SHARDING_UNKNOWN:
        return "{unknown}"
    if typ == _OP_SHARDING_UNREDUCED:
        return "{unreduced}"
    devices = _proto_ints(f, 4, path)
    if typ == 1:
        if not devices:
            raise BlobFormatError(f"{path}: maximal sharding without a device")
        return f"{{maximal device={devices[0]}}}"
    if typ == 2:
        elems = []
        for i, sub in enumerate(f.get(5, ())):
            if not isinstance(sub, bytes):
                raise BlobFormatError(f"{path}.tuple_shardings[{i}]: not a message")
            elems.append(hlo_sharding_str(sub, f"{path}.tuple_shardings[{i}]", depth + 1))
        return "{" + ", ".join(elems) + "}"
    if typ != 3:
        raise BlobFormatError(f"{path}: unknown OpSharding type {typ}")
    dims = _proto_ints(f, 3, path)
    reshape = _proto_ints(f, 9, path)
    perm = _proto_ints(f, 10, path)
    if not dims:
        raise BlobFormatError(f"{path}: tiled sharding without tile_assignment_dimensions")
    text = "{devices=[" + ",".join(map(str, dims)) + "]"
    if reshape:
        text += "<=[" + ",".join(map(str, reshape)) + "]"
        if perm and perm != list(range(len(perm))):
            text += "T(" + ",".join(map(str, perm)) + ")"
    else:
        text += ",".join(map(str, devices))
    replicate_last = bool((f.get(6) or [0])[-1])
    last_tile_dims = _proto_ints(f, 8, path)
    if replicate_last:
        text += " last_tile_dim_replicate"
    elif last_tile_dims:
        names = [_LAST_TILE_DIM_NAMES.get(x, str(x)) for x in last_tile_dims]
        text += " last_tile_dims={" + ", ".join(names) + "}"
    return text + "}"
