"""Request limits of MLflow's scoring server for jaxexp models: body size, concurrency, JSON.

MLflow's server (FastAPI under uvicorn) reads the whole body with ``await request.body()``
before anything looks at it, and parses it with ``json.loads``. For jaxexp models:

* :class:`BodyLimit`, an ASGI middleware installed on the app ``scoring_server.init`` builds,
  answers 413 as soon as ``Content-Length`` or the bytes received so far pass the model's
  ``max_request_bytes``: a chunked 1 GiB body is refused after the first 64 MiB, never
  buffered. It also bounds the bytes of all request bodies in flight together (default 4x the
  limit, ``JAXEXP_MAX_INFLIGHT_BYTES``): a request that would pass it is answered 503 with
  ``Retry-After``, so many concurrent large requests cannot exhaust memory, while small ones
  are never turned away.
* :func:`loads` parses JSON refusing, as a 400, integers of more than ``MAX_INT_DIGITS``
  digits, non-finite numbers (``NaN``, ``Infinity``, ``1e400``) unless the model allows NaN, and
  nesting deeper than Python's recursion limit.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from jaxexp_mlflow.errors import InputError

ENV_MAX_INFLIGHT = "JAXEXP_MAX_INFLIGHT_BYTES"
#: Longer integer literals than any dtype holds (uint64 max has 20 digits) are refused unparsed.
MAX_INT_DIGITS = 40


def loads(text: str | bytes, *, allow_nan: bool, expected: str) -> Any:
    """``json.loads`` with the request rules above; ``InputError`` (400) otherwise."""

    def parse_int(s: str) -> int:
        if len(s.lstrip("-")) > MAX_INT_DIGITS:
            raise InputError(
                f"The request holds an integer of {len(s)} digits: expected at most "
                f"{MAX_INT_DIGITS}, which every input dtype can hold. Inputs: {expected}."
            )
        return int(s)

    def parse_float(s: str) -> float:
        value = float(s)
        if not allow_nan and not math.isfinite(value):
            raise InputError(
                f"The request holds {s[:30]!r}, which is not a finite float: expected finite "
                f"numbers (set allow_nan in the model_config to accept NaN and infinities). "
                f"Inputs: {expected}."
            )
        return value

    def parse_constant(s: str) -> float:
        if not allow_nan:
            raise InputError(
                f"The request holds {s}: expected finite numbers (set allow_nan in the "
                f"model_config to accept NaN and infinities). Inputs: {expected}."
            )
        return float(s)

    try:
        return json.loads(
            text, parse_int=parse_int, parse_float=parse_float, parse_constant=parse_constant
        )
    except RecursionError:
        raise InputError(
            f"The request body nests JSON too deeply: expected arrays as deep as the inputs' "
            f"rank. Inputs: {expected}."
        ) from None
    except json.JSONDecodeError as err:
        raise InputError(
            f"The request body is not valid JSON ({err.msg} at line {err.lineno} column "
            f'{err.colno}). Send a JSON object such as {{"inputs": ...}} with: {expected}.'
        ) from None
    except ValueError as err:  # e.g. int() beyond sys.get_int_max_str_digits
        raise InputError(
            f"The request body holds a value JSON cannot carry here ({str(err)[:100]}). "
            f"Inputs: {expected}."
        ) from None


class _TooLarge(Exception):
    pass


class BodyLimit:
    """ASGI middleware: bound ``/invocations`` bodies while they stream in, and in flight."""

    def __init__(self, app: Any, *, limit: int, inflight: int) -> None:
        self.app = app
        self.limit = int(limit)
        self.inflight = int(inflight)
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


class _Busy(Exception):
    pass


def install_body_limit(server: Any, impl: Any) -> bool:
    """Add :class:`BodyLimit` to the app the scoring server is about to build for ``impl``.

    ``scoring_server/app.py`` runs ``app = init(load_model(...))``: ``init`` is looked up before
    the model (and this guard) loads, so it cannot be wrapped. It builds its app with
    ``fastapi.FastAPI()`` imported at call time: a one-shot subclass adds the middleware to the
    app created by ``scoring_server.init`` (and to no other), then restores ``FastAPI``.
    """
    import sys

    try:
        import fastapi
    except ImportError:
        return False
    original = fastapi.FastAPI
    if getattr(original, "_jaxexp_guard", False):
        return True
    limit = int(impl.max_request_bytes)
    inflight = max(int(os.environ.get(ENV_MAX_INFLIGHT, 4 * limit)), limit)

    class GuardedFastAPI(original):  # type: ignore[misc, valid-type]
        _jaxexp_guard = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            caller = sys._getframe(1)
            if caller.f_globals.get("__name__") == server.__name__:
                fastapi.FastAPI = original
                self.add_middleware(BodyLimit, limit=limit, inflight=inflight)

    fastapi.FastAPI = GuardedFastAPI
    return True
