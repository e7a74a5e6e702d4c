"""The engines a model can run on: JAX (``runtime/``) or IREE without JAX (``iree/``).

``load_model(..., backend=)`` and the pyfunc ``model_config`` key ``backend`` (or
``$JAXEXP_BACKEND``) pick one; the name is checked here.
"""

from __future__ import annotations

from typing import Any

from jaxexp_mlflow import settings

#: Backends ``load_model``/pyfunc can run a model on: JAX, or IREE without importing JAX
#: (``pip install 'jaxexp-mlflow[iree]'``, see docs/longevity.md).
BACKENDS = ("jax", "iree")
#: Environment variable choosing the pyfunc backend when ``model_config`` does not.
ENV_BACKEND = "JAXEXP_BACKEND"


def _check_backend(backend: Any) -> str:
    name = str(backend or "jax").lower()
    if name not in BACKENDS:
        from jaxexp_mlflow.errors import UnsupportedModelError

        raise UnsupportedModelError(
            f"backend={backend!r} is not supported: expected one of {list(BACKENDS)}."
        )
    return name


def backend_of(config: dict[str, Any], flavor_conf: dict[str, Any]) -> str:
    """The engine a pyfunc load runs on: ``model_config``'s ``backend``, else
    ``$JAXEXP_BACKEND``, else the saved serving config's, else JAX."""
    saved = flavor_conf.get("serving") or {}
    return _check_backend(config.get("backend", settings.JAXEXP_BACKEND.get(saved.get("backend"))))
