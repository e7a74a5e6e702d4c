"""The jaxexp scoring server: MLflow's scoring protocol for a jaxexp model, with request limits.

``jaxexp serve -m <uri>`` runs :func:`build_app` under uvicorn. It speaks the protocol of
``mlflow models serve`` (``GET /ping``, ``/health``, ``/version``; ``POST /invocations`` with the
four JSON formats, CSV or parquet; ``{"predictions": ...}`` answers; errors as MLflow's JSON
``{"error_code", "message"}``; ``MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT`` -> 504), built on public
pieces only: MLflow's ``mlflow.pyfunc.load_model`` loads the model (downloads, ``model_config``,
the jaxexp loader), ``scoring_server.predictions_to_json`` / ``parse_parquet_input`` write and read
what MLflow's server does, and Starlette serves it. On top, for jaxexp models:

* bodies over ``max_request_bytes`` get 413 while they stream in, bytes in flight are bounded
  (503, ``serving_guard.BodyLimit``);
* JSON at the floor of ``json.loads`` + ``np.asarray``: hostile JSON (huge integers, deep
  nesting, invalid UTF-8) is a 400 from what ``json`` raises, non-finite numbers and values out
  of a dtype's range are refused on the converted arrays (``pyfunc.parse_request``);
* CSV is read by the input contract, rows checked for width first (``inputs.read_csv``);
  parquet's footer is checked for the decoded size before a page is read
  (``serving_guard.parquet_frame``, 413);
* a body that does not arrive whole in time is a 408 (``serving_guard.BodyLimit``); a request
  past its deadline is a 504 and its work stops at the next checkpoint, its bytes counted in
  flight until then;
* every client error is a 4xx with a short message that never repeats the payload; a server
  fault is a 500 with one line, the traceback in the server log.

MLflow's own server is not changed in any way (no patch of FastAPI or of MLflow's functions).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import time
from typing import Any

from mlflow.exceptions import MlflowException

from jaxexp_mlflow import settings
from jaxexp_mlflow.errors import InputError, RequestLimitError, UnsupportedModelError
from jaxexp_mlflow.serving import serving_guard
from jaxexp_mlflow.serving.inputs import read_csv
from jaxexp_mlflow.serving.pyfunc import JaxExpPyfunc, impl_for, parse_request, short

_logger = logging.getLogger(__name__)

ENV_MODEL_URI = "JAXEXP_SERVE_MODEL_URI"
ENV_MODEL_CONFIG = "JAXEXP_SERVE_MODEL_CONFIG"
_JSON = "application/json"
_CSV = "text/csv"
_PARQUET = "application/vnd.apache.parquet"


def load(model_uri: str, model_config: dict[str, Any] | None = None) -> tuple[Any, JaxExpPyfunc]:
    """Load ``model_uri`` as MLflow's scoring server does; (``PyFuncModel``, jaxexp pyfunc)."""
    import mlflow.pyfunc

    kwargs = {"model_config": model_config} if model_config else {}
    model = mlflow.pyfunc.load_model(model_uri, **kwargs)
    impl = impl_for(model.metadata)
    if impl is None:
        raise UnsupportedModelError(
            f"{model_uri} is not a jaxexp model (its MLmodel has no 'jaxexp' flavor, or it did "
            "not load through jaxexp-mlflow): expected a model saved by mlflow.jaxexp. Serve "
            "other models with `mlflow models serve`."
        )
    return model, impl


def _error(err: MlflowException, status: int | None = None) -> tuple[str, int, str]:
    err.message = short(err.message)
    return err.serialize_as_json(), status or err.get_http_status_code(), _JSON


def _content_type(header: str) -> tuple[str, str | None]:
    """(mime type, refusal or ``None``) as MLflow's server reads ``Content-Type``."""
    mime, *pairs = [part.strip() for part in header.split(";")]
    params = {k.strip().lower(): v.strip() for k, _, v in (p.partition("=") for p in pairs)}
    if params.get("charset", "utf-8").lower() != "utf-8":
        return mime, "The scoring server only supports UTF-8"
    if set(params) - {"charset"}:
        return mime, f"Unrecognized content type parameters: {', '.join(sorted(params))[:200]}."
    return mime.lower(), None


def invocations(impl: JaxExpPyfunc, body: bytes, content_type: str) -> tuple[str, int, str]:
    """Answer one ``/invocations`` request: (response text, status, media type)."""
    from mlflow.pyfunc.scoring_server import predictions_to_json

    mime, refusal = _content_type(content_type or "")
    if refusal:
        return refusal, 415, "text/plain"
    params = None
    try:
        if mime == _JSON:
            leaves, params = parse_request(impl, body)
            data: Any = dict(zip(impl._names, leaves, strict=True))
        elif mime == _CSV:
            data = read_csv(body, impl.contract)
        elif mime == _PARQUET:
            limit = serving_guard.decoded_limit(impl.max_request_bytes)
            data = serving_guard.parquet_frame(body, limit=limit, expected=impl._expected())
        else:
            return (
                f"This predictor only supports the following content types: expected one of "
                f"{[_JSON, _CSV, _PARQUET]}, found {content_type[:100]!r}.",
                415,
                "text/plain",
            )
        serving_guard.check_deadline()
        raw = impl.predict(data, params)
    except serving_guard.DeadlineExceeded:
        _logger.warning("jaxexp serve: a request stopped at its deadline (answered 504)")
        return "Request processing time exceeded limit", 504, _JSON
    except RequestLimitError as err:
        return _error(err, 413)
    except MlflowException as err:
        return _error(err)
    except Exception as err:  # noqa: BLE001 - a server fault: logged, one line to the client
        _logger.error("jaxexp serve: the request failed", exc_info=err)
        fault = MlflowException(
            f"Internal error while answering the request ({type(err).__name__}); see the "
            f"server log. Inputs: {impl._expected()}."
        )
        return _error(fault, 500)
    out = io.StringIO()
    predictions_to_json(raw, out)
    return out.getvalue(), 200, _JSON


async def _settle(task: Any) -> None:
    """Wait for an abandoned request's work to stop (its result or error is dropped)."""
    with contextlib.suppress(Exception):
        await task


def build_app(
    impl: JaxExpPyfunc, *, inflight: int | None = None, timeout: float | None = None
) -> Any:
    """The Starlette app of ``jaxexp serve`` for one loaded jaxexp model."""
    import mlflow
    from mlflow.environment_variables import MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT
    from starlette.applications import Starlette
    from starlette.background import BackgroundTask
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    limit = int(impl.max_request_bytes)
    if inflight is None:
        inflight = settings.JAXEXP_MAX_INFLIGHT_BYTES.get(4 * limit)
    if timeout is None:
        timeout = float(MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT.get())

    async def ping(request: Request) -> Response:
        return Response("\n", status_code=200, media_type=_JSON)

    async def version(request: Request) -> Response:
        return Response(mlflow.__version__, status_code=200, media_type=_JSON)

    def work(body: bytes, content_type: str, at: float) -> tuple[str, int, str]:
        with serving_guard.deadline(at):
            return invocations(impl, body, content_type)

    async def answer(request: Request) -> Response:
        body = await request.body()  # bounded by BodyLimit while it streams in
        content_type = request.headers.get("content-type", "")
        at = time.monotonic() + timeout
        task = asyncio.ensure_future(asyncio.to_thread(work, body, content_type, at))
        try:
            text, status, media = await asyncio.wait_for(asyncio.shield(task), timeout)
        except TimeoutError:
            # answered now; the work stops at its next checkpoint (serving_guard.deadline), and
            # BodyLimit counts this request's bytes in flight until it has (the background
            # task runs after the response, inside the middleware's call)
            return Response(
                "Request processing time exceeded limit",
                504,
                media_type=_JSON,
                background=BackgroundTask(_settle, task),
            )
        return Response(text, status_code=status, media_type=media)

    routes = [
        Route("/ping", ping, methods=["GET"]),
        Route("/health", ping, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/invocations", answer, methods=["POST"]),
    ]
    guard = Middleware(serving_guard.BodyLimit, limit=limit, inflight=inflight)
    return Starlette(routes=routes, middleware=[guard])


def app_from_env() -> Any:
    """uvicorn's app factory: the model named by ``JAXEXP_SERVE_MODEL_URI`` (one per worker)."""
    import json

    uri = settings.JAXEXP_SERVE_MODEL_URI.get()
    if not uri:
        raise InputError(f"{ENV_MODEL_URI} is not set: expected the URI of the model to serve.")
    config = json.loads(settings.JAXEXP_SERVE_MODEL_CONFIG.get() or "{}")
    _, impl = load(uri, config)
    return build_app(impl)
