"""Read the header and the custom-call targets of an MLIR bytecode module, with the stdlib only.

``Exported.mlir_module_serialized`` is a StableHLO *portable artifact*: MLIR bytecode of the VHLO
dialect (``magic "ML\\xefR"``, a bytecode version, a producer string such as
``"StableHLO_v1.15.0"``, then sections). This module walks the bytecode as MLIR's own
``BytecodeReader`` does (string, dialect, attribute/type offset, properties and IR sections) and
collects the ``call_target_name`` of every custom-call operation:

* ``vhlo.custom_call_v1`` ops (bytecode version >= 5) keep their inherent attributes in the
  properties section, written by ODS in the alphabetical order of the attribute names
  (``api_version, backend_config, call_target_name, called_computations, ...``), so the target
  is the third attribute of the op's properties; it must be a VHLO ``StringV1Attr``.
* Ops whose attributes are an attribute dictionary (older bytecode, ``stablehlo.custom_call`` or
  ``mhlo.custom_call`` in non-portable modules) are read through their ``call_target_name`` key.

The walk is linear in the module size: every count is checked against the bytes left before it
is used, nesting is bounded, and any inconsistency raises :class:`MlirBytecodeError`, which the
blob reader turns into ``custom_call_targets=None`` (the module is opaque to
``jax.export.deserialize`` too; only running it would fail).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MlirBytecodeError", "MlirModuleInfo", "scan_module", "read_header"]

MAGIC = b"ML\xefR"
MAX_REGION_DEPTH = 256
_MAX_VERSION = 6  # the newest MLIR bytecode version whose layout this reader implements

# Section ids (mlir/Bytecode/Encoding.h)
_S_STRING, _S_DIALECT, _S_ATTRTYPE, _S_ATTRTYPE_OFFSET, _S_IR = 0, 1, 2, 3, 4
_S_DIALECT_VERSIONS, _S_PROPERTIES, _NUM_SECTIONS = 7, 8, 9
# Op encoding mask bits
_HAS_ATTRS, _HAS_RESULTS, _HAS_OPERANDS, _HAS_SUCCESSORS = 0x01, 0x02, 0x04, 0x08
_HAS_INLINE_REGIONS, _HAS_USE_LIST_ORDERS, _HAS_PROPERTIES = 0x10, 0x20, 0x40
# Bytecode versions that changed the layout
_V_DIALECT_VERSIONING, _V_LAZY_LOADING, _V_USE_LIST_ORDERING = 1, 2, 3
_V_ELIDE_UNKNOWN_BLOCK_ARG_LOC, _V_NATIVE_PROPERTIES = 4, 5
# Attribute codes of the dialect-defined encodings used here
_BUILTIN_DICTIONARY, _BUILTIN_STRING, _BUILTIN_STRING_WITH_TYPE = 1, 2, 3
_VHLO_STRING_V1 = 14
_CUSTOM_CALL_OPS = {
    ("vhlo", "custom_call_v1"),
    ("stablehlo", "custom_call"),
    ("mhlo", "custom_call"),
}
_CALL_TARGET_PROPERTY_INDEX = 2  # alphabetical position of call_target_name in custom_call_v1


class MlirBytecodeError(ValueError):
    """The module bytes are not MLIR bytecode this reader understands."""


@dataclass(frozen=True)
class MlirModuleInfo:
    """What the scan found: bytecode version, producer, and the custom-call targets (sorted,
    unique) or ``None`` with ``error`` saying why they could not be read."""

    bytecode_version: int | None
    producer: str | None
    custom_call_targets: tuple[str, ...] | None
    error: str | None


class _Reader:
    __slots__ = ("b", "p", "e")

    def __init__(self, b: bytes, p: int = 0, e: int | None = None) -> None:
        self.b = b
        self.p = p
        self.e = len(b) if e is None else e

    def left(self) -> int:
        return self.e - self.p

    def empty(self) -> bool:
        return self.p >= self.e

    def byte(self) -> int:
        if self.p >= self.e:
            raise MlirBytecodeError("unexpected end of data reading a byte")
        v = self.b[self.p]
        self.p += 1
        return v

    def take(self, n: int) -> bytes:
        if n > self.e - self.p:
            raise MlirBytecodeError(f"need {n} bytes, only {self.e - self.p} left")
        v = self.b[self.p : self.p + n]
        self.p += n
        return v

    def sub(self, n: int) -> _Reader:
        if n > self.e - self.p:
            raise MlirBytecodeError(f"section of {n} bytes, only {self.e - self.p} left")
        r = _Reader(self.b, self.p, self.p + n)
        self.p += n
        return r

    def varint(self) -> int:
        first = self.byte()
        if first & 1:
            return first >> 1
        if first == 0:
            return int.from_bytes(self.take(8), "little")
        extra = (first & -first).bit_length() - 1
        rest = self.take(extra)
        return (first | int.from_bytes(rest, "little") << 8) >> (extra + 1)

    def count(self, what: str, min_bytes_each: int = 1) -> int:
        """A varint element count, which must fit in the bytes left (each element >= 1 byte)."""
        n = self.varint()
        if n * min_bytes_each > self.left():
            raise MlirBytecodeError(f"{what} count {n} exceeds the {self.left()} bytes left")
        return n

    def section(self) -> tuple[int, _Reader]:
        head = self.byte()
        length = self.varint()
        sid = head & 0x7F
        if sid >= _NUM_SECTIONS:
            raise MlirBytecodeError(f"invalid section id {sid}")
        if head & 0x80:
            align = self.varint()
            if align == 0 or align & (align - 1) or align > 4096:
                raise MlirBytecodeError(f"section alignment {align} is not a power of two")
            # Padding (0xCB) up to the alignment, relative to the module start.
            while self.p % align:
                if self.byte() != 0xCB:
                    raise MlirBytecodeError("section padding byte is not 0xCB")
        return sid, self.sub(length)


def read_header(data: bytes) -> tuple[int, str, _Reader]:
    """(bytecode version, producer string, reader positioned at the first section)."""
    r = _Reader(data)
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
    try:
        targets = _Scanner(data, version, r).custom_call_targets()
    except MlirBytecodeError as e:
        return MlirModuleInfo(version, producer, None, str(e))
    except RecursionError:  # pragma: no cover - bounded by MAX_REGION_DEPTH first
        return MlirModuleInfo(version, producer, None, "module nesting too deep")
    return MlirModuleInfo(version, producer, targets, None)


class _Scanner:
    def __init__(self, data: bytes, version: int, r: _Reader) -> None:
        if version > _MAX_VERSION:
            raise MlirBytecodeError(
                f"bytecode version {version} is newer than {_MAX_VERSION}, the newest known here"
            )
        self.version = version
        sections: dict[int, _Reader] = {}
        while not r.empty():
            sid, sec = r.section()
            if sid in sections:
                raise MlirBytecodeError(f"duplicate section {sid}")
            sections[sid] = sec
        for sid in (_S_STRING, _S_DIALECT, _S_ATTRTYPE, _S_ATTRTYPE_OFFSET, _S_IR):
            if sid not in sections:
                raise MlirBytecodeError(f"missing required section {sid}")
        self.data = data
        self.strings = self._strings(sections[_S_STRING])
        self.op_names = self._dialects(sections[_S_DIALECT])
        self.attrs = self._attr_offsets(sections[_S_ATTRTYPE], sections[_S_ATTRTYPE_OFFSET])
        self.props = self._properties(sections.get(_S_PROPERTIES))
        self.ir = sections[_S_IR]
        self.found: list[tuple[int | None, int | None, bool]] = []  # (attr dict, props, reg.)
        self.ops_left = self.ir.left()  # every op takes >= 3 bytes: a hard bound on the walk

    # -- tables ---------------------------------------------------------------------------
    def _strings(self, r: _Reader) -> list[bytes]:
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

    def _dialects(self, r: _Reader) -> list[tuple[str, str, bool | None]]:
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
                if sid != _S_DIALECT_VERSIONS:
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

    def _attr_offsets(self, data: _Reader, r: _Reader) -> list[tuple[int, bool, int, int]]:
        """(dialect index, has custom encoding, start, end) for every attribute (types are
        skipped: only their sizes are checked)."""
        num_attrs = r.count("attribute")
        num_types = r.count("type")
        nd = len(self.dialect_names)
        attrs: list[tuple[int, bool, int, int]] = []
        cur = data.p
        for kind, total in ((0, num_attrs), (1, num_types)):
            done = 0
            while done < total:
                d = r.varint()
                if d >= nd:
                    raise MlirBytecodeError(f"attribute/type group refers to dialect {d} of {nd}")
                n = r.count("attribute/type group")
                if n == 0 or done + n > total:
                    raise MlirBytecodeError("attribute/type group overflows the declared count")
                for _ in range(n):
                    v = r.varint()
                    size = v >> 1
                    if size > data.e - cur:
                        raise MlirBytecodeError("attribute/type entry points past its section")
                    if kind == 0:
                        attrs.append((d, bool(v & 1), cur, cur + size))
                    cur += size
                done += n
        if not r.empty():
            raise MlirBytecodeError("attribute/type offset section has trailing data")
        return attrs

    def _properties(self, r: _Reader | None) -> list[tuple[int, int]]:
        if r is None or r.empty():
            return []
        n = r.count("properties")
        out = []
        for _ in range(n):
            size = r.varint()
            sub = r.sub(size)
            out.append((sub.p, sub.e))
        if not r.empty():
            raise MlirBytecodeError("properties section has trailing data")
        return out

    # -- IR walk ----------------------------------------------------------------------------
    def _use_list(self, r: _Reader, range_size: int) -> None:
        n = r.count("use-list value") if range_size > 1 else 1
        for _ in range(n):
            if range_size > 1:
                r.varint()
            n_idx = r.varint() >> 1
            if n_idx > r.left():
                raise MlirBytecodeError(f"use-list of {n_idx} indices exceeds the data")
            for _ in range(n_idx):
                r.varint()

    def _block(self, r: _Reader, depth: int) -> None:
        head = r.varint()
        num_ops, has_args = head >> 1, head & 1
        if has_args:
            nargs = r.count("block argument")
            for _ in range(nargs):
                if self.version >= _V_ELIDE_UNKNOWN_BLOCK_ARG_LOC:
                    if r.varint() & 1:
                        r.varint()
                else:
                    r.varint()
                    r.varint()
            if self.version >= _V_USE_LIST_ORDERING and r.byte():
                self._use_list(r, nargs)
        if num_ops * 3 > r.left():
            raise MlirBytecodeError(f"block claims {num_ops} ops in {r.left()} bytes")
        for _ in range(num_ops):
            self._op(r, depth)

    def _region(self, r: _Reader, depth: int) -> None:
        num_blocks = r.count("block")
        if num_blocks == 0:
            return
        r.varint()  # number of values defined in the region
        for _ in range(num_blocks):
            self._block(r, depth)

    def _op(self, r: _Reader, depth: int) -> None:
        self.ops_left -= 1
        if self.ops_left < 0:
            raise MlirBytecodeError("more operations than the IR section can hold")
        name_idx = r.varint()
        if name_idx >= len(self.op_names):
            raise MlirBytecodeError(f"op name index {name_idx} out of range")
        dialect, name, registered = self.op_names[name_idx]
        mask = r.byte()
        r.varint()  # location attribute
        attr_dict = props = None
        if mask & _HAS_ATTRS:
            attr_dict = r.varint()
        if mask & _HAS_PROPERTIES:
            if registered is None:
                raise MlirBytecodeError("op has properties in bytecode older than version 5")
            props = r.varint()
        num_results = 0
        if mask & _HAS_RESULTS:
            num_results = r.count("result")
            for _ in range(num_results):
                r.varint()
        if mask & _HAS_OPERANDS:
            for _ in range(r.count("operand")):
                r.varint()
        if mask & _HAS_SUCCESSORS:
            for _ in range(r.count("successor")):
                r.varint()
        if self.version >= _V_USE_LIST_ORDERING and mask & _HAS_USE_LIST_ORDERS:
            self._use_list(r, num_results)
        if (dialect, name) in _CUSTOM_CALL_OPS:
            self.found.append((attr_dict, props, bool(registered)))
        if mask & _HAS_INLINE_REGIONS:
            v = r.varint()
            num_regions, isolated = v >> 1, v & 1
            if num_regions > r.left() + 1:
                raise MlirBytecodeError(f"op claims {num_regions} regions")
            if depth >= MAX_REGION_DEPTH:
                raise MlirBytecodeError(f"regions nested deeper than {MAX_REGION_DEPTH}")
            if isolated and self.version >= _V_LAZY_LOADING:
                sid, sub = r.section()
                if sid != _S_IR:
                    raise MlirBytecodeError("expected an IR section for an isolated region")
                for _ in range(num_regions):
                    self._region(sub, depth + 1)
            else:
                for _ in range(num_regions):
                    self._region(r, depth + 1)

    # -- attributes -------------------------------------------------------------------------
    def _attr(self, idx: int) -> tuple[str, bool, _Reader]:
        if idx >= len(self.attrs):
            raise MlirBytecodeError(f"attribute index {idx} out of range ({len(self.attrs)})")
        d, custom, start, end = self.attrs[idx]
        return self.dialect_names[d], custom, _Reader(self.data, start, end)

    def _string_attr(self, idx: int) -> str:
        """The value of a string attribute (builtin, VHLO or textual), else an error."""
        dialect, custom, r = self._attr(idx)
        if not custom:
            return _parse_textual_string(r.take(r.left()))
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
        r = _Reader(self.data, start, end)
        values = []
        while not r.empty() and len(values) <= _CALL_TARGET_PROPERTY_INDEX:
            values.append(r.varint())
        if len(values) <= _CALL_TARGET_PROPERTY_INDEX:
            raise MlirBytecodeError("custom-call properties are too short")
        return self._string_attr(values[_CALL_TARGET_PROPERTY_INDEX])

    def custom_call_targets(self) -> tuple[str, ...]:
        """Walk the IR, then resolve each custom call's target name; sorted and unique."""
        self._block(self.ir, 0)
        if not self.ir.empty():
            raise MlirBytecodeError("IR section has trailing data after the top-level block")
        targets = set()
        for attr_dict, props, registered in self.found:
            if props is not None and registered:
                targets.add(self._target_from_props(props))
            elif attr_dict is not None:
                targets.add(self._target_from_dict(attr_dict))
            else:
                raise MlirBytecodeError("custom-call op has neither properties nor attributes")
        return tuple(sorted(targets))


def _parse_textual_string(text: bytes) -> str:
    """The string value of an attribute stored in MLIR's textual form: ``"foo"`` (builtin) or
    ``#vhlo.string_v1<"foo">``; escapes are ``\\\\``, ``\\"``, ``\\n``, ``\\t`` and ``\\XX``."""
    if text.endswith(b"\0"):
        text = text[:-1]
    q = text.find(b'"')
    if q < 0 or not (
        text[:q] in (b"", b"#vhlo.string_v1<") and text.endswith(b'"' if not q else b'">')
    ):
        raise MlirBytecodeError("textual attribute is not a string")
    body = text[q + 1 : len(text) - (1 if not q else 2)]
    out = bytearray()
    i = 0
    while i < len(body):
        c = body[i]
        if c == 0x5C:  # backslash
            nxt = body[i + 1 : i + 2]
            if nxt in (b"\\", b'"'):
                out += nxt
                i += 2
            elif nxt == b"n":
                out += b"\n"
                i += 2
            elif nxt == b"t":
                out += b"\t"
                i += 2
            else:
                try:
                    out.append(int(body[i + 1 : i + 3], 16))
                except ValueError:
                    raise MlirBytecodeError("bad escape in textual string attribute") from None
                i += 3
        elif c == 0x22:
            raise MlirBytecodeError("unescaped quote in textual string attribute")
        else:
            out.append(c)
            i += 1
    try:
        return out.decode("utf-8")
    except UnicodeDecodeError:
        raise MlirBytecodeError("textual string attribute is not valid UTF-8") from None
