"""MLServer runtime for jaxexp models: the stock MLflow runtime, with client errors as HTTP 4xx.

MLServer answers an exception that is not an ``MLServerError`` with a 500 and a stack trace
(file paths of the installation included); ``mlserver_mlflow.MLflowRuntime`` (what KServe /
Seldon and the old ``mlflow models serve --enable-mlserver`` run) lets every error of decoding
or of the model through as such. This subclass splits the request into its three steps and
answers:

* decoding the V2 request into the model's input (MLServer's codecs: a ``shape`` that does not
  match ``data``, integers too large for the ``datatype``, ragged data, a ``content_type`` whose
  codec cannot take the tensors) fails only on what the client sent: **400** with a short
  message (the error's kind and its first line, file paths removed, cut to a few hundred
  characters) and the model's inputs;
* the model refusing the input (``InputError``, or any ``MlflowException`` with a 4xx status):
  that status with the input contract's short message;
* anything else (running the model, encoding the outputs) is a server fault: **500** with a
  one-line message; the traceback goes to the server log only.

Use it as the ``implementation`` of the model settings::

    {"name": "my-model", "implementation": "jaxexp_mlflow.serving.mlserver_runtime.JaxExpRuntime",
     "parameters": {"uri": "<model dir or URI>"}}

Needs the ``mlserver`` extra (in its own venv: ``scripts/mlserver_env.sh``).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from mlflow.exceptions import MlflowException
from mlserver.errors import MLServerError
from mlserver_mlflow import MLflowRuntime

from jaxexp_mlflow.errors import InputError

_logger = logging.getLogger(__name__)

#: Longest message a client gets back.
MAX_MESSAGE = 400
_PATH = re.compile(r"(?:[A-Za-z]:)?[\\/](?:[\w.+@-]+[\\/])+[\w.+@-]*")


def short(text: str, limit: int = MAX_MESSAGE) -> str:
    """``text`` without file paths and tracebacks, on one line, at most ``limit`` characters."""
    text = str(text).split("Traceback (most recent call last)", 1)[0]
    text = " ".join(_PATH.sub("<path>", text).split())
    return text if len(text) <= limit else text[: limit - 4] + " ..."


class JaxExpRuntime(MLflowRuntime):
    """``MLflowRuntime`` whose client errors are 4xx with short messages, server faults 500."""

    def _sync_metadata(self) -> None:
        """MLflowRuntime's hook that reads the model's metadata and the request content type
        off the MLflow signature, given the inputs the signature no longer declares.

        A jaxexp model's MLflow signature declares its outputs only (so that MLflow hands inputs
        over unchanged: docs/serving/pyfunc-rest.md); the stock hook reads ``signature.inputs``
        (``AttributeError`` on ``None``) and chooses the codec from it. Here the inputs come from
        the flavor section (``jaxexp.io``) as named tensor specs, which gives MLServer's
        ``dict`` codec (one tensor per input), as a tensor signature always did.
        """
        from mlflow.models import ModelSignature

        from jaxexp_mlflow.serving.pyfunc import impl_for
        from jaxexp_mlflow.serving.signature import model_signature

        signature = getattr(self, "_signature", None)
        impl = impl_for(getattr(getattr(self, "_model", None), "metadata", None))
        if signature is not None and signature.inputs is None and impl is not None:
            inputs = model_signature(impl.inputs, impl.outputs).inputs
            if inputs is not None:
                params = getattr(signature, "params", None)
                self._signature = ModelSignature(inputs, signature.outputs, params)
        super()._sync_metadata()

    def _expected(self) -> str:
        from jaxexp_mlflow.serving.pyfunc import impl_for

        impl = impl_for(getattr(getattr(self, "_model", None), "metadata", None))
        return f" Inputs: {impl.contract.expected()}." if impl is not None else ""

    async def predict(self, payload: Any) -> Any:
        """Decode the V2 request, run the model, encode the outputs (as ``MLflowRuntime``)."""
        from mlserver_mlflow.codecs import TensorDictCodec

        try:
            decoded = self.decode_request(payload)
        except MLServerError:
            raise
        except Exception as err:  # noqa: BLE001 - decoding fails only on what the client sent
            first = short(str(err).splitlines()[0] if str(err) else "", 200)
            raise MLServerError(
                "The request could not be decoded into the model's inputs. Expected one V2 "
                "tensor per input, the product of its shape equal to the length of its data, "
                "values within its datatype's range, a content_type whose codec takes the "
                f"tensors.{self._expected()} Found: {type(err).__name__}: {first}",
                status_code=400,
            ) from None
        params = None
        if payload.parameters and payload.parameters.model_extra:
            params = payload.parameters.model_extra
        try:
            output = self._model.predict(decoded, params=params)
        except InputError as err:
            raise MLServerError(short(err.message, 1000), status_code=400) from None
        except MlflowException as err:
            status = err.get_http_status_code()
            if 400 <= status < 500:
                raise MLServerError(short(err.message), status_code=status) from None
            raise self._fault("running the model", err) from None
        except Exception as err:  # noqa: BLE001 - a server fault: logged, short to the client
            raise self._fault("running the model", err) from None
        try:
            return self.encode_response(output, default_codec=TensorDictCodec)
        except Exception as err:  # noqa: BLE001
            raise self._fault("encoding the outputs", err) from None

    def _fault(self, step: str, err: Exception) -> MLServerError:
        _logger.error("jaxexp: %s failed", step, exc_info=err)
        return MLServerError(
            f"Internal error while {step} ({type(err).__name__}); see the server log.",
            status_code=500,
        )
