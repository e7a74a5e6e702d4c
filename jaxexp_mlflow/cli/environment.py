"""The environment running a model here: JAX's (versions, backend, devices) or IREE's."""

from __future__ import annotations

from typing import Any

from jaxexp_mlflow import settings


def environment(backend: str = "jax") -> dict[str, Any]:
    """The environment running the model here (JAX's, or IREE's for ``backend="iree"``)."""
    if backend == "iree":
        from jaxexp_mlflow.iree.compiler import TARGET, versions
        from jaxexp_mlflow.iree.model import DEFAULT_DRIVER

        v = versions()
        return {
            "jax_version": None,
            "jaxlib_version": None,
            "iree_compiler_version": v["iree-base-compiler"],
            "iree_runtime_version": v["iree-base-runtime"],
            "backend": f"iree/{TARGET}",
            "device_kind": settings.JAXEXP_IREE_DRIVER.get() or DEFAULT_DRIVER,
            "device_count": 1,
        }
    import jax
    import jaxlib

    from jaxexp_mlflow.runtime.platforms import running_platform

    devices = jax.devices()
    return {
        "jax_version": jax.__version__,
        "jaxlib_version": jaxlib.__version__,
        "backend": running_platform(),  # jax.export's name (cuda), not default_backend()'s gpu
        "device_kind": devices[0].device_kind if devices else None,
        "device_count": len(devices),
    }


def environment_line(env: dict[str, Any]) -> str:
    """``jax 0.10.2 / jaxlib 0.10.2 on cpu (1 device: cpu)``."""
    n = env["device_count"]
    if env.get("iree_runtime_version"):
        return f"IREE {env['iree_runtime_version']} on {env['backend']} (no JAX)"
    return (
        f"jax {env['jax_version']} / jaxlib {env['jaxlib_version']} on {env['backend']} "
        f"({n} device{'s' if n != 1 else ''}: {env['device_kind']})"
    )
