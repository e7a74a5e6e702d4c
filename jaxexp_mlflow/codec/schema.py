"""Bounds-checked access to the ``jax.export`` flatbuffer tables, with the stdlib only.

This module knows the binary layout of a FlatBuffers buffer (root offset, tables with their
vtables, vectors, strings) and the slot numbers of the ``jax.export`` schema
(``jax/_src/export/serialization.fbs``). Every read is checked against the buffer's size before it
happens, so a hostile or damaged blob yields :class:`BlobFormatError`, never ``struct.error``,
``IndexError``, ``UnicodeDecodeError`` or a runaway loop.

It uses neither jax's generated module nor the ``flatbuffers`` runtime: the runtime does no bounds
checks at all and imports numpy (about 0.1 s), while the reader must stay a few milliseconds.
"""

from __future__ import annotations

import datetime as dt
import struct
from dataclasses import dataclass

__all__ = [
    "BlobFormatError",
    "Budget",
    "SCHEMA_HISTORY",
    "SchemaVersion",
    "Table",
    "root_table",
    "MAX_DEPTH",
]

# Nesting bound for recursive structures (PyTreeDef children, vjp chain). JAX itself has no such
# bound, but no real function has a pytree 200 levels deep; a cyclic blob hits this bound fast.
MAX_DEPTH = 200

_U8 = struct.Struct("<B").unpack_from
_U16 = struct.Struct("<H").unpack_from
_I16 = struct.Struct("<h").unpack_from
_U32 = struct.Struct("<I").unpack_from
_I32 = struct.Struct("<i").unpack_from


class BlobFormatError(ValueError):
    """The bytes are not a readable ``jax.export`` serialization.

    The message names the field (as a path such as ``Exported.in_tree.children[1]``) and what is
    wrong with it. It is the only exception :func:`jaxexp_mlflow.codec.reader.read_blob` raises
    for bad input.
    """


class Budget:
    """Counts tables and vector elements visited, so that shared or cyclic offsets (a DAG that
    expands exponentially, a vjp that points to itself) cannot make the work unbounded."""

    __slots__ = ("left", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.left = limit

    def spend(self, n: int, path: str) -> None:
        """Charge ``n`` units to the visit budget; raise when a blob asks for too much work."""
        self.left -= n
        if self.left < 0:
            raise BlobFormatError(
                f"{path}: the blob references more than {self.limit} tables/elements, more than "
                "its size allows for a real export (shared or cyclic offsets?)"
            )


class Table:
    """A flatbuffer table: ``pos`` is its start, ``vt`` its vtable, ``path`` its name in errors."""

    __slots__ = ("buf", "n", "pos", "vt", "vtlen", "tlen", "path", "budget")

    def __init__(self, buf: bytes, pos: int, path: str, budget: Budget) -> None:
        n = len(buf)
        if pos < 0 or pos + 4 > n:
            raise BlobFormatError(f"{path}: table offset {pos} is outside the {n}-byte buffer")
        budget.spend(1, path)
        vt = pos - _I32(buf, pos)[0]
        if vt < 0 or vt + 4 > n:
            raise BlobFormatError(f"{path}: vtable offset {vt} is outside the {n}-byte buffer")
        vtlen, tlen = _U16(buf, vt)[0], _U16(buf, vt + 2)[0]
        if vtlen < 4 or vtlen & 1 or vt + vtlen > n:
            raise BlobFormatError(f"{path}: vtable at {vt} has an invalid size {vtlen}")
        if tlen < 4 or pos + tlen > n:
            raise BlobFormatError(
                f"{path}: table at {pos} claims {tlen} bytes, past the buffer end"
            )
        self.buf = buf
        self.n = n
        self.pos = pos
        self.vt = vt
        self.vtlen = vtlen
        self.tlen = tlen
        self.path = path
        self.budget = budget

    # -- raw field access ------------------------------------------------------------------
    def nslots(self) -> int:
        """Number of slots this table's vtable has (the highest present field + 1)."""
        return (self.vtlen - 4) // 2

    def has(self, slot: int) -> bool:
        """Whether the field in ``slot`` is present (non-default) in this table."""
        o = 4 + 2 * slot
        return o < self.vtlen and _U16(self.buf, self.vt + o)[0] != 0

    def _field(self, slot: int, size: int, name: str) -> int:
        o = 4 + 2 * slot
        if o >= self.vtlen:
            return 0
        fo = _U16(self.buf, self.vt + o)[0]
        if fo == 0:
            return 0
        if fo + size > self.tlen:
            raise BlobFormatError(
                f"{self.path}.{name}: field at +{fo} ({size} bytes) is past the table's "
                f"{self.tlen} bytes"
            )
        return self.pos + fo

    def u8(self, slot: int, name: str, default: int = 0) -> int:
        """Scalar field ``slot`` as uint8 (``default`` when absent)."""
        p = self._field(slot, 1, name)
        return _U8(self.buf, p)[0] if p else default

    def u16(self, slot: int, name: str, default: int = 0) -> int:
        """Scalar field ``slot`` as uint16 (``default`` when absent)."""
        p = self._field(slot, 2, name)
        return _U16(self.buf, p)[0] if p else default

    def i16(self, slot: int, name: str, default: int = 0) -> int:
        """Scalar field ``slot`` as int16 (``default`` when absent)."""
        p = self._field(slot, 2, name)
        return _I16(self.buf, p)[0] if p else default

    def u32(self, slot: int, name: str, default: int = 0) -> int:
        """Scalar field ``slot`` as uint32 (``default`` when absent)."""
        p = self._field(slot, 4, name)
        return _U32(self.buf, p)[0] if p else default

    def _target(self, slot: int, name: str) -> int:
        """Absolute position an offset field points to, or 0 when the field is absent."""
        p = self._field(slot, 4, name)
        if not p:
            return 0
        t = p + _U32(self.buf, p)[0]
        if t + 4 > self.n:
            raise BlobFormatError(
                f"{self.path}.{name}: offset points to {t}, outside the {self.n}-byte buffer"
            )
        return t

    def table(self, slot: int, name: str) -> Table | None:
        """Sub-table at field ``slot``, bounds-checked, or None when absent."""
        t = self._target(slot, name)
        return Table(self.buf, t, f"{self.path}.{name}", self.budget) if t else None

    def _vector(self, slot: int, name: str, elem_size: int) -> tuple[int, int]:
        """(start of the elements, element count), checked to fit in the buffer."""
        t = self._target(slot, name)
        if not t:
            return 0, 0
        count = _U32(self.buf, t)[0]
        start = t + 4
        if count * elem_size > self.n - start:
            raise BlobFormatError(
                f"{self.path}.{name}: vector of {count} elements of {elem_size} bytes does not fit "
                f"in the {self.n - start} bytes left in the buffer"
            )
        return start, count

    def string(self, slot: int, name: str) -> str | None:
        """UTF-8 string at ``slot`` (BlobFormatError if not UTF-8), or None."""
        t = self._target(slot, name)
        if not t:
            return None
        return _string_at(self.buf, t, f"{self.path}.{name}")

    def bytes_(self, slot: int, name: str) -> bytes | None:
        """Raw byte vector at ``slot``, or None when absent."""
        start, count = self._vector(slot, name, 1)
        if not start:
            return None
        return bytes(self.buf[start : start + count])

    def ints(self, slot: int, name: str, size: int) -> tuple[int, ...]:
        """Vector of ``size``-byte integers at ``slot``."""
        start, count = self._vector(slot, name, size)
        if not count:
            return ()
        self.budget.spend(count, f"{self.path}.{name}")
        fmt = {1: "B", 2: "H", 4: "I"}[size]
        return struct.unpack_from(f"<{count}{fmt}", self.buf, start)

    def _targets(self, slot: int, name: str) -> list[tuple[int, str]]:
        """Absolute offsets (and paths) of the elements of a vector of offsets, bounds-checked."""
        start, count = self._vector(slot, name, 4)
        if not count:
            return []
        path = f"{self.path}.{name}"
        self.budget.spend(count, path)
        buf, n = self.buf, self.n
        out = []
        for i in range(count):
            p = start + 4 * i
            t = p + _U32(buf, p)[0]
            if t + 4 > n:
                raise BlobFormatError(
                    f"{path}[{i}]: offset points to {t}, outside the {n}-byte buffer"
                )
            out.append((t, f"{path}[{i}]"))
        return out

    def tables(self, slot: int, name: str) -> list[Table]:
        """Vector of sub-tables at ``slot``."""
        return [Table(self.buf, t, path, self.budget) for t, path in self._targets(slot, name)]

    def strings(self, slot: int, name: str) -> tuple[str, ...]:
        """Vector of strings at ``slot``."""
        return tuple(_string_at(self.buf, t, path) for t, path in self._targets(slot, name))


def _string_at(buf: bytes, t: int, path: str) -> str:
    n = len(buf)
    length = _U32(buf, t)[0]
    if length >= n - t - 4:  # the bytes plus the NUL terminator, as FlatBuffers' verifier wants
        raise BlobFormatError(
            f"{path}: string of {length} bytes (and its NUL) does not fit in the "
            f"{n - t - 4} bytes left"
        )
    if buf[t + 4 + length] != 0:
        raise BlobFormatError(f"{path}: string of {length} bytes is not NUL-terminated")
    raw = buf[t + 4 : t + 4 + length]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BlobFormatError(
            f"{path}: string is not valid UTF-8 ({e.reason} at byte {e.start})"
        ) from None


def root_table(buf: bytes, name: str, budget: Budget) -> Table:
    """The root table of a finished flatbuffer (no file identifier: jax writes none)."""
    if len(buf) < 8:
        raise BlobFormatError(
            f"blob is {len(buf)} bytes; a jax.export serialization is at least 8 bytes "
            "(root offset and a table)"
        )
    return Table(buf, _U32(buf, 0)[0], name, budget)


# -- the jax.export schema: slot numbers (field ids) per table ----------------------------------
# Written from jax/_src/export/serialization.fbs. A slot is the field's position in its table
# declaration; FlatBuffers never renumbers fields, so older blobs simply lack the later slots.


class PyTreeDefSlots:
    kind = 0  # PyTreeDefKind: byte
    children = 1  # [PyTreeDef]
    children_names = 2  # [string], only for dict
    custom_name = 3  # string, only for custom (schema v3+)
    custom_auxdata = 4  # [byte], only for custom (schema v3+)


PYTREE_KINDS = ("leaf", "none", "tuple", "list", "dict", "custom")


class AbstractValueSlots:
    kind = 0  # AbstractValueKind: 0 shapedArray, 1 abstractToken (unused)
    shape = 1  # [string]
    dtype = 2  # DType: byte
    memory_space = 3  # MemorySpace: byte (schema v5+; 0 = missing)


DTYPE_NAMES = {
    0: "bool",
    1: "int8",
    2: "int16",
    3: "int32",
    4: "int64",
    5: "uint8",
    6: "uint16",
    7: "uint32",
    8: "uint64",
    9: "float16",
    10: "float32",
    11: "float64",
    12: "complex64",
    13: "complex128",
    14: "bfloat16",
    15: "int4",
    16: "uint4",
    17: "float8_e4m3b11fnuz",
    18: "float8_e4m3fn",
    19: "float8_e4m3fnuz",
    20: "float8_e5m2",
    21: "float8_e5m2fnuz",
    22: "float0",
    23: "float8_e4m3",
    24: "float8_e3m4",
    25: "float8_e8m0fnu",
    26: "float4_e2m1fn",
    27: "key<fry>",
    28: "key<rbg>",
    29: "key<unsafe_rbg>",
}

MEMORY_SPACES = {0: None, 1: "Device", 2: "Host", 3: "Any"}
AXIS_TYPES = {0: None, 1: "Auto", 2: "Explicit", 3: "Manual"}


class AbstractDeviceSlots:
    device_kind = 0  # string
    num_cores = 1  # uint32 = null
    platform = 2  # string (schema v11+)


class AbstractMeshSlots:
    axis_sizes = 0  # [uint32]
    axis_names = 1  # [string]
    axis_types = 2  # [AxisType: byte]
    abstract_device = 3  # AbstractDevice (schema v8+)


class PartitionSpecOneAxisSlots:
    axes = 0  # [string]


class PartitionSpecSlots:
    partitions = 0  # [PartitionSpecOneAxis]
    reduced = 1  # [string]
    unreduced = 2  # [string]


class NamedShardingSlots:
    mesh = 0  # AbstractMesh
    spec = 1  # PartitionSpec
    memory_kind = 2  # string
    abstract_mesh_idx = 3  # uint32 (schema v10+)


class ShardingSlots:
    kind = 0  # ShardingKind: 0 unspecified, 1 hlo_sharding, 2 named_sharding (deprecated)
    hlo_sharding_proto = 1  # [byte]: a serialized xla.OpSharding proto (schema <= v8)
    named_sharding = 2  # NamedSharding (schema v6+)


class EffectSlots:
    type_name = 0  # string


class DisabledSafetyCheckSlots:
    kind = 0  # 0 platform, 1 custom_call, 2 shape_assertions (unused)
    custom_call_target = 1  # string


class ExportedSlots:
    serialization_version = 0  # uint16
    function_name = 1  # string
    in_tree = 2  # PyTreeDef
    in_avals = 3  # [AbstractValue]
    out_tree = 4  # PyTreeDef
    out_avals = 5  # [AbstractValue]
    nr_devices_short = 6  # short (deprecated in v5, dropped by writers of v10+)
    in_shardings = 7  # [Sharding]
    out_shardings = 8  # [Sharding]
    platforms = 9  # [string]
    ordered_effects = 10  # [Effect]
    unordered_effects = 11  # [Effect]
    disabled_checks = 12  # [DisabledSafetyCheck]
    mlir_module_serialized = 13  # [byte]
    calling_convention_version = 14  # uint16
    module_kept_var_idx = 15  # [uint16]
    uses_global_constants = 16  # bool
    vjp = 17  # Exported
    nr_devices = 18  # uint32 (schema v5+)
    unique_avals = 19  # [AbstractValue] (schema v10+)
    unique_abstract_meshes = 20  # [AbstractMesh] (schema v10+)
    unique_named_shardings = 21  # [NamedSharding] (schema v10+)
    in_avals_idxs = 22  # [uint32] (schema v10+)
    out_avals_idxs = 23  # [uint32] (schema v10+)
    in_shardings_idxs = 24  # [uint32], 1-based, 0 = unspecified (schema v10+)
    out_shardings_idxs = 25  # [uint32] (schema v10+)
    jax_version = 26  # string (added after jax 0.10.2)
    KNOWN = 27


# -- the jax.export schema's history ------------------------------------------------------------
# The one table of what each serialization schema version added, when, and how a blob shows it
# (the reader's ``schema_generation`` evidence, ``runtime.compat``'s dating and verdict, and
# docs/codec.md all come from here). Read from the comments above ``_SERIALIZATION_VERSION`` in
# jax/_src/export/serialization.py (jax 0.12.0.1).


@dataclass(frozen=True)
class SchemaVersion:
    """One version of the ``jax.export`` serialization schema."""

    number: int
    #: the date jax gives the version: a blob showing it was written by a jaxlib built on or
    #: after that date
    date: dt.date
    adds: str
    #: how a blob shows it (what the reader takes as evidence of this generation)
    evidence: str
    #: an older reader misreads the fields it moved, rather than skipping new ones
    breaking: bool = False


SCHEMA_HISTORY: tuple[SchemaVersion, ...] = (
    SchemaVersion(1, dt.date(2023, 11, 1), "first version", "written number 1"),
    SchemaVersion(2, dt.date(2023, 12, 16), "the f0 dtype", "default"),
    SchemaVersion(
        3, dt.date(2024, 10, 16), "custom and namedtuple pytree nodes", "a custom PyTreeDef node"
    ),
    SchemaVersion(4, dt.date(2025, 4, 7), "PRNG key dtypes", "dtype codes 27-29"),
    SchemaVersion(
        5,
        dt.date(2025, 11, 23),
        "AbstractValue.memory_space; nr_devices as uint32 (an older reader sees 0 devices)",
        "slot 18 or a memory space",
        breaking=True,
    ),
    SchemaVersion(
        6, dt.date(2026, 1, 15), "Sharding.named_sharding (beside the HLO one)", "a NamedSharding"
    ),
    # 7 was briefly live and pulled back by JAX: no blob carries it
    SchemaVersion(8, dt.date(2026, 3, 12), "AbstractMesh.abstract_device", "an AbstractDevice"),
    SchemaVersion(
        9, dt.date(2026, 3, 17), "HLO sharding proto dropped", "(an absence: not detectable)"
    ),
    SchemaVersion(
        10,
        dt.date(2026, 4, 4),
        "shared tables of unique avals, meshes and shardings, indexed per argument",
        "slots 19-25",
        breaking=True,
    ),
    SchemaVersion(11, dt.date(2026, 5, 15), "AbstractDevice.platform", "a device platform"),
    SchemaVersion(12, dt.date(2026, 7, 29), "Exported.jax_version", "slot 26"),
)

#: The generation a blob shows by each signal (the reader's evidence; see ``evidence`` above).
SCHEMA_CUSTOM_NODES = 3
SCHEMA_KEY_DTYPES = 4
SCHEMA_NR_DEVICES_32 = 5
SCHEMA_NAMED_SHARDINGS = 6
SCHEMA_ABSTRACT_DEVICE = 8
SCHEMA_UNIQUE_TABLES = 10
SCHEMA_DEVICE_PLATFORM = 11
SCHEMA_JAX_VERSION = 12
#: The first DType code of the PRNG key dtypes (``key<fry>``).
FIRST_KEY_DTYPE = 27

#: The date of each schema version (``runtime.compat`` brackets a bare blob's writer with it).
SCHEMA_DATES: dict[int, dt.date] = {v.number: v.date for v in SCHEMA_HISTORY}
#: Versions an older reader misreads rather than partly ignores (flatbuffers skip unknown
#: fields): the others add fields or values that a blob uses only when it needs them.
BREAKING_SCHEMAS: tuple[int, ...] = tuple(v.number for v in SCHEMA_HISTORY if v.breaking)
#: Blob signals only older writers produce (by default): value -> first jax that writes newer.
#: jax 0.7.0 made calling convention 10 the default; the flatbuffer's serialization_version
#: field reads 3 from jax 0.8.0 (2 before), whatever the real schema, until jax 0.12 wrote the
#: real number (12 in 0.12.0.1).
CALLING_CONVENTION_WRITTEN_UNTIL = {9: "0.7.0"}
SERIALIZATION_FIELD_WRITTEN_UNTIL = {2: "0.8.0"}
SERIALIZATION_FIELD_WRITTEN_FROM = {3: "0.8.0"}
#: jax >= 0.11.1 refuses blobs of schema < 5 (without the 32-bit ``nr_devices``; written by
#: jax <= 0.7) unless its ``jax_export_deserialize_expired_versions`` flag is set, and any
#: sharding given only as an HLO sharding proto, whatever the flag (serialization.py, read in
#: 0.11.0, 0.11.1, 0.11.2 and 0.12.0.1). No release refuses a blob by its date (a TODO in 0.12
#: plans a minimum schema after 2027-01).
ENFORCING_JAX = (0, 11, 1)
OLDEST_SCHEMA_READ_BY_ENFORCING_JAX = SCHEMA_NR_DEVICES_32


class GenerationEvidence:
    """Evidence of the writer's schema generation, collected while reading."""

    __slots__ = ("level",)

    def __init__(self) -> None:
        self.level = 0

    def saw(self, level: int) -> None:
        """A field or value first written by schema generation ``level`` was read."""
        if level > self.level:
            self.level = level

    def generation(self, written: int) -> int:
        """The writer's generation: the newest one seen, at least what ``written`` implies."""
        base = 1 if written == 1 else 2
        return max(base, self.level)
