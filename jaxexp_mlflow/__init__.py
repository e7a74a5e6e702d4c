"""jaxexp-mlflow: an MLflow model flavor for ``jax.export``.

Importing this package makes ``mlflow.jaxexp`` available. It imports neither jax nor the flavor
module itself: both load on first attribute access, so ``import jaxexp_mlflow`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

from jaxexp_mlflow.mlflow_plugin import install_mlflow_module  # noqa: E402

install_mlflow_module()

_LAZY = {
    "save_model": "jaxexp_mlflow.flavors.jaxexp",
    "log_model": "jaxexp_mlflow.flavors.jaxexp",
    "load_model": "jaxexp_mlflow.flavors.jaxexp",
    "JaxExpModel": "jaxexp_mlflow.runtime.model",
    "refresh": "jaxexp_mlflow.refresh",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxexp_mlflow' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
