"""The pyfunc face of a jaxexp model: numpy/pandas in, numpy out, no JAX on the caller's side."""

from __future__ import annotations

from typing import Any

import numpy as np


class JaxExpPyfunc:
    """Wraps a ``JaxExpModel`` for ``mlflow.pyfunc`` (``predict``)."""

    def __init__(self, model: Any, model_config: dict[str, Any] | None = None) -> None:
        self.model = model
        self.model_config = model_config or {}

    def get_raw_model(self) -> Any:
        """The underlying ``JaxExpModel``."""
        return self.model

    def predict(self, data: Any, params: dict[str, Any] | None = None) -> Any:
        """Run the model; a single output comes back as a numpy array."""
        import jax

        if isinstance(data, dict):
            out = self.model(*data.values())
        else:
            out = self.model(np.asarray(data))
        leaves = jax.tree.leaves(out)
        if len(leaves) == 1:
            return np.asarray(leaves[0])
        return {str(i): np.asarray(v) for i, v in enumerate(leaves)}
