"""Read a model's MLmodel file: bounded YAML (no JAX, no MLflow import).

MLmodel is YAML written by MLflow. From an untrusted directory it is read with bounds: at most
``files.MAX_MLMODEL_BYTES``, at most ``MAX_ALIASES`` YAML aliases, nesting at most
``MAX_DEPTH`` deep and at most ``MAX_NODES`` values once aliases are expanded (an "alias bomb"
of a few kB otherwise expands to gigabytes in whoever walks the result: ``json.dumps``,
``copy.deepcopy``). This is the package's only MLmodel reader; its ``jaxexp`` section is then
checked by ``store.section``, but for the bound on its ``pytree_node_types``
(:func:`check_node_type_names`), which is here because ``pytrees`` checks it too, and this
module imports no JAX. A load reads and parses its MLmodel once (``store.model_files``); a
save reads its MLmodel back several times, so :func:`parse_mlmodel` keeps the last few parses
by the file's exact bytes and hands out deep copies (a changed byte parses again; nothing is
cached by path). The parse is libyaml's where
PyYAML has it (:func:`load_yaml`), with the budgets checked on its event stream first.
"""

from __future__ import annotations

import copy
import hashlib
import os
import threading
from collections import OrderedDict
from typing import Any

from jaxexp_mlflow.codec import files
from jaxexp_mlflow.codec.files import fail

__all__ = [
    "MLMODEL",
    "check_node_type_names",
    "load_yaml",
    "parse_mlmodel",
    "read_mlmodel",
    "read_mlmodel_bytes",
]

MLMODEL = "MLmodel"
MAX_ALIASES = 100
MAX_DEPTH = 64
MAX_NODES = 200_000
#: Bounds of ``pytree_node_types``: names are import paths (``flax.core.frozen_dict.FrozenDict``).
MAX_NODE_TYPES = 1024
MAX_NODE_TYPE_NAME = 512


def load_yaml(text: bytes | str, *, source: str = MLMODEL) -> Any:
    """Parse YAML safely and within the alias, depth and expanded-size budgets.

    With libyaml (PyYAML's ``__with_libyaml__``, true for PyPI's wheels) ``yaml.CSafeLoader``
    composes the node graph in C (libyaml's parser keeps its own stacks and stops at 1000
    levels, so no input recurses deeply; an alias is a second reference to its anchor's node,
    nothing is expanded); the graph is held to the depth and alias budgets (:func:`_check_nodes`)
    before ``SafeLoader``'s constructor builds any value from it: ~0.6 ms for a model's MLmodel
    against ~14 ms for the pure-Python loader, which is the fallback.
    """
    import yaml

    try:
        if getattr(yaml, "__with_libyaml__", False):
            loader = yaml.CSafeLoader(text)
            try:
                node = loader.get_single_node()
                if node is not None:
                    _check_nodes(yaml, node)
                data = None if node is None else loader.construct_document(node)
            finally:
                loader.dispose()
        else:
            data = yaml.load(text, Loader=_bounded_loader(yaml))  # noqa: S506 - SafeLoader's
        _check_expanded_size(data)
    except _Budget as err:
        raise fail(
            f"The model's {source} exceeds the reading budget ({err}): expected the few "
            "kilobytes of plain YAML MLflow writes. The file was altered or built by hand; do "
            "not load this model."
        ) from None
    except (yaml.YAMLError, RecursionError, UnicodeDecodeError, ValueError) as err:
        raise fail(
            f"The model's {source} is not valid YAML ({type(err).__name__}). Download the "
            "model again."
        ) from None
    return data


def _check_nodes(yaml: Any, root: Any) -> None:
    """Hold a composed node graph to the budgets, with the pure loader's count: each node
    (collection, scalar or alias) is one level below its parent collection, and each further
    reference to a node already met is an alias (not walked again: nothing is expanded)."""
    seen: set[int] = set()
    aliases = 0
    stack = [(root, 1)]
    while stack:
        node, level = stack.pop()
        if level > MAX_DEPTH:
            raise _Budget(f"nesting deeper than {MAX_DEPTH}")
        if id(node) in seen:
            aliases += 1
            if aliases > MAX_ALIASES:
                raise _Budget(f"more than {MAX_ALIASES} YAML aliases")
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key, value in reversed(node.value):
                stack.append((value, level + 1))
                stack.append((key, level + 1))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, level + 1) for item in reversed(node.value))


def _bounded_loader(yaml: Any) -> type:
    """A ``SafeLoader`` that counts aliases and nesting as it composes (pure Python)."""

    class Loader(yaml.SafeLoader):
        aliases = 0
        depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                Loader.aliases += 1
                if Loader.aliases > MAX_ALIASES:
                    raise _Budget(f"more than {MAX_ALIASES} YAML aliases")
            Loader.depth += 1
            try:
                if Loader.depth > MAX_DEPTH:
                    raise _Budget(f"nesting deeper than {MAX_DEPTH}")
                return super().compose_node(parent, index)
            finally:
                Loader.depth -= 1

    return Loader


class _Budget(Exception):
    pass


def _check_expanded_size(data: Any) -> None:
    stack, seen = [data], 0
    while stack:
        node = stack.pop()
        seen += 1
        if seen > MAX_NODES:
            raise _Budget(f"more than {MAX_NODES} values once aliases are expanded")
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list | tuple | set):
            stack.extend(node)


def read_mlmodel(model_dir: str | os.PathLike) -> dict[str, Any]:
    """The model's MLmodel as a dict: a confined, bounded read of a YAML mapping."""
    return parse_mlmodel(read_mlmodel_bytes(model_dir))


def read_mlmodel_bytes(model_dir: str | os.PathLike) -> bytes:
    """The bytes of the model's MLmodel: confined to ``model_dir``, a regular file, at most
    ``files.MAX_MLMODEL_BYTES``."""
    return files.read_bytes(
        model_dir, MLMODEL, what=f"{MLMODEL} file", max_bytes=files.MAX_MLMODEL_BYTES
    )


def parse_mlmodel(raw: bytes) -> dict[str, Any]:
    """MLmodel's bytes as a dict (bounded YAML, :func:`load_yaml`); ``ArtifactError`` unless
    they hold a mapping. The last few parses are kept by the bytes' sha256 (deep copies)."""
    key = hashlib.sha256(raw).digest()
    with _PARSED_LOCK:
        data = _PARSED.get(key)
        if data is not None:
            _PARSED.move_to_end(key)
            return copy.deepcopy(data)
    data = load_yaml(raw)
    if not isinstance(data, dict):
        raise fail(
            f"The model's {MLMODEL} file: expected a YAML mapping, found "
            f"{type(data).__name__}. Download the model again."
        )
    with _PARSED_LOCK:
        _PARSED[key] = copy.deepcopy(data)
        while len(_PARSED) > _PARSED_SIZE:
            _PARSED.popitem(last=False)
    return data


#: the last parses of read_mlmodel, by the sha256 of the file's bytes (bounded: each is a
#: checked parse of at most MAX_NODES values)
_PARSED: OrderedDict[bytes, dict[str, Any]] = OrderedDict()
_PARSED_SIZE = 4
_PARSED_LOCK = threading.Lock()


def _bad_names(expected: str, value: Any) -> Exception:
    found = type(value).__name__ if not isinstance(value, int | float | str) else repr(value)
    return fail(
        f"The model's {MLMODEL} jaxexp.pytree_node_types: expected {expected}, found {found:.80}. "
        "The file is damaged or was altered; download the model again."
    )


def check_node_type_names(names: Any) -> list[Any]:
    """``pytree_node_types`` as written by ``save_model``: a list of at most ``MAX_NODE_TYPES``
    printable names without spaces, each at most ``MAX_NODE_TYPE_NAME`` characters (or null);
    ``ArtifactError`` naming the field otherwise."""
    if names is None:
        return []
    if not isinstance(names, list) or len(names) > MAX_NODE_TYPES:
        raise _bad_names(f"a list of at most {MAX_NODE_TYPES} node type names", names)
    for name in names:
        if name is None:
            continue
        if (
            not isinstance(name, str)
            or not 0 < len(name) <= MAX_NODE_TYPE_NAME
            or not name.isprintable()
            or any(c.isspace() for c in name)
        ):
            shown = name if not isinstance(name, str) else f"{name[:60]!r} ({len(name)} chars)"
            raise _bad_names(
                f"import paths of node types (at most {MAX_NODE_TYPE_NAME} printable "
                "characters, no spaces)",
                shown,
            )
    return names
