"""Platform names as ``jax.export`` names them: ``cpu``, ``cuda``, ``rocm``, ``tpu``.

JAX has two vocabularies. ``jax.default_backend()`` and ``Device.platform`` say ``gpu`` on an
NVIDIA or AMD host; ``jax.export`` lowers for, and ``Exported.platforms`` records, ``cuda`` or
``rocm``. Every comparison with an export's platforms (the verdict, the placement, save-time
reference outputs, advice texts) goes through :func:`running_platform`, never through
``jax.default_backend()``. The mapping is JAX's own public
``jax.export.default_export_platform()``; a jax without it falls back on the backend's
``platform_version`` (which names CUDA or ROCm).
"""

from __future__ import annotations

import logging
from typing import Any

_logger = logging.getLogger(__name__)

#: ``jax.default_backend()`` names that stand for several lowering platforms.
GPU_ALIASES = {"gpu": ("cuda", "rocm")}


def canonical(name: str, *, version: str = "") -> str:
    """The lowering platform for a backend name (``gpu`` -> ``cuda`` or ``rocm``)."""
    name = str(name).lower()
    if name not in GPU_ALIASES:
        return name
    return "rocm" if "rocm" in version.lower() or "hip" in version.lower() else "cuda"


def running_platform() -> str:
    """The platform JAX runs on by default here, as ``jax.export`` names it."""
    import jax
    from jax import export as jax_export

    public = getattr(jax_export, "default_export_platform", None)
    if public is not None:
        try:
            return str(public())
        except RuntimeError:  # pragma: no cover - a backend that JAX cannot canonicalize
            pass
    backend = jax.default_backend()
    version = ""
    try:
        version = str(getattr(jax.devices()[0].client, "platform_version", ""))
    except Exception:  # pragma: no cover - no client attribute on this jax
        pass
    return canonical(backend, version=version)


def available_platforms() -> tuple[str, ...]:
    """Lowering platforms that have devices here: the running one first, then ``cpu``."""
    import jax

    here = [running_platform()]
    if here[0] != "cpu":
        try:
            if jax.devices("cpu"):
                here.append("cpu")
        except RuntimeError:
            pass
    return tuple(here)


def devices(platform: str) -> list[Any]:
    """The devices of a lowering platform (``cuda``, ``rocm``, ``cpu``, ``tpu``)."""
    import jax

    return list(jax.devices(platform))  # JAX takes the lowering names as backend names


_SAID: set[tuple[tuple[str, ...], str]] = set()


def say_once(exported_platforms: tuple[str, ...], chosen: str, running: str) -> None:
    """Log, once per process and pair, that a model runs on another platform than the default."""
    key = (tuple(exported_platforms), chosen)
    if key in _SAID:
        return
    _SAID.add(key)
    _logger.warning(
        "jaxexp: the model was exported for %s, without %r: it runs on this host's %s devices, "
        "not on %s. Re-export it with platforms=(..., %r) to run it there.",
        list(exported_platforms),
        running,
        chosen,
        running,
        running,
    )
