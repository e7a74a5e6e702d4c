"""The page headers of a parquet body, read before pyarrow decodes a page.

A parquet file states sizes twice: in its footer (each column chunk's values and bytes) and in
the header of every page (``uncompressed_page_size``, the buffer a reader allocates and
decompresses into, and the page's ``num_values``). pyarrow trusts each page header: a footer
of one row over one zstd page whose header claims 1 GiB (a 32 kB body of zstd RLE blocks)
makes it allocate and fill 1 GiB. ``serving_guard.parquet_frame`` checks the footer, then sums
what every page header states with :func:`page_sizes` against the same budget.

Why a reader of our own: pyarrow exposes no page header before it reads the page (its
``ParquetFile`` and ``read_table`` decompress as they go), and no other installed package reads
parquet's Thrift structures. The part read here is small: a page header is a Thrift struct in
the compact protocol, of which three integer fields and one field of a nested struct are
needed; everything else is skipped by its wire type, bounded in depth and by the body's end.
``tests/security/test_serving_bounds.py`` checks it against files pyarrow writes (plain, dictionary,
data page v2, several pages and row groups).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["BadPages", "Page", "page_sizes"]

# PageHeader field ids (parquet.thrift)
_TYPE, _UNCOMPRESSED, _COMPRESSED = 1, 2, 3
_DATA_HEADER, _DICTIONARY_HEADER, _DATA_HEADER_V2 = 5, 7, 8
_MAX_DEPTH = 16
#: More pages than this in one request body is refused: each costs pyarrow a header parse.
MAX_PAGES = 1 << 16


class BadPages(ValueError):
    """The page headers cannot be read (truncated, not Thrift, more pages than allowed)."""


class Page(NamedTuple):
    """What one page header states."""

    kind: int  # 0 data, 1 index, 2 dictionary, 3 data v2
    uncompressed: int
    compressed: int
    num_values: int


class _Reader:
    def __init__(self, data: bytes | memoryview, pos: int, end: int) -> None:
        self.data, self.pos, self.end = data, pos, end

    def byte(self) -> int:
        if self.pos >= self.end:
            raise BadPages("truncated page header")
        b = self.data[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        shift = result = 0
        while True:
            b = self.byte()
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7
            if shift > 63:
                raise BadPages("varint longer than 64 bits")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def skip_bytes(self, n: int) -> None:
        if n < 0 or self.pos + n > self.end:
            raise BadPages("truncated page header")
        self.pos += n

    def skip(self, kind: int, depth: int) -> None:
        """Skip one value of compact wire type ``kind``."""
        if depth > _MAX_DEPTH:
            raise BadPages("page header nested too deeply")
        if kind in (1, 2):  # booleans in a field header: no payload
            return
        if kind == 3:
            self.skip_bytes(1)
        elif kind in (4, 5, 6):
            self.varint()
        elif kind == 7:
            self.skip_bytes(8)
        elif kind == 8:
            self.skip_bytes(self.varint())
        elif kind in (9, 10):
            head = self.byte()
            size, elem = head >> 4, head & 0x0F
            if size == 15:
                size = self.varint()
            for _ in range(size):
                self.skip(3 if elem in (1, 2) else elem, depth + 1)  # list booleans: a byte
        elif kind == 11:
            size = self.varint()
            if size:
                types = self.byte()
                key, value = (3 if t in (1, 2) else t for t in (types >> 4, types & 0x0F))
                for _ in range(size):  # every element takes a byte at least: bounded by end
                    self.skip(key, depth + 1)
                    self.skip(value, depth + 1)
        elif kind == 12:
            self.struct(depth + 1, {})
        else:
            raise BadPages(f"unknown Thrift type {kind}")

    def struct(self, depth: int, wanted: dict[int, int]) -> dict[int, int]:
        """Read one struct: integer fields whose id is in ``wanted`` (id -> -1 for integers,
        or -2 for a nested struct whose field 1 is taken) into the result, others skipped."""
        found: dict[int, int] = {}
        last = 0
        while True:
            head = self.byte()
            if head == 0:
                return found
            delta, kind = head >> 4, head & 0x0F
            field = last + delta if delta else self.zigzag()
            last = field
            want = wanted.get(field)
            if want == -1 and kind in (3, 4, 5, 6):
                found[field] = self.byte() if kind == 3 else self.zigzag()
            elif want == -2 and kind == 12:
                found[field] = self.struct(depth + 1, {1: -1}).get(1, 0)
            else:
                self.skip(kind, depth)


_WANTED = {
    _TYPE: -1,
    _UNCOMPRESSED: -1,
    _COMPRESSED: -1,
    _DATA_HEADER: -2,
    _DICTIONARY_HEADER: -2,
    _DATA_HEADER_V2: -2,
}


def read_page_header(data: bytes | memoryview, pos: int, end: int) -> tuple[Page, int]:
    """The page header at ``pos`` (not past ``end``) and the offset of its page's bytes."""
    reader = _Reader(data, pos, end)
    fields = reader.struct(0, _WANTED)
    values = max(fields.get(f, 0) for f in (_DATA_HEADER, _DICTIONARY_HEADER, _DATA_HEADER_V2))
    page = Page(
        fields.get(_TYPE, -1),
        fields.get(_UNCOMPRESSED, -1),
        fields.get(_COMPRESSED, -1),
        values,
    )
    if page.uncompressed < 0 or page.compressed < 0 or page.num_values < 0:
        raise BadPages("a page header without its sizes")
    return page, reader.pos


def page_sizes(data: bytes | memoryview, start: int, length: int) -> list[Page]:
    """The headers of every page of one column chunk: ``length`` bytes from ``start`` (its
    first page, the dictionary page if it has one). Raises :class:`BadPages`."""
    end = start + length
    if start < 0 or length < 0 or end > len(data):
        raise BadPages("a column chunk outside the body")
    pages: list[Page] = []
    pos = start
    while pos < end:
        if len(pages) >= MAX_PAGES:
            raise BadPages(f"more than {MAX_PAGES} pages")
        page, pos = read_page_header(data, pos, end)
        pages.append(page)
        pos += page.compressed
    return pages
