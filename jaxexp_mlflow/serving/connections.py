"""Connection limits of ``jaxexp serve``: how many sockets it holds, how long one may wait.

uvicorn holds every accepted socket until its client closes it: a connection that never sends
a request (or sends half its headers, a byte at a time) costs a file descriptor for ever, and
enough of them (about a thousand, the usual descriptor limit) leave the server unable to accept
anyone. uvicorn has no timeout before a request's headers are whole, and its
``limit_concurrency`` counts idle sockets too (answering 503 to every request beyond it).

``serving/guarded_h11.GuardedH11Protocol`` is uvicorn's h11 protocol with two bounds, read
from the environment the CLI sets (``jaxexp serve --max-connections/--header-timeout``); this
module holds their names and defaults, importable without uvicorn:

* ``JAXEXP_HEADER_TIMEOUT_S`` (default 10): a connection whose request headers are not whole
  within this time of its opening, or of the previous answer on it, is answered 408 and
  closed. The body then has ``JAXEXP_BODY_TIMEOUT_S`` (``serving_guard.BodyLimit``).
* ``JAXEXP_MAX_CONNECTIONS`` (default 256): the sockets held at once. A new connection that
  would reach the limit closes the oldest connection still waiting for its request headers,
  so idle sockets cannot crowd out a client that sends its request; past the limit with no
  such connection, uvicorn's ``limit_concurrency`` (set to the same number) answers 503.
"""

from __future__ import annotations

from jaxexp_mlflow import settings

ENV_MAX_CONNECTIONS = "JAXEXP_MAX_CONNECTIONS"
ENV_HEADER_TIMEOUT = "JAXEXP_HEADER_TIMEOUT_S"
DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_HEADER_TIMEOUT_S = 10.0


def max_connections() -> int:
    """Sockets one server process holds at once (``JAXEXP_MAX_CONNECTIONS``, at least 2)."""
    return max(2, settings.JAXEXP_MAX_CONNECTIONS.get(DEFAULT_MAX_CONNECTIONS))


def header_timeout() -> float:
    """Seconds a connection may take to send whole request headers (``JAXEXP_HEADER_TIMEOUT_S``)."""
    return settings.JAXEXP_HEADER_TIMEOUT_S.get(DEFAULT_HEADER_TIMEOUT_S)
