"""Flatten inputs and rebuild outputs along a blob's pytree structure, without JAX.

The blob's ``in_tree``/``out_tree`` (read by ``codec.reader`` as :class:`TreeNode`) fix the
order of the flat leaves the module takes and returns. Tuples, lists, dicts (keys in the order
the blob lists them, which JAX sorts) and None are handled here; custom nodes (Flax
``FrozenDict``, ``nnx.State``...) need their Python types, which only JAX's registry knows: inputs
under a custom node must be passed flat (:meth:`IreeModel.call_flat`), outputs under one come
back as a dict ``{"<registered name>": [children]}``.
"""

from __future__ import annotations

from typing import Any

from jaxexp_mlflow.codec.reader import TreeNode
from jaxexp_mlflow.errors import InputError


def flatten(node: TreeNode, value: Any, where: str = "input") -> list[Any]:
    """The leaves of ``value`` in the order of ``node``; ``InputError`` on a structure mismatch."""
    out: list[Any] = []
    _flatten(node, value, where, out)
    return out


def _flatten(node: TreeNode, value: Any, where: str, out: list[Any]) -> None:
    kind = node.kind
    if kind == "leaf":
        out.append(value)
    elif kind == "none":
        if value is not None:
            raise InputError(f"{where}: expected None, found {type(value).__name__}.")
    elif kind in ("tuple", "list"):
        if not isinstance(value, tuple | list) or len(value) != len(node.children):
            raise InputError(
                f"{where}: expected a {kind} of {len(node.children)}, found "
                f"{type(value).__name__}{'' if not hasattr(value, '__len__') else len(value)}."
            )
        for i, (child, v) in enumerate(zip(node.children, value, strict=True)):
            _flatten(child, v, f"{where}[{i}]", out)
    elif kind == "dict":
        keys = list(node.keys or ())
        if not isinstance(value, dict) or sorted(map(str, value)) != sorted(keys):
            found = sorted(map(str, value)) if isinstance(value, dict) else type(value).__name__
            raise InputError(f"{where}: expected a dict with keys {keys}, found {found}.")
        for key, child in zip(keys, node.children, strict=True):
            _flatten(child, value[key], f"{where}[{key!r}]", out)
    else:
        raise InputError(
            f"{where}: the export expects a {node.custom_name} here, a custom pytree node that "
            "only JAX can flatten. Without JAX, pass the flat leaves: model.call_flat(leaves)."
        )


def unflatten(node: TreeNode, leaves: list[Any]) -> Any:
    """Rebuild the structure of ``node`` from its leaves (see the module docstring)."""
    it = iter(leaves)
    result = _build(node, it)
    return result


def _build(node: TreeNode, it: Any) -> Any:
    kind = node.kind
    if kind == "leaf":
        return next(it)
    if kind == "none":
        return None
    children = [_build(c, it) for c in node.children]
    if kind == "tuple":
        return tuple(children)
    if kind == "list":
        return children
    if kind == "dict":
        return dict(zip(node.keys or (), children, strict=True))
    return {node.custom_name: children}


def leaf_names(node: TreeNode) -> list[str] | None:
    """Orbax's directory names of the leaves (``w``, ``layers.0.b``), or None under custom nodes.

    The names join the pytree keys with dots, as ``params.layout`` names each array.
    """
    names: list[str] = []

    def walk(n: TreeNode, path: tuple[str, ...]) -> bool:
        if n.kind == "leaf":
            names.append(".".join(path))
        elif n.kind == "dict":
            return all(walk(c, (*path, k)) for k, c in zip(n.keys or (), n.children, strict=True))
        elif n.kind in ("tuple", "list"):
            return all(walk(c, (*path, str(i))) for i, c in enumerate(n.children))
        elif n.kind == "custom":
            return False
        return True

    return names if walk(node, ()) else None
