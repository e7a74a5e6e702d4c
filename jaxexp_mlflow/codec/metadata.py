"""The ``jaxexp`` section of MLmodel: what an ``Exported`` needs, in plain JSON/YAML values."""

from __future__ import annotations

import importlib.metadata
from typing import Any


def aval_str(aval: Any) -> str:
    """``float32[b,784]``: dtype and shape, symbolic dimensions kept by name."""
    return aval.str_short(short_dtypes=False) if hasattr(aval, "str_short") else str(aval)


def package_version(name: str) -> str | None:
    """Installed version of a distribution, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def sharding_strs(shardings: Any) -> list[str | None]:
    """HLO shardings as strings (None where unspecified)."""
    return [None if s is None else str(s) for s in shardings]


def exported_metadata(
    exported: Any,
    *,
    vjp_order: int,
    exported_file: str,
    exported_sha256: str,
    params_path: str | None,
    n_param_leaves: int,
    exporter_versions: tuple[str | None, str | None],
    serialization_version: int | None,
    custom_call_targets: list[str] | None,
    node_types: list[str],
) -> dict[str, Any]:
    """Build the MLmodel ``jaxexp`` flavor section for a model."""
    from jaxexp_mlflow import __version__

    jax_version, jaxlib_version = exporter_versions
    return {
        "jaxexp_mlflow_version": __version__,
        "jax_version": jax_version,
        "jaxlib_version": jaxlib_version,
        "fun_name": exported.fun_name,
        "platforms": list(exported.platforms),
        "nr_devices": int(exported.nr_devices),
        "vjp_order": int(vjp_order),
        "calling_convention_version": int(exported.calling_convention_version),
        "serialization_version": serialization_version,
        "in_tree": str(exported.in_tree),
        "out_tree": str(exported.out_tree),
        "in_avals": [aval_str(a) for a in exported.in_avals],
        "out_avals": [aval_str(a) for a in exported.out_avals],
        "in_shardings": sharding_strs(exported.in_shardings_hlo),
        "out_shardings": sharding_strs(exported.out_shardings_hlo),
        "custom_call_targets": custom_call_targets,
        "pytree_node_types": node_types,
        "n_param_leaves": int(n_param_leaves),
        "exported_file": exported_file,
        "exported_sha256": exported_sha256,
        "params": params_path,
    }
