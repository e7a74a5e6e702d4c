"""Request limits of the jaxexp scoring server (``jaxexp serve``): body size, bytes in flight, JSON.

* :class:`BodyLimit`, an ASGI middleware on the server's own app (``flavors/server.py``),
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
  arrays, vectorised (``flavors/inputs.convert``).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from jaxexp_mlflow.errors import InputError

ENV_MAX_INFLIGHT = "JAXEXP_MAX_INFLIGHT_BYTES"
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
            f"The request body nests JSON too deeply: expected arrays as deep as the inputs' "
            f"rank. Inputs: {expected}."
        ) from None
    except UnicodeDecodeError:
        raise InputError(
            "The request body is not UTF-8 JSON. Send a JSON object such as "
            f'{{"inputs": ...}} with: {expected}.'
        ) from None
    except json.JSONDecodeError as err:
        raise InputError(
            f"The request body is not valid JSON ({err.msg} at line {err.lineno} column "
            f'{err.colno}). Send a JSON object such as {{"inputs": ...}} with: {expected}.'
        ) from None
    except ValueError as err:  # int() beyond the digit limit
        detail = "an integer longer than any input dtype holds" if "digits" in str(err) else ""
        raise InputError(
            f"The request body holds {detail or 'a value JSON cannot carry here'} "
            f"({str(err)[:60]}): expected numbers within the inputs' dtypes. Inputs: {expected}."
        ) from None


class _TooLarge(Exception):
    pass


class _Busy(Exception):
    pass


class BodyLimit:
    """ASGI middleware: bound ``/invocations`` bodies while they stream in, and in flight."""

    def __init__(self, app: Any, *, limit: int, inflight: int) -> None:
        self.app = app
        self.limit = int(limit)
        self.inflight = max(int(inflight), self.limit)
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

        def reserve(n: int) -> None:
            nonlocal held
            if self.used + n > self.inflight:  # a lone request (<= limit) always fits
                raise _Busy
            self.used += n
            held += n

        async def limited_receive() -> Any:
            message = await receive()
            if message.get("type") == "http.request":
                n = len(message.get("body", b""))
                if held + n > self.limit:
                    raise _TooLarge
                reserve(n)
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
