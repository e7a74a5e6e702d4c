"""Where a model runs: platform choice, device mesh and the shardings of params and inputs.

``plan(exported, ...)`` decides, before anything is compiled:

* the platform: the running backend if the export has a lowering for it, else another platform
  available here that it has (CPU on an accelerator host); with ``allow_other_platform=True``
  the running backend anyway, with JAX's platform check disabled
  (``DisabledSafetyCheck.platform()``);
* the devices: for ``nr_devices > 1`` a mesh of that many devices shaped like the export's own
  (its ``NamedSharding`` meshes, or one axis for blobs with HLO shardings), and one sharding per
  flat input (``Exported.in_shardings_jax``) so that params are restored straight into them and
  inputs placed likewise; fewer devices than needed is an ``IncompatibleError`` giving both
  counts;
* for 1-device exports with ``data_parallel=True``: the batch (leading dimension) of every input
  sharded over all local devices and params replicated; JAX partitions a module without sharding
  annotations over such inputs.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

_logger = logging.getLogger(__name__)

#: Mesh axis name used for blobs whose shardings carry no mesh (HLO shardings) and for data
#: parallelism.
AXIS = "jaxexp"
BATCH_AXIS = "batch"


@dataclass(frozen=True)
class Placement:
    """How to run an ``Exported`` here: platform, mesh and one sharding per flat input.

    ``in_shardings`` has one entry per exported in_aval (params first), ``None`` where JAX may
    choose. With ``data_parallel`` the inputs after the params are placed per call: batch-sharded
    over ``mesh`` when their leading dimension divides evenly, else replicated.
    """

    platform: str
    mesh: Any  # jax.sharding.Mesh | None
    in_shardings: tuple[Any, ...]  # jax Sharding or None, one per exported in_aval
    exported: Any  # the Exported to call (may carry extra disabled safety checks)
    data_parallel: bool = False
    out_shardings: tuple[Any, ...] = ()

    @property
    def n_devices(self) -> int:
        """Number of devices the model runs on."""
        return 1 if self.mesh is None else int(self.mesh.devices.size)

    def batch_sharding(self) -> Any:
        """Sharding of a batch-major input under data parallelism (None otherwise)."""
        if not self.data_parallel:
            return None
        from jax.sharding import NamedSharding, PartitionSpec

        return NamedSharding(self.mesh, PartitionSpec(BATCH_AXIS))

    def replicated(self) -> Any:
        """Fully replicated sharding over the mesh (None without a mesh)."""
        if self.mesh is None:
            return None
        from jax.sharding import NamedSharding, PartitionSpec

        return NamedSharding(self.mesh, PartitionSpec())

    def place_inputs(self, leaves: list[Any], n_params: int) -> list[Any]:
        """Put flat input leaves (params excluded) where the export expects them."""
        import jax

        if self.data_parallel:
            n = self.n_devices
            batch, repl = self.batch_sharding(), self.replicated()
            out = []
            for leaf in leaves:
                shape = getattr(leaf, "shape", ())
                sharding = batch if len(shape) >= 1 and shape[0] % n == 0 else repl
                out.append(jax.device_put(leaf, sharding))
            return out
        shardings = self.in_shardings[n_params:]
        if not any(s is not None for s in shardings):
            return leaves
        return [
            leaf if s is None else jax.device_put(leaf, s)
            for leaf, s in zip(leaves, shardings, strict=False)
        ]


def _mesh_for(exported: Any, devices: list[Any]) -> Any:
    import numpy as np
    from jax.sharding import Mesh

    from jaxexp_mlflow.internals.jax_private import named_shardings

    named = named_shardings(exported, "in") or ()
    for s in (*named, *(named_shardings(exported, "out") or ())):
        mesh = getattr(s, "mesh", None)
        if mesh is not None and getattr(mesh, "axis_sizes", None):
            return Mesh(np.array(devices).reshape(mesh.axis_sizes), mesh.axis_names)
    return Mesh(np.array(devices), (AXIS,))


def choose_platform(
    exported_platforms: tuple[str, ...] | list[str], *, allow_other_platform: bool = False
) -> tuple[str, bool]:
    """(platform to run on, whether JAX's platform check must be disabled).

    Names are ``jax.export``'s (``cuda``, ``rocm``, ``tpu``, ``cpu``; ``runtime.platforms``): a
    model exported for ``("cpu", "cuda")`` runs on the GPU of a CUDA host; one exported for
    ``cpu`` only runs on that host's CPU, and the process is told so once.
    """
    from jaxexp_mlflow.runtime import platforms as names

    running = names.running_platform()
    platforms = [str(p) for p in exported_platforms]
    if running in platforms:
        return running, False
    for other in names.available_platforms()[1:]:
        if other in platforms:
            names.say_once(tuple(platforms), other, running)
            return other, False
    if allow_other_platform:
        _logger.warning(
            "jaxexp: the model was exported for %s; running it on %r anyway "
            "(allow_other_platform=True disables JAX's platform check)",
            platforms,
            running,
        )
        return running, True
    from jaxexp_mlflow.errors import IncompatibleError

    raise IncompatibleError(
        f"The model was exported for platforms {platforms}, but this machine runs JAX on "
        f"{running!r}. Run it where one of those platforms is available, re-export it for "
        f"{running!r} too (save_model(..., platforms=[..., {running!r}])), or pass "
        "allow_other_platform=True to try anyway."
    )


def _without_platform_check(exported: Any) -> Any:
    from jax.export import DisabledSafetyCheck

    check = DisabledSafetyCheck.platform()
    if check in tuple(exported.disabled_safety_checks):
        return exported
    return dataclasses.replace(
        exported, disabled_safety_checks=(*exported.disabled_safety_checks, check)
    )


def plan(
    exported: Any,
    *,
    allow_other_platform: bool = False,
    data_parallel: bool = False,
    devices: list[Any] | None = None,
) -> Placement:
    """Pick the platform and devices for ``exported`` or explain why it cannot run here.

    ``allow_other_platform`` runs on the current backend even if the export has no lowering for
    it; ``data_parallel`` shards the batch of a 1-device export over all local devices;
    ``devices`` overrides the devices to use (default: all of the chosen platform).
    """
    from jaxexp_mlflow.runtime import platforms as names

    platform, disable = choose_platform(
        exported.platforms, allow_other_platform=allow_other_platform
    )
    if disable:
        exported = _without_platform_check(exported)
    devs = list(devices) if devices is not None else names.devices(platform)
    n = int(exported.nr_devices)
    n_in = len(exported.in_avals)
    if n == 1:
        if data_parallel and len(devs) > 1:
            return _data_parallel(exported, platform, devs)
        if data_parallel:
            _logger.info("jaxexp: data_parallel=True but only one %s device is visible", platform)
        if platform != names.running_platform() or devices is not None:
            from jax.sharding import SingleDeviceSharding

            one = SingleDeviceSharding(devs[0])
            return Placement(platform, None, (one,) * n_in, exported)
        return Placement(platform, None, (None,) * n_in, exported)
    if data_parallel:
        _logger.info("jaxexp: data_parallel ignored: the model is already sharded over %d", n)
    if len(devs) < n:
        how = (
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before JAX starts"
            if platform == "cpu"
            else f"a machine or slice with {n} {platform} devices"
        )
        from jaxexp_mlflow.errors import IncompatibleError

        raise IncompatibleError(
            f"The model was exported for {n} devices, but only {len(devs)} {platform} "
            f"device(s) are visible. Expose {n} devices ({how})."
        )
    mesh = _mesh_for(exported, devs[:n])
    in_shardings, out_shardings = _shardings(exported, mesh, devs[:n])
    return Placement(platform, mesh, in_shardings, exported, out_shardings=out_shardings)


def _shardings(exported: Any, mesh: Any, devs: list[Any]) -> tuple[tuple, tuple]:
    """One sharding per flat input and output, on ``devs``.

    Most exports use one mesh: ``Exported.in_shardings_jax(mesh)`` builds them. An export whose
    ``NamedSharding``s use several meshes (JAX's ``export_with_multiple_meshes``: inputs on mesh
    ``('x1', 'x2')``, weights on ``('y2', 'y1')``) makes that raise; then each abstract mesh is
    made concrete on the same devices, axis names and sizes kept.
    """
    try:
        return tuple(exported.in_shardings_jax(mesh)), tuple(exported.out_shardings_jax(mesh))
    except ValueError as err:
        from jaxexp_mlflow.internals.jax_private import named_shardings

        named_in = named_shardings(exported, "in")
        named_out = named_shardings(exported, "out")
        if named_in is None or named_out is None:
            from jaxexp_mlflow.errors import IncompatibleError

            raise IncompatibleError(
                f"Cannot place the model's inputs on {len(devs)} devices: expected shardings "
                f"over one device mesh, found {err}. Export the function again with all "
                "shardings on one mesh."
            ) from err
    meshes: dict[tuple, Any] = {}
    ins = tuple(_on_devices(s, devs, meshes) for s in named_in)
    outs = tuple(_on_devices(s, devs, meshes) for s in named_out)
    return ins, outs


def _on_devices(sharding: Any, devs: list[Any], meshes: dict[tuple, Any]) -> Any:
    """The concrete ``NamedSharding`` of an exported (abstract-mesh) one; None stays None."""
    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    abstract = getattr(sharding, "mesh", None)
    if abstract is None or not getattr(abstract, "axis_sizes", None):
        return None  # unspecified: JAX places it
    key = (tuple(abstract.axis_names), tuple(abstract.axis_sizes))
    if key not in meshes:
        grid = np.array(devs[: int(np.prod(abstract.axis_sizes))]).reshape(abstract.axis_sizes)
        types = getattr(abstract, "axis_types", None)
        try:
            meshes[key] = Mesh(grid, abstract.axis_names, axis_types=types)
        except TypeError:  # a jax whose Mesh takes no axis_types
            meshes[key] = Mesh(grid, abstract.axis_names)
    memory_kind = getattr(sharding, "memory_kind", None)
    return NamedSharding(meshes[key], sharding.spec, memory_kind=memory_kind)


def _data_parallel(exported: Any, platform: str, devs: list[Any]) -> Placement:
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxexp_mlflow.internals.jax_private import shardings

    given = shardings(exported, "in")  # named (jax >= 0.8) or HLO: in_shardings_hlo is all None
    if any(s is not None for s in given):
        from jaxexp_mlflow.errors import IncompatibleError

        raise IncompatibleError(
            "data_parallel=True needs a 1-device export without sharding annotations, but this "
            f"one has input shardings {list(map(str, given))}. Load it without data_parallel."
        )
    mesh = Mesh(np.array(devs), (BATCH_AXIS,))
    repl = NamedSharding(mesh, PartitionSpec())
    n_in = len(exported.in_avals)
    return Placement(platform, mesh, (repl,) * n_in, exported, data_parallel=True)
