"""Read a model's MLmodel file: bounded YAML (no JAX, no MLflow import).

MLmodel is YAML written by MLflow. From an untrusted directory it is read with bounds: at most
``files.MAX_MLMODEL_BYTES``, at most ``MAX_ALIASES`` YAML aliases, nesting at most
``MAX_DEPTH`` deep and at most ``MAX_NODES`` values once aliases are expanded (an "alias bomb"
of a few kB otherwise expands to gigabytes in whoever walks the result: ``json.dumps``,
``copy.deepcopy``). This is the package's only MLmodel reader; its ``jaxexp`` section is then
checked by ``flavors.section``. A save reads its MLmodel back four times and a load twice; the
YAML parser is pure Python (~30 ms for a model of 20 params), so :func:`read_mlmodel` keeps the
last few parses by the file's exact bytes and hands out deep copies (a changed byte parses
again; nothing is cached by path).
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

__all__ = ["MLMODEL", "load_yaml", "read_mlmodel"]

MLMODEL = "MLmodel"
MAX_ALIASES = 100
MAX_DEPTH = 64
MAX_NODES = 200_000


def load_yaml(text: bytes | str, *, source: str = MLMODEL) -> Any:
    """Parse YAML safely and within the alias, depth and expanded-size budgets."""
    import yaml

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

    try:
        data = yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader subclass
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
    raw = files.read_bytes(
        model_dir, MLMODEL, what=f"{MLMODEL} file", max_bytes=files.MAX_MLMODEL_BYTES
    )
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
