"""Where a model runs: platform choice, device mesh and the shardings of params and inputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxexp_mlflow.errors import IncompatibleError


@dataclass(frozen=True)
class Placement:
    """How to run an ``Exported`` here: platform, mesh and one sharding per flat input."""

    platform: str
    mesh: Any  # jax.sharding.Mesh | None
    in_shardings: tuple[Any, ...]  # jax Sharding or None, one per exported in_aval
    exported: Any  # the Exported to call (may carry extra disabled safety checks)


def _mesh_for(exported: Any, devices: list[Any]) -> Any:
    import numpy as np
    from jax.sharding import Mesh

    named = getattr(exported, "_in_named_shardings", None) or ()
    for s in (*named, *(getattr(exported, "_out_named_shardings", None) or ())):
        if s is not None:
            am = s.mesh
            return Mesh(np.array(devices).reshape(am.axis_sizes), am.axis_names)
    return Mesh(np.array(devices), ("jaxexp",))


def plan(exported: Any) -> Placement:
    """Pick the platform and devices for ``exported`` or explain why it cannot run here."""
    import jax

    platform = jax.default_backend()
    if platform not in exported.platforms:
        raise IncompatibleError(
            f"The model was exported for platforms {list(exported.platforms)}, but this "
            f"machine runs JAX on {platform!r}. Run it where one of those platforms is available, "
            "or refresh/re-export it for this one."
        )
    n = exported.nr_devices
    devices = jax.devices()
    if n == 1:
        return Placement(platform, None, (None,) * len(exported.in_avals), exported)
    if len(devices) < n:
        raise IncompatibleError(
            f"The model was exported for {n} devices, but only {len(devices)} {platform} "
            f"device(s) are visible. Run it on a machine with {n} devices (on CPU: "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n})."
        )
    mesh = _mesh_for(exported, devices[:n])
    return Placement(platform, mesh, tuple(exported.in_shardings_jax(mesh)), exported)
