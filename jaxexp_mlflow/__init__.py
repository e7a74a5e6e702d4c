"""jaxexp-mlflow: an MLflow model flavor for ``jax.export``.

``mlflow.jaxexp`` is installed by MLflow itself through this package's plugin entry point as soon
as ``import mlflow`` runs (see ``mlflow_plugin``); importing this package installs it too when
MLflow is already imported. Nothing heavy (jax, mlflow, orbax) is imported here: the public
names below load their modules on first access.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

__version__ = "0.1.0"

if "mlflow" in sys.modules:
    from jaxexp_mlflow.mlflow_plugin import install_mlflow_module

    install_mlflow_module()

_LAZY = {
    "save_model": "jaxexp_mlflow.flavors.jaxexp",
    "log_model": "jaxexp_mlflow.flavors.jaxexp",
    "load_model": "jaxexp_mlflow.flavors.jaxexp",
    "JaxExpModel": "jaxexp_mlflow.runtime.model",
    "refresh": "jaxexp_mlflow.flavors.refresh",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxexp_mlflow' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
