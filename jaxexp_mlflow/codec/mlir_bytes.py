"""The byte level of MLIR bytecode: prefix varints, the bounded reader of sections, and
strings stored in MLIR's textual form.

``mlir_bytecode`` scans a module with these; every count and length read here is checked
against the bytes left before it is used (a blob is untrusted input), and every failure
is a :class:`MlirBytecodeError`.
"""

from __future__ import annotations

# Section ids (mlir/Bytecode/Encoding.h)
S_STRING, S_DIALECT, S_ATTRTYPE, S_ATTRTYPE_OFFSET, S_IR = 0, 1, 2, 3, 4
S_DIALECT_VERSIONS, S_PROPERTIES, NUM_SECTIONS = 7, 8, 9


class MlirBytecodeError(ValueError):
    """The module bytes are not MLIR bytecode this reader understands."""


class ByteReader:
    """A bounded cursor over ``b[p:e]``: every read checks the bytes left and raises
    :class:`MlirBytecodeError` past the end."""

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

    def sub(self, n: int) -> ByteReader:
        if n > self.e - self.p:
            raise MlirBytecodeError(f"section of {n} bytes, only {self.e - self.p} left")
        r = ByteReader(self.b, self.p, self.p + n)
        self.p += n
        return r

    def varint(self) -> int:
        if self.p >= self.e:
            raise MlirBytecodeError("unexpected end of data reading a varint")
        value, p = read_varint(self.b, self.p)
        if p > self.e:
            raise MlirBytecodeError("truncated varint")
        self.p = p
        return value

    def count(self, what: str, min_bytes_each: int = 1) -> int:
        """A varint element count, which must fit in the bytes left (each element >= 1 byte)."""
        n = self.varint()
        if n * min_bytes_each > self.left():
            raise MlirBytecodeError(f"{what} count {n} exceeds the {self.left()} bytes left")
        return n

    def section(self) -> tuple[int, ByteReader]:
        head = self.byte()
        length = self.varint()
        sid = head & 0x7F
        if sid >= NUM_SECTIONS:
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


def read_long_varint(b: bytes, p: int) -> tuple[int, int]:
    """A multi-byte varint starting at ``p`` (the first byte's low bit is 0).

    MLIR's prefix varint: the number of trailing zero bits of the first byte is the number of
    bytes that follow (8 when the first byte is 0), the value is the rest, little-endian. The
    package's only decoder of it (``ByteReader.varint`` and the hot loops use it)."""
    first = b[p]
    if first == 0:
        if p + 9 > len(b):
            raise MlirBytecodeError("truncated varint")
        return int.from_bytes(b[p + 1 : p + 9], "little"), p + 9
    extra = (first & -first).bit_length() - 1
    if p + 1 + extra > len(b):
        raise MlirBytecodeError("truncated varint")
    return (int.from_bytes(b[p : p + 1 + extra], "little")) >> (extra + 1), p + 1 + extra


def read_varint(b: bytes, p: int) -> tuple[int, int]:
    """The varint at ``p`` and the position after it (one byte: inline; longer:
    :func:`read_long_varint`)."""
    c = b[p]
    if c & 1:
        return c >> 1, p + 1
    return read_long_varint(b, p)


# Encoded size of a varint from its first byte: 1 + the number of trailing zero bits (9 for 0).
VARINT_SIZE = bytes([9] + [(c & -c).bit_length() for c in range(1, 256)])


def skip_varints(b: bytes, p: int, n: int) -> int:
    """Position after ``n`` varints starting at ``p`` (their values are not needed)."""
    vlen = VARINT_SIZE
    for _ in range(n):
        p += vlen[b[p]]
    return p


def parse_textual_string(text: bytes) -> str:
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
