"""MLServer runtime for jaxexp models: the stock MLflow runtime, with input errors as HTTP 400.

MLServer answers an exception that is not an ``MLServerError`` with a 500 and a stack trace;
``mlserver_mlflow.MLflowRuntime`` (what KServe / Seldon and the old ``mlflow models serve
--enable-mlserver`` run) lets the model's ``InputError`` through as such. This subclass turns it
into ``MLServerError(message, 400)``: the short message of the input contract, nothing else.
Use it as the ``implementation`` of the model settings::

    {"name": "my-model", "implementation": "jaxexp_mlflow.mlserver_runtime.JaxExpRuntime",
     "parameters": {"uri": "<model dir or URI>"}}

Needs the ``mlserver`` extra (in its own venv: ``scripts/mlserver_env.sh``).
"""

from __future__ import annotations

from typing import Any

from mlserver.errors import MLServerError
from mlserver_mlflow import MLflowRuntime

from jaxexp_mlflow.errors import InputError


class JaxExpRuntime(MLflowRuntime):
    """``MLflowRuntime`` whose input errors are 400s with the contract's short message."""

    async def predict(self, payload: Any) -> Any:
        """Decode the V2 request, run the model, encode the outputs (as ``MLflowRuntime``)."""
        try:
            return await super().predict(payload)
        except InputError as err:
            raise MLServerError(err.message, status_code=400) from None
