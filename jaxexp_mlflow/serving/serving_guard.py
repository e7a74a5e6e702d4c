"""Request limits of the jaxexp scoring server (``jaxexp serve``): body size, bytes in flight,
slow bodies, decoded size, deadlines, JSON.

* :class:`BodyLimit`, an ASGI middleware on the server's own app (``serving/server.py``),
  answers 413 as soon as ``Content-Length`` or the bytes received so far pass the model's
  ``max_request_bytes``: a chunked 1 GiB body is refused after the first 64 MiB, never
  buffered. It also bounds the bytes of all request bodies in flight together (default 4x the
  limit, ``JAXEXP_MAX_INFLIGHT_BYTES``): a request that would pass it is answered 503 with
  ``Retry-After``, so many concurrent large requests cannot exhaust memory, while small ones
  are never turned away.
* :func:`loads` parses JSON with CPython's C scanner and no per-number hook (the JSON floor),
  and turns what it raises into a 400: integers longer than CPython's digit limit
  (``sys.get_int_max_str_digits``, 4300 by default; where a process lifted that limit, a
  bounded ``parse_int`` takes over), nesting deeper than the recursion limit, invalid JSON or
  UTF-8. Non-finite numbers and integers beyond the input dtypes are refused on the converted
  arrays, vectorised (``serving/inputs.convert``).
* A body must arrive whole within ``JAXEXP_BODY_TIMEOUT_S`` seconds (default 60) of the
  request's start: a client that sends all but the last byte and waits is answered 408 and its
  bytes leave the in-flight budget.
* :func:`parquet_frame` reads a parquet body's footer and every page header first and refuses
  (413) a body whose columns would decode to more than :func:`decoded_limit` bytes (4x
  ``max_request_bytes``: a JSON number takes at least 2 bytes and decodes to 8), or whose
  columns are not numbers, before anything is decoded: parquet's dictionary and run-length
  encodings turn a few hundred kB of constant columns into gigabytes, and a page header may
  claim more than the footer (a zstd page of 1 GiB in 32 kB).
* :func:`deadline` / :func:`check_deadline`: the work of a request stops at the next checkpoint
  (after parsing, between the chunks of a batch larger than the largest bucket) once its
  deadline has passed (``MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT``, answered 504).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from jaxexp_mlflow import settings
from jaxexp_mlflow.errors import InputError, RequestLimitError

ENV_MAX_INFLIGHT = "JAXEXP_MAX_INFLIGHT_BYTES"
ENV_BODY_TIMEOUT = "JAXEXP_BODY_TIMEOUT_S"
ENV_MAX_DECODED = "JAXEXP_MAX_DECODED_BYTES"
DEFAULT_BODY_TIMEOUT_S = 60.0
#: decoded input bytes allowed per request body byte limit: JSON's own worst ratio (a number in
#: 2 bytes, ``1,``, decodes to 8)
DECODED_FACTOR = 4
#: what a decoded list cell costs besides its values (a numpy array object per cell)
_CELL_BYTES = 112
_NUMERIC_PARQUET = {"BOOLEAN", "INT32", "INT64", "FLOAT", "DOUBLE"}
#: CPython's default digit limit: int literals up to it parse in time linear in the body.
MAX_INT_DIGITS = 4300


def _bounded_int(s: str) -> int:
    if len(s) > MAX_INT_DIGITS + 1:  # + 1: the sign
        raise ValueError(f"Exceeds the limit ({MAX_INT_DIGITS} digits)")
    return int(s)


def _int_parser() -> Any:
    """``None`` (json's own fast path) unless this process lifted CPython's digit limit."""
    limit = sys.get_int_max_str_digits()
    return None if 0 < limit <= MAX_INT_DIGITS else _bounded_int


def loads(body: str | bytes, *, expected: str) -> Any:
    """``json.loads`` of a request body; what it cannot take is an ``InputError`` (400)."""
    try:
        return json.loads(body, parse_int=_int_parser())
    except RecursionError:
        raise InputError(
            "Expected JSON arrays as deep as the inputs' rank, found JSON nested deeper than "
            f"the parser goes. Inputs: {expected}."
        ) from None
    except UnicodeDecodeError:
        raise InputError(
            'Expected a UTF-8 JSON object such as {"inputs": ...} with: '
            f"{expected}. Found bytes that are not UTF-8."
        ) from None
    except json.JSONDecodeError as err:
        raise InputError(
            f'Expected a JSON object such as {{"inputs": ...}} with: {expected}. Found text '
            f"that is not valid JSON ({err.msg} at line {err.lineno} column {err.colno})."
        ) from None
    except ValueError as err:  # int() beyond the digit limit
        detail = "an integer longer than any input dtype holds" if "digits" in str(err) else ""
        raise InputError(
            f"Expected numbers within the inputs' dtypes, found "
            f"{detail or 'a value JSON cannot carry here'} ({str(err)[:60]}). "
            f"Inputs: {expected}."
        ) from None


# -- decoded size ----------------------------------------------------------------------------------


def decoded_limit(max_request_bytes: int) -> int:
    """The most bytes of decoded input one request may hold (``JAXEXP_MAX_DECODED_BYTES``,
    default ``DECODED_FACTOR`` x the body limit)."""
    return settings.JAXEXP_MAX_DECODED_BYTES.get(DECODED_FACTOR * int(max_request_bytes))


def _paged(body: bytes, chunk: Any, expected: str) -> int:
    """What the page headers of one column chunk make pyarrow allocate: each page's
    uncompressed size (dictionary pages included) and 8 bytes per value it states."""
    from jaxexp_mlflow.serving.parquet_pages import BadPages, page_sizes

    start = chunk.data_page_offset
    dictionary = chunk.dictionary_page_offset if chunk.has_dictionary_page else None
    if dictionary and 0 < dictionary < start:  # where pyarrow starts reading the chunk
        start = dictionary
    try:
        pages = page_sizes(body, start, chunk.total_compressed_size)
    except BadPages as err:
        raise InputError(
            "Rule: a parquet body is a file written by DataFrame.to_parquet. Found a column "
            f"chunk whose page headers cannot be read ({err}). Expected inputs: {expected}."
        ) from None
    return sum(p.uncompressed + 8 * p.num_values for p in pages)


def parquet_frame(body: bytes, *, limit: int, expected: str) -> Any:
    """A parquet body as a DataFrame, its decoded size checked on the footer and the page
    headers first.

    Every column chunk must hold numbers or booleans (lists of them for array inputs); the
    values it declares (``num_values``, 8 bytes each), its uncompressed pages and one cell object
    per row and column must fit in ``limit`` bytes, else ``RequestLimitError`` (413) before a
    page is read. The sizes count twice where the file states them twice: the footer's, and
    what each page header states (``serving/parquet_pages.py``: the buffer pyarrow
    decompresses a page into, dictionary pages included), whichever is larger.
    """
    import io

    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(io.BytesIO(body)).metadata
    except Exception as err:  # noqa: BLE001 - pyarrow raises several types for a bad footer
        raise InputError(
            "Rule: a parquet body is a file written by DataFrame.to_parquet. Found a body whose "
            f"footer cannot be read ({type(err).__name__}). Expected inputs: {expected}."
        ) from None
    decoded = 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        decoded += group.num_rows * group.num_columns * _CELL_BYTES
        for c in range(group.num_columns):
            chunk = group.column(c)
            if chunk.physical_type not in _NUMERIC_PARQUET:
                raise InputError(
                    f"Rule: parquet columns hold numbers (or lists of numbers). Expected inputs: "
                    f"{expected}. Found column {str(chunk.path_in_schema)[:40]!r} of "
                    f"{chunk.physical_type}."
                )
            stated = 8 * max(chunk.num_values, 0) + max(chunk.total_uncompressed_size, 0)
            decoded += max(stated, _paged(body, chunk, expected))
    if decoded > limit:
        raise RequestLimitError(
            f"The parquet body decodes to about {decoded} bytes of input ({meta.num_rows} rows), "
            f"more than the limit of {limit} ({ENV_MAX_DECODED}; default {DECODED_FACTOR}x "
            f"max_request_bytes). Expected inputs: {expected}. Send smaller batches."
        )
    import pyarrow as pa

    try:
        return pq.read_table(pa.BufferReader(body)).to_pandas()
    except Exception as err:  # noqa: BLE001 - pages that contradict the footer, bad compression
        raise InputError(
            "Rule: a parquet body is a file written by DataFrame.to_parquet. Found pages that "
            f"cannot be read ({type(err).__name__}). Expected inputs: {expected}."
        ) from None


# -- deadlines ------------------------------------------------------------------------------------

_local = threading.local()


class DeadlineExceeded(Exception):  # noqa: N818 - raised only inside the server's worker thread
    """The request's deadline passed: its work stops here (the client already has its 504)."""


@contextlib.contextmanager
def deadline(at: float | None) -> Iterator[None]:
    """Run the block with the request deadline ``at`` (``time.monotonic()`` seconds)."""
    before = getattr(_local, "deadline", None)
    _local.deadline = at
    try:
        yield
    finally:
        _local.deadline = before


def check_deadline() -> None:
    """Raise ``DeadlineExceeded`` if this thread's request is past its deadline."""
    at = getattr(_local, "deadline", None)
    if at is not None and time.monotonic() > at:
        raise DeadlineExceeded


def body_timeout() -> float:
    """Seconds a request body may take to arrive whole (``JAXEXP_BODY_TIMEOUT_S``)."""
    return settings.JAXEXP_BODY_TIMEOUT_S.get(DEFAULT_BODY_TIMEOUT_S)


class _TooLarge(Exception):
    pass


class _Slow(Exception):
    pass


class _Busy(Exception):
    pass


class BodyLimit:
    """ASGI middleware: bound ``/invocations`` bodies while they stream in, and in flight."""

    def __init__(
        self, app: Any, *, limit: int, inflight: int, timeout_s: float | None = None
    ) -> None:
        self.app = app
        self.limit = int(limit)
        self.inflight = max(int(inflight), self.limit)
        self.body_timeout = float(timeout_s if timeout_s is not None else body_timeout())
        self.used = 0  # body bytes held by requests in progress (one event loop per worker)

    async def _reply(self, send: Any, status: int, message: str, headers: list = ()) -> None:
        body = json.dumps({"error_code": "INVALID_PARAMETER_VALUE", "message": message}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                    *headers,
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def _too_large(self, found: str) -> str:
        return (
            f"The request body has {found} bytes, more than the limit of {self.limit} "
            "(model_config max_request_bytes / JAXEXP_MAX_REQUEST_BYTES). Send smaller batches."
        )

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("path") != "/invocations":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await self._reply(send, 413, self._too_large(length.decode("latin-1")[:20]))
            return
        held = 0
        started = False
        complete = False
        body_deadline = time.monotonic() + self.body_timeout

        def reserve(n: int) -> None:
            nonlocal held
            if self.used + n > self.inflight:  # a lone request (<= limit) always fits
                raise _Busy
            self.used += n
            held += n

        async def limited_receive() -> Any:
            nonlocal complete
            if complete:  # the body is in: later reads only wait for a disconnect
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), body_deadline - time.monotonic())
            except TimeoutError:
                raise _Slow from None
            if message.get("type") == "http.request":
                n = len(message.get("body", b""))
                if held + n > self.limit:
                    raise _TooLarge
                reserve(n)
                complete = not message.get("more_body", False)
            return message

        async def tracking_send(message: Any) -> None:
            nonlocal started
            started = started or message.get("type") == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._reply(send, 413, self._too_large(f"more than {self.limit}"))
        except _Slow:
            if not started:
                await self._reply(
                    send,
                    408,
                    f"The request body did not arrive whole within {self.body_timeout:g} s "
                    f"({ENV_BODY_TIMEOUT}): expected the whole body, found {held} bytes. Send "
                    "the body without pausing.",
                )
        except _Busy:
            if not started:
                await self._reply(
                    send,
                    503,
                    f"The server holds {self.used} bytes of requests in progress, its limit "
                    f"({ENV_MAX_INFLIGHT}={self.inflight}). Retry shortly.",
                    [(b"retry-after", b"1")],
                )
        finally:
            self.used -= held
