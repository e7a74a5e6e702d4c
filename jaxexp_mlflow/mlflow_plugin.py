"""MLflow plugin points: ``mlflow.jaxexp`` without importing jax, and run tags.

MLflow imports every ``mlflow.run_context_provider`` entry point while ``import mlflow`` runs.
This module is that entry point, so an installed jaxexp-mlflow makes ``mlflow.jaxexp`` exist in a
fresh interpreter as a lazy module: the flavor (and jax) load on first use, never at start-up.
The module imports nothing heavy at top level (MLflow may be half-initialised when it loads us).
"""

from __future__ import annotations

import sys

_FLAVOR_MODULE = "jaxexp_mlflow.flavors.jaxexp"


class JaxRunContextProvider:
    """Tags runs with the JAX environment, only when jax is already imported.

    Implements MLflow's ``RunContextProvider`` protocol (``in_context`` and ``tags``); it never
    imports jax itself, so MLflow users without JAX pay nothing.
    """

    def in_context(self) -> bool:
        """Active only in processes that have already imported jax."""
        return "jax" in sys.modules

    def tags(self) -> dict[str, str]:
        """JAX versions, and backend and devices once a backend is running."""
        jax = sys.modules.get("jax")
        if jax is None:
            return {}
        try:
            import jaxlib

            from jaxexp_mlflow.internals.jax_private import backends_initialized

            tags = {
                "jaxexp.jax_version": jax.__version__,
                "jaxexp.jaxlib_version": jaxlib.__version__,
            }
            # never start a backend just to tag a run (on GPU that allocates memory)
            if not backends_initialized():
                return tags
            devices = jax.devices()
            from jax import export as jax_export  # jax < 0.8 does not import it by itself

            platform = getattr(jax_export, "default_export_platform", jax.default_backend)
            return {
                **tags,
                "jaxexp.backend": jax.default_backend(),
                "jaxexp.platform": platform(),  # as jax.export names it: cuda, not gpu
                "jaxexp.device_kind": devices[0].device_kind if devices else "",
                "jaxexp.device_count": str(len(devices)),
            }
        except Exception:  # a tag provider must never break run creation
            return {}


def install_mlflow_module() -> None:
    """Make ``mlflow.jaxexp`` and ``import mlflow.jaxexp`` resolve to the flavor, lazily."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is None or "mlflow.jaxexp" in sys.modules:
        return
    from mlflow.utils.lazy_load import LazyLoader

    lazy = LazyLoader("mlflow.jaxexp", vars(mlflow), _FLAVOR_MODULE)
    mlflow.jaxexp = lazy
    sys.modules["mlflow.jaxexp"] = lazy


try:  # runs when MLflow loads this entry point during ``import mlflow``
    install_mlflow_module()
except Exception:  # pragma: no cover - never break ``import mlflow``
    pass
