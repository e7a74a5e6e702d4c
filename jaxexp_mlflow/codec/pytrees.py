"""Serialization of custom pytree nodes (Flax ``FrozenDict``, ``nnx.State``, ``nnx.Variable``).

Only a given ``Exported`` (or blob) whose arguments hold such nodes needs this: a function
saved with ``params=`` is exported against a plain dict of named arrays (``params.names``).
``Exported.serialize`` refuses custom pytree nodes unless they are registered with
``jax.export.register_pytree_node_serialization``, on the saving *and* the loading side. Users
logging a Flax model expect that to just work, so we register the node types of an allowlisted
set of modules (Flax) with a JSON codec for their auxiliary data, and record their names in the
MLmodel so the loader can register them again before deserializing.
"""

from __future__ import annotations

import importlib
import json
import re
from typing import Any

import jax
import jax.export  # jax < 0.8 does not import the submodule by itself

from jaxexp_mlflow.codec.mlmodel import check_node_type_names
from jaxexp_mlflow.errors import ArtifactError, UnsupportedModelError

# Modules whose pytree node types we register automatically (their aux data is JSON-able).
AUTO_REGISTER_PREFIXES = ("flax.",)

_registered: set[str] = set()

#: A name ``register_for_load`` imports: a dotted path of identifiers under an allowlisted prefix.
_IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")


def _to_json(aux: Any) -> bytes:
    return json.dumps(aux).encode()


def _from_json(data: bytes) -> Any:
    def tuplify(x: Any) -> Any:
        return tuple(tuplify(v) for v in x) if isinstance(x, list) else x

    return tuplify(json.loads(data.decode()))


def node_type_name(cls: type) -> str:
    """The name under which a node type is serialized: its qualified import path."""
    return f"{cls.__module__}.{cls.__qualname__}"


def custom_node_types(treedef: Any) -> dict[str, type]:
    """Collect the custom (non built-in) node types of a treedef, by serialized name."""
    found: dict[str, type] = {}
    builtin = (tuple, list, dict, type(None))

    def walk(td: Any) -> None:
        if td.num_nodes == 1 and td.num_leaves in (0, 1) and not td.children():
            data = td.node_data()
            if data is None:
                return
        data = td.node_data()
        if data is not None:
            cls = data[0]
            if cls not in builtin and not _is_namedtuple(cls):
                found[node_type_name(cls)] = cls
        for child in td.children():
            walk(child)

    walk(treedef)
    return found


def _is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and hasattr(cls, "_fields")


def _register(name: str, cls: type) -> None:
    if name in _registered:
        return
    try:
        jax.export.register_pytree_node_serialization(
            cls,
            serialized_name=name,
            serialize_auxdata=_to_json,
            deserialize_auxdata=_from_json,
        )
    except ValueError as err:  # registered already, by the user or an earlier call
        if "already registered" not in str(err):
            raise
    _registered.add(name)


def register_for_save(treedef: Any) -> list[str]:
    """Register the Flax node types of ``treedef`` so ``Exported.serialize`` accepts it.

    Returns the serialized names of every custom node type found (to store in MLmodel).
    """
    names = []
    for name, cls in custom_node_types(treedef).items():
        if name.startswith(AUTO_REGISTER_PREFIXES):
            _register(name, cls)
        names.append(name)
    return sorted(names)


def _not_a_node_type(name: str, found: str) -> ArtifactError:
    return ArtifactError(
        f"The model's MLmodel jaxexp.pytree_node_types names {name[:120]!r}: expected the import "
        f"path of a pytree node type (a class, e.g. flax.core.frozen_dict.FrozenDict), found "
        f"{found}. The MLmodel file is damaged or was altered; download the model again or "
        "re-log it from its source."
    )


def register_for_load(names: list[str]) -> None:
    """Import and register the node types recorded at save time, before deserializing.

    Only names under ``AUTO_REGISTER_PREFIXES`` are imported (from the installed packages, never
    from the model); a name that is not a dotted import path, or names something other than a
    class JAX can register, is an ``ArtifactError``."""
    check_node_type_names(names)
    for name in names or ():
        if not name or not name.startswith(AUTO_REGISTER_PREFIXES) or name in _registered:
            continue
        if not _IMPORT_PATH.fullmatch(name):
            raise _not_a_node_type(name, "a name that is not a dotted import path")
        module_name, _, qualname = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), qualname)
        except (ImportError, AttributeError) as err:
            raise UnsupportedModelError(
                f"The model's pytrees use the node type {name!r}, which cannot be imported here "
                f"({err}). Install the package that defines it (for Flax: pip install flax) "
                "and load again."
            ) from err
        if not isinstance(cls, type):
            raise _not_a_node_type(name, f"a {type(cls).__name__}")
        try:
            _register(name, cls)
        except (ValueError, TypeError) as err:
            raise _not_a_node_type(name, f"a class JAX cannot register ({err})"[:300]) from err
