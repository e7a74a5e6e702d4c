"""Exception types raised by jaxexp-mlflow.

Every error says what was expected, what was found and what to do. They derive from
``MlflowException`` so that MLflow's own tooling (the scoring server in particular) maps them to
the right HTTP status: input errors become 400, the rest 500.

Their ``message`` keeps its own text when a caller rewrites it as a prefix plus that text:
``mlflow models serve`` (``scoring_server.invocations``, MLflow 3.17) sets
``e.message = f"Failed to predict data '{data}'. \nError: {e.message}"`` on any
``MlflowException`` that ``predict`` raises, so a client would get the whole request back (a
38 kB answer to a 500x15 request of the wrong shape). A jaxexp error answers with its own
message, a few hundred characters that never quote the input; the server still chooses the
status from its ``error_code``. Any other rewrite (a shorter text, another text) is taken.
"""

from __future__ import annotations

from typing import Any

from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import (
    INVALID_PARAMETER_VALUE,
    INVALID_STATE,
    RESOURCE_ALREADY_EXISTS,
    RESOURCE_EXHAUSTED,
)

from jaxexp_mlflow.settings import BadEnvVarError


class JaxExpError(MlflowException):
    """Base class of every error this package raises on purpose.

    Args:
        message: what was expected, what was found and what to do.
        **kwargs: passed to ``MlflowException`` (``error_code`` defaults to the class's
            ``default_code``).

    Attributes:
        default_code: the MLflow error code, which sets the HTTP status a scoring server
            answers with (``INVALID_PARAMETER_VALUE``: 400; the others: 500 or their own).
    """

    default_code = INVALID_STATE

    def __init__(self, message: str, **kwargs: Any) -> None:
        kwargs.setdefault("error_code", self.default_code)
        super().__init__(message, **kwargs)

    @property
    def message(self) -> str:
        """The error's text (what clients of a scoring server get as ``message``)."""
        return self._jaxexp_message

    @message.setter
    def message(self, value: str) -> None:
        value = str(value)
        own = getattr(self, "_jaxexp_message", None)
        if own and value != own and value.endswith(own):
            return  # a prefix quoting the request (MLflow's scoring server): keep our own text
        self._jaxexp_message = value


class UnsupportedModelError(JaxExpError):
    """The object passed as ``exported`` cannot be turned into a jaxexp model (HTTP 400)."""

    default_code = INVALID_PARAMETER_VALUE


class ArtifactError(JaxExpError):
    """A stored artifact is missing, truncated, altered or does not match its metadata.

    Raised before anything is allocated or run from a damaged or hostile model directory.
    """


class ParamsMismatchError(JaxExpError):
    """The params (given at save time or found in the checkpoint) do not fit the export (400)."""

    default_code = INVALID_PARAMETER_VALUE


class IncompatibleError(JaxExpError):
    """The model cannot run here: platform, devices, JAX version or custom calls.

    The message names the routes that would run it (see ``jaxexp check``).
    """


class InputError(JaxExpError):
    """A prediction input does not match the model's signature (shape, dtype, names; 400)."""

    default_code = INVALID_PARAMETER_VALUE


class RequestLimitError(JaxExpError):
    """A request would cost more than the server's bounds allow (HTTP 413 in ``jaxexp serve``)."""

    default_code = RESOURCE_EXHAUSTED


class SaveConflictError(JaxExpError):
    """Another save put a model at the target path first; this one was discarded whole."""

    default_code = RESOURCE_ALREADY_EXISTS


class UnsupportedTransformError(JaxExpError):
    """A JAX transformation a loaded model cannot support (forward-mode, vmap, deeper grads).

    HTTP 400 when raised in a server.
    """

    default_code = INVALID_PARAMETER_VALUE


class EnvVarError(JaxExpError, BadEnvVarError):
    """A ``JAXEXP_*`` environment variable holds a value its type cannot take (400).

    Raised by ``jaxexp_mlflow.settings.EnvVar.get``; also a ``ValueError`` (its
    ``settings.BadEnvVarError`` base), with ``name``, ``value`` and ``expected`` set.
    """

    default_code = INVALID_PARAMETER_VALUE

    def __init__(self, message: str, *, name: str, value: str, expected: str) -> None:
        JaxExpError.__init__(self, message)
        self.name = name
        self.value = value
        self.expected = expected
