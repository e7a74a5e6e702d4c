"""Read the header and the custom-call targets of an MLIR bytecode module, with the stdlib only.

``Exported.mlir_module_serialized`` is a StableHLO *portable artifact*: MLIR bytecode of the VHLO
dialect (``magic "ML\\xefR"``, a bytecode version, a producer string such as
``"StableHLO_v1.18.0"``, then sections). This module walks the bytecode as MLIR's own
``BytecodeReader`` does (string, dialect, attribute/type offset, properties and IR sections) and
collects the ``call_target_name`` of every custom-call operation, and the names of the VHLO ops
the module uses (``vhlo_ops``: each VHLO op name is versioned, ``custom_call_v2`` exists from
StableHLO 1.18.0, so the names say which StableHLO a reader needs):

* ``vhlo.custom_call_v1`` (VHLO 0.9.0 to 1.17.0: jax 0.4.35 writes StableHLO 1.7.0, jax 0.10.2
  1.15.0) and ``vhlo.custom_call_v2`` (VHLO 1.18.0 onwards, which adds ``result_tilings``: jax
  0.12 writes 1.18.0; still current in StableHLO 1.20.0) ops (bytecode version >= 5) keep their
  inherent attributes in the properties section, written by ODS in the alphabetical order of the
  attribute names (``api_version, backend_config, call_target_name, called_computations, ...``),
  so the target is the third attribute of the op's properties in both versions; it must be a
  VHLO ``StringV1Attr``.
* Ops whose attributes are an attribute dictionary (older bytecode, ``stablehlo.custom_call`` or
  ``mhlo.custom_call`` in non-portable modules) are read through their ``call_target_name`` key.
* Any other ``vhlo.custom_call_vN`` (a StableHLO newer than this reader) is an error: the module
  is reported unreadable rather than read as one without custom calls.

It is hand-written because the only complete readers are MLIR's own (C++, in jaxlib): the
reader must work without JAX, in milliseconds, on hostile bytes. The price is that each new
VHLO version of an op it depends on (the custom call, ``StringV1Attr`` = attribute code 14, the
builtin dictionary) must be added here; the differential tests against the installed jax's
``exp.mlir_module()`` catch a new one.

The walk is linear in the module size: every count is checked against the bytes left before it
is used, nesting is bounded, and any inconsistency raises :class:`MlirBytecodeError`, which the
blob reader turns into ``custom_call_targets=None`` (the module is opaque to
``jax.export.deserialize`` too; only running it would fail).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxexp_mlflow.codec.mlir_bytes import (
    S_ATTRTYPE,
    S_ATTRTYPE_OFFSET,
    S_DIALECT,
    S_DIALECT_VERSIONS,
    S_IR,
    S_PROPERTIES,
    S_STRING,
    VARINT_SIZE,
    ByteReader,
    MlirBytecodeError,
    parse_textual_string,
    read_long_varint,
    read_varint,
    skip_varints,
)

__all__ = ["MlirBytecodeError", "MlirModuleInfo", "scan_module", "read_header", "module_dialects"]

MAGIC = b"ML\xefR"
MAX_REGION_DEPTH = 100  # 3 Python frames per level: stays far below the recursion limit
_MAX_VERSION = 6  # the newest MLIR bytecode version whose layout this reader implements
_NEWEST_STABLEHLO = "1.20.0"  # the newest VHLO op set checked against this reader

# Op encoding mask bits
_HAS_ATTRS, _HAS_RESULTS, _HAS_OPERANDS, _HAS_SUCCESSORS = 0x01, 0x02, 0x04, 0x08
_HAS_INLINE_REGIONS, _HAS_USE_LIST_ORDERS, _HAS_PROPERTIES = 0x10, 0x20, 0x40
# Bytecode versions that changed the layout
_V_DIALECT_VERSIONING, _V_LAZY_LOADING, _V_USE_LIST_ORDERING = 1, 2, 3
_V_ELIDE_UNKNOWN_BLOCK_ARG_LOC, _V_NATIVE_PROPERTIES = 4, 5
# Attribute codes of the dialect-defined encodings used here
_BUILTIN_DICTIONARY, _BUILTIN_STRING, _BUILTIN_STRING_WITH_TYPE = 1, 2, 3
_VHLO_STRING_V1 = 14
# Custom-call ops whose layout is known. Their properties hold call_target_name at the same
# alphabetical index: custom_call_v1 (VHLO 0.9.0 to 1.17.0) has api_version, backend_config,
# call_target_name, called_computations, has_side_effect, operand_layouts,
# output_operand_aliases, result_layouts; custom_call_v2 (VHLO 1.18.0 to current, i.e. 1.20.0)
# adds result_tilings, which sorts last. stablehlo/mhlo.custom_call also start with
# api_version, backend_config, call_target_name.
_CUSTOM_CALL_OPS = {
    ("vhlo", "custom_call_v1"),
    ("vhlo", "custom_call_v2"),
    ("stablehlo", "custom_call"),
    ("mhlo", "custom_call"),
}
_VHLO_CUSTOM_CALL_PREFIX = "custom_call_v"  # any other vhlo.custom_call_vN: unknown layout
_CALL_TARGET_PROPERTY_INDEX = 2  # alphabetical position of call_target_name (v1 and v2)


@dataclass(frozen=True)
class MlirModuleInfo:
    """What the scan found: bytecode version, producer, and the custom-call targets (sorted,
    unique) or ``None`` with ``error`` saying why they could not be read."""

    bytecode_version: int | None
    producer: str | None
    custom_call_targets: tuple[str, ...] | None
    error: str | None
    #: ``(target, operand count, result count)`` of every custom call (sorted, unique): the
    #: kernel ABI the module was written against (a changed operand count fails at execution).
    custom_calls: tuple[tuple[str, int, int], ...] | None = None
    #: Names of the VHLO ops the module uses, without the dialect prefix (``"custom_call_v2"``),
    #: sorted and unique, as listed by the dialect section; ``None`` when that section (or one
    #: read before it) is unreadable. Set even when the IR walk fails later.
    vhlo_ops: tuple[str, ...] | None = None


def read_header(data: bytes) -> tuple[int, str, ByteReader]:
    """(bytecode version, producer string, reader positioned at the first section)."""
    r = ByteReader(data)
    if data[:4] != MAGIC:
        raise MlirBytecodeError("module does not start with the MLIR bytecode magic 'ML\\xefR'")
    r.p = 4
    version = r.varint()
    end = data.find(b"\0", r.p)
    if end < 0:
        raise MlirBytecodeError("producer string is not NUL-terminated")
    try:
        producer = data[r.p : end].decode("utf-8")
    except UnicodeDecodeError as e:
        raise MlirBytecodeError(f"producer string is not valid UTF-8 ({e.reason})") from None
    r.p = end + 1
    return version, producer, r


def scan_module(data: bytes) -> MlirModuleInfo:
    """Version, producer and custom-call targets of a MLIR bytecode module; never raises."""
    try:
        version, producer, r = read_header(data)
    except MlirBytecodeError as e:
        return MlirModuleInfo(None, None, None, str(e))
    ops: tuple[str, ...] | None = None
    try:
        scanner = _Scanner(data, version, r)
        ops = scanner.vhlo_ops()
        targets = scanner.custom_call_targets()
    except MlirBytecodeError as e:
        return MlirModuleInfo(version, producer, None, str(e), vhlo_ops=ops)
    except IndexError:
        error = "module is truncated (read past its end)"
        return MlirModuleInfo(version, producer, None, error, vhlo_ops=ops)
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as e:
        # Defensive: the module is an opaque payload for jax.export too; whatever is wrong in
        # it must not make the blob unreadable. Reported, never raised.
        return MlirModuleInfo(version, producer, None, f"unreadable module ({e!r})", vhlo_ops=ops)
    calls = tuple(sorted(set(scanner.calls)))
    return MlirModuleInfo(version, producer, targets, None, calls, ops)


def module_dialects(data: bytes) -> tuple[str, ...] | None:
    """Names of the dialects a MLIR bytecode module uses (e.g. ``("builtin", "sdy", "vhlo")``),
    sorted; ``None`` when the module cannot be read. Never raises."""
    try:
        version, _, r = read_header(data)
        return tuple(sorted(set(_Scanner(data, version, r).dialect_names)))
    except (MlirBytecodeError, IndexError, ValueError, KeyError, TypeError, RecursionError):
        return None


class _Scanner:
    def __init__(self, data: bytes, version: int, r: ByteReader) -> None:
        if version > _MAX_VERSION:
            raise MlirBytecodeError(
                f"bytecode version {version} is newer than {_MAX_VERSION}, the newest known here"
            )
        self.version = version
        sections: dict[int, ByteReader] = {}
        while not r.empty():
            sid, sec = r.section()
            if sid in sections:
                raise MlirBytecodeError(f"duplicate section {sid}")
            sections[sid] = sec
        required = [S_STRING, S_DIALECT, S_ATTRTYPE, S_ATTRTYPE_OFFSET, S_IR]
        if version >= _V_NATIVE_PROPERTIES:
            required.append(S_PROPERTIES)
        for sid in required:
            if sid not in sections:
                raise MlirBytecodeError(f"missing required section {sid}")
        self.data = data
        self.strings = self._strings(sections[S_STRING])
        self.op_names = self._dialects(sections[S_DIALECT])
        self.attrs = self._attr_offsets(sections[S_ATTRTYPE], sections[S_ATTRTYPE_OFFSET])
        self.props = self._properties(sections.get(S_PROPERTIES))
        self.ir = sections[S_IR]
        self.custom_call_ids = {
            i for i, (d, name, _) in enumerate(self.op_names) if (d, name) in _CUSTOM_CALL_OPS
        }
        # A newer VHLO custom-call version (a StableHLO newer than this reader) may have moved
        # call_target_name: the module cannot be fully read, which is reported, never guessed.
        self.unknown_custom_call_ids = {
            i
            for i, (d, name, _) in enumerate(self.op_names)
            if d == "vhlo"
            and name.startswith(_VHLO_CUSTOM_CALL_PREFIX)
            and (d, name) not in _CUSTOM_CALL_OPS
        }
        # (attr dict, props, registered, operand count, result count) of each custom call
        self.found: list[tuple[int | None, int | None, bool, int, int]] = []
        self.calls: list[tuple[str, int, int]] = []
        self.ops_left = self.ir.left()  # every op takes >= 3 bytes: a hard bound on the walk

    def vhlo_ops(self) -> tuple[str, ...]:
        """The VHLO op names of the dialect section (MLIR's writer lists the ops it numbered
        while walking the module, i.e. exactly those used), without the prefix; sorted."""
        return tuple(sorted({name for d, name, _ in self.op_names if d == "vhlo"}))

    # -- tables ---------------------------------------------------------------------------
    def _strings(self, r: ByteReader) -> list[bytes]:
        n = r.count("string")
        sizes = [r.varint() for _ in range(n)]
        end = r.e
        out: list[bytes] = [b""] * n
        for i, size in enumerate(sizes):  # sizes are stored in reverse order
            if size < 1 or size > end - r.p:
                raise MlirBytecodeError(f"string size {size} exceeds the string data")
            out[n - 1 - i] = self.data[end - size : end - 1]
            end -= size
        if end != r.p:
            raise MlirBytecodeError("string section has trailing data before the strings")
        return out

    def _string(self, idx: int) -> bytes:
        if idx >= len(self.strings):
            raise MlirBytecodeError(f"string index {idx} out of range ({len(self.strings)})")
        return self.strings[idx]

    def _dialects(self, r: ByteReader) -> list[tuple[str, str, bool | None]]:
        nd = r.count("dialect")
        dialects: list[str] = []
        self.dialect_names = dialects
        for _ in range(nd):
            if self.version < _V_DIALECT_VERSIONING:
                dialects.append(self._string(r.varint()).decode("utf-8", "replace"))
                continue
            v = r.varint()
            dialects.append(self._string(v >> 1).decode("utf-8", "replace"))
            if v & 1:
                sid, _ = r.section()
                if sid != S_DIALECT_VERSIONS:
                    raise MlirBytecodeError("expected a dialect version section")
        if self.version >= _V_ELIDE_UNKNOWN_BLOCK_ARG_LOC:
            r.varint()  # number of op names (a reservation hint)
        ops: list[tuple[str, str, bool | None]] = []
        while not r.empty():
            d = r.varint()
            if d >= nd:
                raise MlirBytecodeError(f"op name group refers to dialect {d} of {nd}")
            for _ in range(r.count("op name")):
                v = r.varint()
                if self.version < _V_NATIVE_PROPERTIES:
                    ops.append((dialects[d], self._string(v).decode("utf-8", "replace"), None))
                else:
                    name = self._string(v >> 1).decode("utf-8", "replace")
                    ops.append((dialects[d], name, bool(v & 1)))
        return ops

    def _attr_offsets(self, data: ByteReader, r: ByteReader) -> list[tuple[int, bool, int, int]]:
        """(dialect index, has custom encoding, start, end) for every attribute. Types are not
        needed and not decoded."""
        b, p, e = r.b, r.p, r.e
        num_attrs, p = read_varint(b, p)
        _num_types, p = read_varint(b, p)
        if num_attrs > e - p:
            raise MlirBytecodeError(f"{num_attrs} attributes declared in {e - p} bytes")
        nd = len(self.dialect_names)
        attrs: list[tuple[int, bool, int, int]] = []
        append = attrs.append
        cur, data_end = data.p, data.e
        while len(attrs) < num_attrs:
            d, p = read_varint(b, p)
            n, p = read_varint(b, p)
            if d >= nd:
                raise MlirBytecodeError(f"attribute group refers to dialect {d} of {nd}")
            if n == 0 or len(attrs) + n > num_attrs:
                raise MlirBytecodeError("attribute group overflows the declared count")
            for _ in range(n):
                c = b[p]
                if c & 1:
                    v, p = c >> 1, p + 1
                else:
                    v, p = read_long_varint(b, p)
                nxt = cur + (v >> 1)
                if nxt > data_end:
                    raise MlirBytecodeError("attribute entry points past its section")
                append((d, bool(v & 1), cur, nxt))
                cur = nxt
            if p > e:
                raise MlirBytecodeError("attribute offset section is truncated")
        return attrs

    def _properties(self, r: ByteReader | None) -> list[tuple[int, int]]:
        if r is None or r.empty():
            return []
        b, p, e = r.b, r.p, r.e
        n, p = read_varint(b, p)
        if n > e - p:
            raise MlirBytecodeError(f"{n} properties declared in {e - p} bytes")
        out = []
        for _ in range(n):
            size, p = read_varint(b, p)
            if size > e - p:
                raise MlirBytecodeError("properties entry runs past its section")
            out.append((p, p + size))
            p += size
        if p != e:
            raise MlirBytecodeError("properties section has trailing data")
        return out

    # -- IR walk ----------------------------------------------------------------------------
    # The hot loop: plain ints and an inlined one-byte varint fast path instead of ByteReader calls
    # (about 5x faster). An overrun past a section's end is caught by the bounds checks below or,
    # at the very end of the module, by IndexError, which scan_module reports as truncation.

    def _walk_block(self, b: bytes, p: int, e: int, depth: int) -> int:
        c = b[p]
        if c & 1:
            head, p = c >> 1, p + 1
        else:
            head, p = read_long_varint(b, p)
        num_ops = head >> 1
        if head & 1:
            c = b[p]
            if c & 1:
                nargs, p = c >> 1, p + 1
            else:
                nargs, p = read_long_varint(b, p)
            if nargs > e - p:
                raise MlirBytecodeError(f"block claims {nargs} arguments in {e - p} bytes")
            if self.version >= _V_ELIDE_UNKNOWN_BLOCK_ARG_LOC:
                for _ in range(nargs):
                    c = b[p]
                    if c & 1:
                        v, p = c >> 1, p + 1
                    else:
                        v, p = read_long_varint(b, p)
                    if v & 1:
                        p = skip_varints(b, p, 1)
            else:
                p = skip_varints(b, p, 2 * nargs)
            if self.version >= _V_USE_LIST_ORDERING:
                has_orders = b[p]
                p += 1
                if has_orders:
                    p = self._walk_use_list(b, p, e, nargs)
        if num_ops * 3 > e - p:
            raise MlirBytecodeError(f"block claims {num_ops} ops in {e - p} bytes")
        for _ in range(num_ops):
            p = self._walk_op(b, p, e, depth)
        return p

    def _walk_use_list(self, b: bytes, p: int, e: int, range_size: int) -> int:
        n = 1
        if range_size > 1:
            n, p = read_varint(b, p)
        if n > e - p:
            raise MlirBytecodeError(f"use-list of {n} values exceeds the data")
        for _ in range(n):
            if range_size > 1:
                p = skip_varints(b, p, 1)
            v, p = read_varint(b, p)
            if v >> 1 > e - p:
                raise MlirBytecodeError(f"use-list of {v >> 1} indices exceeds the data")
            p = skip_varints(b, p, v >> 1)
        return p

    def _walk_regions(self, b: bytes, p: int, e: int, n: int, depth: int) -> int:
        for _ in range(n):
            num_blocks, p = read_varint(b, p)
            if num_blocks == 0:
                continue
            if num_blocks > e - p:
                raise MlirBytecodeError(f"region claims {num_blocks} blocks in {e - p} bytes")
            p = skip_varints(b, p, 1)  # number of values defined in the region
            for _ in range(num_blocks):
                p = self._walk_block(b, p, e, depth)
            if p > e:
                raise MlirBytecodeError("region runs past the end of its section")
        return p

    def _walk_op(self, b: bytes, p: int, e: int, depth: int) -> int:
        self.ops_left -= 1
        if self.ops_left < 0:
            raise MlirBytecodeError("more operations than the IR section can hold")
        c = b[p]
        if c & 1:
            name_idx, p = c >> 1, p + 1
        else:
            name_idx, p = read_long_varint(b, p)
        if name_idx >= len(self.op_names):
            raise MlirBytecodeError(f"op name index {name_idx} out of range")
        mask = b[p]
        p += 1 + VARINT_SIZE[b[p + 1]]  # skip the location attribute
        attr_dict = props = None
        if mask & _HAS_ATTRS:
            attr_dict, p = read_varint(b, p)
        if mask & _HAS_PROPERTIES:
            if self.op_names[name_idx][2] is None:
                raise MlirBytecodeError("op has properties in bytecode older than version 5")
            props, p = read_varint(b, p)
        num_results = 0
        if mask & _HAS_RESULTS:
            c = b[p]
            if c & 1:
                num_results, p = c >> 1, p + 1
            else:
                num_results, p = read_long_varint(b, p)
            if num_results > e - p:
                raise MlirBytecodeError(f"op claims {num_results} results in {e - p} bytes")
            p = skip_varints(b, p, num_results)
        num_operands = 0
        for bit in (_HAS_OPERANDS, _HAS_SUCCESSORS):
            if mask & bit:
                c = b[p]
                if c & 1:
                    n, p = c >> 1, p + 1
                else:
                    n, p = read_long_varint(b, p)
                if n > e - p:
                    raise MlirBytecodeError(f"op claims {n} operands/successors in {e - p} bytes")
                p = skip_varints(b, p, n)
                if bit == _HAS_OPERANDS:
                    num_operands = n
        if self.version >= _V_USE_LIST_ORDERING and mask & _HAS_USE_LIST_ORDERS:
            p = self._walk_use_list(b, p, e, num_results)
        if name_idx in self.unknown_custom_call_ids:
            _, name, _ = self.op_names[name_idx]
            raise MlirBytecodeError(
                f"vhlo.{name} is a custom-call version this reader does not know (it knows "
                f"vhlo.custom_call_v1 and custom_call_v2, StableHLO up to {_NEWEST_STABLEHLO}): "
                "its call targets cannot be read"
            )
        if name_idx in self.custom_call_ids:
            registered = bool(self.op_names[name_idx][2])
            self.found.append((attr_dict, props, registered, num_operands, num_results))
        if mask & _HAS_INLINE_REGIONS:
            v, p = read_varint(b, p)
            num_regions, isolated = v >> 1, v & 1
            if num_regions > e - p + 1:
                raise MlirBytecodeError(f"op claims {num_regions} regions in {e - p} bytes")
            if depth >= MAX_REGION_DEPTH:
                raise MlirBytecodeError(f"regions nested deeper than {MAX_REGION_DEPTH}")
            if isolated and self.version >= _V_LAZY_LOADING:
                r = ByteReader(b, p, e)
                sid, sub = r.section()
                if sid != S_IR:
                    raise MlirBytecodeError("expected an IR section for an isolated region")
                q = self._walk_regions(b, sub.p, sub.e, num_regions, depth + 1)
                if q > sub.e:
                    raise MlirBytecodeError("isolated region runs past the end of its section")
                p = r.p
            else:
                p = self._walk_regions(b, p, e, num_regions, depth + 1)
        if p > e:
            raise MlirBytecodeError("operation runs past the end of its section")
        return p

    # -- attributes -------------------------------------------------------------------------
    def _attr(self, idx: int) -> tuple[str, bool, ByteReader]:
        if idx >= len(self.attrs):
            raise MlirBytecodeError(f"attribute index {idx} out of range ({len(self.attrs)})")
        d, custom, start, end = self.attrs[idx]
        return self.dialect_names[d], custom, ByteReader(self.data, start, end)

    def _string_attr(self, idx: int) -> str:
        """The value of a string attribute (builtin, VHLO or textual), else an error."""
        dialect, custom, r = self._attr(idx)
        if not custom:
            return parse_textual_string(r.take(r.left()))
        code = r.varint()
        if (dialect == "vhlo" and code == _VHLO_STRING_V1) or (
            dialect == "builtin" and code in (_BUILTIN_STRING, _BUILTIN_STRING_WITH_TYPE)
        ):
            raw = self._string(r.varint())
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError:
                raise MlirBytecodeError("call target name is not valid UTF-8") from None
        raise MlirBytecodeError(f"attribute {idx} ({dialect} code {code}) is not a string")

    def _target_from_dict(self, idx: int) -> str:
        dialect, custom, r = self._attr(idx)
        if dialect != "builtin" or not custom or r.varint() != _BUILTIN_DICTIONARY:
            raise MlirBytecodeError(f"custom-call attributes {idx} are not a dictionary")
        for _ in range(r.count("dictionary entry", 2)):
            key, value = r.varint(), r.varint()
            if self._string_attr(key) == "call_target_name":
                return self._string_attr(value)
        raise MlirBytecodeError("custom-call attribute dictionary has no call_target_name")

    def _target_from_props(self, idx: int) -> str:
        if idx >= len(self.props):
            raise MlirBytecodeError(f"properties index {idx} out of range ({len(self.props)})")
        start, end = self.props[idx]
        r = ByteReader(self.data, start, end)
        values = []
        while not r.empty() and len(values) <= _CALL_TARGET_PROPERTY_INDEX:
            values.append(r.varint())
        if len(values) <= _CALL_TARGET_PROPERTY_INDEX:
            raise MlirBytecodeError("custom-call properties are too short")
        return self._string_attr(values[_CALL_TARGET_PROPERTY_INDEX])

    def custom_call_targets(self) -> tuple[str, ...]:
        """Walk the IR, then resolve each custom call's target name; sorted and unique."""
        ir = self.ir
        p = self._walk_block(self.data, ir.p, ir.e, 0)
        if p != ir.e:
            raise MlirBytecodeError("IR section has trailing data after the top-level block")
        targets = set()
        for attr_dict, props, registered, n_operands, n_results in self.found:
            if props is not None and registered:
                target = self._target_from_props(props)
            elif attr_dict is not None:
                target = self._target_from_dict(attr_dict)
            else:
                raise MlirBytecodeError("custom-call op has neither properties nor attributes")
            targets.add(target)
            self.calls.append((target, n_operands, n_results))
        return tuple(sorted(targets))
