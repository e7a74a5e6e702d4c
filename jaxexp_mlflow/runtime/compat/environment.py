"""What runs here: the :class:`Environment` a verdict is made against (versions, platforms,
devices, the blob schema and calling conventions read, the registered custom calls),
taken from the running jax or overridden field by field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jaxexp_mlflow.runtime.compat.releases import iso_date, release_date

EXPIRED_FLAG = "jax_export_deserialize_expired_versions"


EXPIRED_ENV = EXPIRED_FLAG.upper()


@dataclass(frozen=True)
class Environment:
    """What the verdict needs to know about where the model would run.

    Every field may be ``None`` (unknown), in which case the checks that need it are skipped.
    """

    jax_version: str | None = None
    jaxlib_version: str | None = None
    platform: str | None = None
    available_platforms: tuple[str, ...] = ()
    device_count: int | None = None
    calling_convention_range: tuple[int, int] | None = None
    max_schema: int | None = None
    enforces_window: bool | None = None
    reads_expired: bool | None = None
    custom_call_targets: frozenset[str] | None = None
    stablehlo_version: str | None = None

    @classmethod
    def current(cls) -> Environment:
        """Snapshot of the running jax: versions, backend, devices, registered custom calls.

        Initializes the default backend (needed anyway to run the model); compiles nothing.
        """
        import jax
        from jax import export as jax_export

        from jaxexp_mlflow.internals.jax_private import stablehlo_version
        from jaxexp_mlflow.runtime import platforms as names
        from jaxexp_mlflow.store.section import package_version

        available = names.available_platforms()
        platform = available[0]  # as jax.export names it: cuda, not jax.default_backend()'s gpu
        devices = jax.devices()
        return cls(
            jax_version=jax.__version__,
            jaxlib_version=package_version("jaxlib"),
            platform=platform,
            available_platforms=tuple(available),
            device_count=len(devices),
            calling_convention_range=(
                int(jax_export.minimum_supported_calling_convention_version),
                int(jax_export.maximum_supported_calling_convention_version),
            ),
            max_schema=_running_schema(),
            enforces_window=hasattr(jax.config, EXPIRED_FLAG),
            reads_expired=bool(getattr(jax.config, EXPIRED_FLAG, False)),
            # every platform a model may run on here: a cpu-only export on a CUDA host calls
            # the LAPACK kernels registered for the host, not CUDA's
            custom_call_targets=_union(registered_custom_call_targets(p) for p in available),
            stablehlo_version=stablehlo_version(),
        )

    def replace(self, **changes: Any) -> Environment:
        """A copy with ``changes`` applied (used to judge against another environment).

        Platform names are taken as ``jax.export`` names them (``gpu`` becomes ``cuda``)."""
        from jaxexp_mlflow.runtime.platforms import canonical

        if changes.get("platform"):
            changes["platform"] = canonical(changes["platform"])
        if changes.get("available_platforms"):
            changes["available_platforms"] = [canonical(p) for p in changes["available_platforms"]]
        if "custom_call_targets" in changes and changes["custom_call_targets"] is not None:
            changes["custom_call_targets"] = frozenset(changes["custom_call_targets"])
        for key in ("available_platforms",):
            if key in changes and changes[key] is not None:
                changes[key] = tuple(changes[key])
        if "calling_convention_range" in changes and changes["calling_convention_range"]:
            changes["calling_convention_range"] = tuple(changes["calling_convention_range"])
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (custom-call targets as a count: the list is long)."""
        d = dataclasses.asdict(self)
        d["available_platforms"] = list(self.available_platforms)
        if self.calling_convention_range is not None:
            d["calling_convention_range"] = list(self.calling_convention_range)
        targets = self.custom_call_targets
        d["custom_call_targets"] = None if targets is None else len(targets)
        d["jaxlib_build_date"] = iso_date(release_date(self.jaxlib_version))
        return d


def _union(sets: Any) -> frozenset[str] | None:
    """The union of the registries read (None when none could be read)."""
    read = [s for s in sets if s is not None]
    return frozenset().union(*read) if read else None


def _running_schema() -> int | None:
    from jaxexp_mlflow.internals.jax_private import serialization_schema

    return serialization_schema()


def registered_custom_call_targets(platform: str) -> frozenset[str] | None:
    """Custom-call targets the running jaxlib registers for ``platform`` (no compilation).

    Reads jaxlib's own registry (``xla_client.custom_call_targets``) after backend start-up,
    which is when jaxlib registers its kernels (LAPACK on CPU, cuSOLVER on GPU, ...). Returns
    ``None`` if this jaxlib offers no way to list them.
    """
    from jaxexp_mlflow.internals.jax_private import custom_call_lister

    lister = custom_call_lister()
    if lister is None:
        return None
    names: set[str] = set()
    xla_names = {"cpu": ("cpu", "Host"), "cuda": ("CUDA", "cuda"), "rocm": ("ROCM", "rocm")}
    for name in xla_names.get(platform, (platform,)):
        try:
            names.update(lister(name))
        except Exception:  # unknown platform name for this registry
            continue
    return frozenset(names)


def coerce_environment(env: Environment | Mapping[str, Any] | None) -> Environment:
    """The environment to judge against: the running one for ``None``, an :class:`Environment`
    as given, or the running one with a mapping's fields overridden."""
    if env is None:
        return Environment.current()
    if isinstance(env, Environment):
        return env
    return Environment.current().replace(**dict(env))
