"""``jaxexp serve``: MLflow's scoring protocol for a jaxexp model, with request limits."""

from __future__ import annotations

import json
import os

import click

from jaxexp_mlflow import settings
from jaxexp_mlflow.cli._common import Command
from jaxexp_mlflow.serving.connections import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    ENV_HEADER_TIMEOUT,
    ENV_MAX_CONNECTIONS,
)


@click.command(
    cls=Command,
    epilog="""\b
Examples:
  jaxexp serve -m runs:/0f3c.../model -p 5000
  jaxexp serve -m models:/classifier@best --workers 2 --model-config '{"buckets": "off"}'
\b
Answers as `mlflow models serve` does (/ping, /health, /version, /invocations with the JSON
formats inputs, instances, dataframe_split, dataframe_records, CSV and parquet), plus: 413 for
bodies over max_request_bytes while they stream in and for parquet that would decode past
JAXEXP_MAX_DECODED_BYTES, 408 for bodies not whole within JAXEXP_BODY_TIMEOUT_S and headers
not whole within --header-timeout, 503 when the bodies in flight pass JAXEXP_MAX_INFLIGHT_BYTES
or the sockets --max-connections (idle sockets are closed first), 504 past the request timeout
(the work stops), 400 for hostile JSON and inputs the contract refuses
(docs/serving/pyfunc-rest.md). The model loads through mlflow.pyfunc.load_model; no environment is
created (like --env-manager local).
""",
)
@click.option("-m", "--model-uri", required=True, help="The model: any URI MLflow understands.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("-p", "--port", default=5000, show_default=True, type=int, help="Port.")
@click.option("-w", "--workers", default=1, show_default=True, type=int, help="Processes.")
@click.option(
    "--model-config", default=None, help="JSON object passed as model_config to the loader."
)
@click.option(
    "--max-connections",
    type=click.IntRange(min=2),
    default=DEFAULT_MAX_CONNECTIONS,
    show_default=True,
    envvar=ENV_MAX_CONNECTIONS,
    help="Sockets each worker holds at once; a new one closes the oldest idle one, else 503.",
)
@click.option(
    "--header-timeout",
    type=click.FloatRange(min=0.1),
    default=DEFAULT_HEADER_TIMEOUT_S,
    show_default=True,
    envvar=ENV_HEADER_TIMEOUT,
    help="Seconds a connection may take to send whole request headers (then 408, closed).",
)
@click.option(
    "--route",
    type=click.Choice(("direct", "expired-flag", "remesh")),
    default=None,
    help="Load the model by this route (as model_config's route): remesh for a model exported "
    "for more devices than are here (see `jaxexp check`).",
)
@click.option("--debug", is_flag=True, help="Show tracebacks of load errors.")
def serve(
    model_uri: str,
    host: str,
    port: int,
    workers: int,
    model_config: str | None,
    max_connections: int,
    header_timeout: float,
    route: str | None,
    debug: bool,
) -> None:
    """Serve a jaxexp model over HTTP (MLflow's scoring protocol, with request limits)."""
    import uvicorn

    from jaxexp_mlflow.runtime import buckets

    try:
        config = json.loads(model_config) if model_config else {}
    except json.JSONDecodeError as err:
        raise click.BadParameter(
            f"expected a JSON object, found text that is not JSON ({err.msg} at character "
            f"{err.pos})",
            param_hint="--model-config",
        ) from None
    if not isinstance(config, dict):
        raise click.BadParameter(
            f"expected a JSON object, found a JSON {type(config).__name__}",
            param_hint="--model-config",
        )
    if route is not None:
        if config.get("route", route) != route:
            raise click.BadParameter(
                f"expected one route, found --route {route} and model_config route "
                f"{config['route']!r}",
                param_hint="--route",
            )
        config["route"] = route
    from jaxexp_mlflow.serving.model_config import PYFUNC_CONFIG_KEYS

    unknown = sorted(set(config) - set(PYFUNC_CONFIG_KEYS))
    if unknown:  # MLflow would drop them with a warning: a typo would go unnoticed
        raise click.BadParameter(
            f"expected keys among {', '.join(PYFUNC_CONFIG_KEYS)}, found "
            f"{', '.join(map(repr, unknown))[:200]}",
            param_hint="--model-config",
        )
    try:  # the bucket settings, before the model loads
        buckets.resolve(config, serving=True)
    except (TypeError, ValueError) as err:
        raise click.BadParameter(str(err), param_hint="--model-config") from None
    _check_port_free(host, port)
    # imported once the command is sure to serve: importing it marks this process a scoring
    # server (serving.pyfunc.in_scoring_server)
    from jaxexp_mlflow.serving import server
    from jaxexp_mlflow.serving.guarded_h11 import GuardedH11Protocol

    os.environ[settings.JAXEXP_SERVE_MODEL_URI.name] = model_uri
    os.environ[settings.JAXEXP_SERVE_MODEL_CONFIG.name] = json.dumps(config)
    # read by each worker's connections (serving/connections.py)
    os.environ[settings.JAXEXP_MAX_CONNECTIONS.name] = str(max_connections)
    os.environ[settings.JAXEXP_HEADER_TIMEOUT_S.name] = str(header_timeout)
    limits = {
        "http": GuardedH11Protocol,
        "limit_concurrency": max_connections,
        "timeout_keep_alive": min(5, max(1, int(header_timeout))),
    }
    if workers > 1:  # each worker process loads the model through the factory
        uvicorn.run(
            f"{server.__name__}:app_from_env",
            factory=True,
            host=host,
            port=port,
            workers=workers,
            **limits,
        )
        return
    _, impl = server.load(model_uri, config)  # load errors exit with the CLI's codes
    uvicorn.run(server.build_app(impl), host=host, port=port, **limits)


def _check_port_free(host: str, port: int) -> None:
    """Refuse a port another process listens on before loading the model (uvicorn would only
    find out after the load, and exit with its own code)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise click.BadParameter(
            f"expected an address to listen on, found {host!r} ({err.strerror})",
            param_hint="--host",
        ) from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as err:
            raise click.BadParameter(
                f"expected a free port, found {host}:{port} in use or not available "
                f"({err.strerror}); pick another with -p",
                param_hint="--port",
            ) from None
