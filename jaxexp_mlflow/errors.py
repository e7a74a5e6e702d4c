"""Exception types raised by jaxexp-mlflow.

Every error says what was expected, what was found and what to do. They derive from
``MlflowException`` so that MLflow's own tooling (the scoring server in particular) maps them to
the right HTTP status: input errors become 400, the rest 500.
"""

from __future__ import annotations

from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import (
    INVALID_PARAMETER_VALUE,
    INVALID_STATE,
    RESOURCE_ALREADY_EXISTS,
)


class JaxExpError(MlflowException):
    """Base class of every error this package raises on purpose."""

    default_code = INVALID_STATE

    def __init__(self, message: str, **kwargs) -> None:
        kwargs.setdefault("error_code", self.default_code)
        super().__init__(message, **kwargs)


class UnsupportedModelError(JaxExpError):
    """The object passed as ``exported`` cannot be turned into a jaxexp model."""

    default_code = INVALID_PARAMETER_VALUE


class ArtifactError(JaxExpError):
    """A stored artifact is missing, truncated, altered or does not match its metadata."""


class ParamsMismatchError(JaxExpError):
    """The params (given at save time or found in the checkpoint) do not fit the export."""

    default_code = INVALID_PARAMETER_VALUE


class IncompatibleError(JaxExpError):
    """The model cannot run here: platform, devices, JAX version or custom calls."""


class InputError(JaxExpError):
    """A prediction input does not match the model's signature (shape, dtype, names)."""

    default_code = INVALID_PARAMETER_VALUE


class SaveConflictError(JaxExpError):
    """Another save put a model at the target path first; this one was discarded whole."""

    default_code = RESOURCE_ALREADY_EXISTS


class UnsupportedTransformError(JaxExpError):
    """A JAX transformation a loaded model cannot support (forward-mode, vmap, deeper grads)."""

    default_code = INVALID_PARAMETER_VALUE
