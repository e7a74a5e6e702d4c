"""Where a params checkpoint keeps what: the item directory, Orbax's ``_METADATA``, array names.

A checkpoint is one Orbax PyTree item: a directory holding ``_METADATA`` (Orbax's JSON tree of
key paths and value types) and, OCDBT off, one directory per array named by its key path joined
with ``.`` (``l1.kernel``), holding the array's zarr metadata and chunk files
(``codec.zarr``). This module knows those names and reads ``_METADATA``; no JAX is needed except
to turn pytree keys into names.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from jaxexp_mlflow.errors import ArtifactError

#: Orbax's metadata file written by (Base)PyTreeCheckpointHandler: its presence is what makes a
#: directory a PyTree checkpoint item.
PYTREE_METADATA_FILE = "_METADATA"
#: Orbax's value types for leaves that hold no array (stored with skip_deserialize).
_EMPTY_NODES = ("None", "Dict", "List", "Tuple")


def key_token(key: Any) -> str:
    """Canonical token for one pytree key, so that dict/FrozenDict/State/tuple/list compare."""
    import jax

    tu = jax.tree_util
    if isinstance(key, tu.DictKey):
        return str(key.key)
    if isinstance(key, tu.SequenceKey):
        return str(key.idx)
    if isinstance(key, tu.GetAttrKey):
        return str(key.name)
    if isinstance(key, tu.FlattenedIndexKey):
        return str(key.key)
    return str(key)


def dir_name(tokens: tuple[str, ...]) -> str:
    """The directory Orbax stores an array in (OCDBT off): its key path joined with ``.``."""
    return ".".join(tokens)


def leaf_names(tree: Any) -> list[str]:
    """The array directory names of ``tree``'s leaves, in flattening order."""
    import jax

    return [
        dir_name(tuple(key_token(k) for k in kp))
        for kp, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


def check_leaf_names(target: Any) -> None:
    """Array directories are named from the params' keys: refuse keys that would leave it."""
    import jax

    for kp, _ in jax.tree_util.tree_flatten_with_path(target)[0]:
        name = dir_name(tuple(key_token(k) for k in kp))
        parts = name.split("/")
        if "\\" in name or "\x00" in name or any(p in ("", ".", "..") for p in parts):
            raise ArtifactError(
                f"params{jax.tree_util.keystr(kp)}: expected a key usable as a directory name "
                "inside the checkpoint, found one with an empty, '.' or '..' path segment. The "
                "exported function's params tree was forged or damaged; do not load this model."
            )


def is_item_dir(path: Path) -> bool:
    """Whether ``path`` is an Orbax PyTree item (holds ``_METADATA``)."""
    return (path / PYTREE_METADATA_FILE).is_file()


def require_item_dir(directory: str | os.PathLike) -> Path:
    """``directory`` as a Path, or ``ArtifactError`` when it is no PyTree checkpoint item."""
    path = Path(directory)
    if not path.exists():
        raise ArtifactError(
            f"Params checkpoint not found: expected an Orbax checkpoint directory at {path}, "
            "found nothing. Check the model URI, or re-log the model with its params."
        )
    if not path.is_dir() or not is_item_dir(path):
        raise ArtifactError(
            f"Not an Orbax PyTree checkpoint: expected a directory holding "
            f"'{PYTREE_METADATA_FILE}' at {path}, found "
            f"{'a file' if not path.is_dir() else sorted(p.name for p in path.iterdir())[:10]}. "
            "The params artifact is missing or was altered; re-log the model."
        )
    return path


def find_item_dir(src: Path) -> Path:
    """``src`` itself, or the single PyTree item inside a CheckpointManager step directory."""
    if is_item_dir(src):
        return src
    if not src.is_dir():
        raise ArtifactError(
            f"Not an Orbax checkpoint: expected a directory at {src}, found "
            f"{'nothing' if not src.exists() else 'a file'}. Pass the path of an Orbax checkpoint "
            "or of a CheckpointManager step (<root>/<step> or <root>/<step>/<item>)."
        )
    items = sorted(p for p in src.iterdir() if p.is_dir() and is_item_dir(p))
    if len(items) == 1:
        return items[0]
    if len(items) > 1:
        named = [p for p in items if p.name in ("params", "default", "state")]
        if len(named) == 1:
            return named[0]
        raise ArtifactError(
            f"{src} is a CheckpointManager step with several items: expected one, found "
            f"{[p.name for p in items]}. Pass the item holding the params, e.g. {items[0]}."
        )
    steps = sorted(
        (p for p in src.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)
    )
    hint = (
        f" It looks like a CheckpointManager root: pass a step, e.g. {steps[-1]}." if steps else ""
    )
    raise ArtifactError(
        f"Not an Orbax PyTree checkpoint: expected '{PYTREE_METADATA_FILE}' in {src} or in one "
        f"of its subdirectories, found {sorted(p.name for p in src.iterdir())[:10]}.{hint}"
    )


def read_metadata(path: Path, held: dict[str, bytes] | None = None) -> dict:
    """Orbax's ``_METADATA`` of the item at ``path`` (bounded read, typed errors). ``held``:
    the bytes of the checkpoint's small files as its manifest check read them
    (``Manifest.held``), parsed instead of reading the file again."""
    from jaxexp_mlflow.codec import files

    raw = (held or {}).get(PYTREE_METADATA_FILE)
    if raw is None:
        raw = files.read_file(
            path / PYTREE_METADATA_FILE,
            what=f"params metadata {PYTREE_METADATA_FILE}",
            max_bytes=files.MAX_SMALL_FILE_BYTES,
        )
    try:
        meta = json.loads(raw)
        if not isinstance(meta, dict):
            raise ValueError(f"a JSON {type(meta).__name__}")
        return meta
    except (ValueError, RecursionError) as e:
        raise ArtifactError(
            f"Corrupt Orbax checkpoint at {path}: expected '{PYTREE_METADATA_FILE}' to be JSON, "
            f"found an unreadable file ({e}). Re-log the model with its params."
        ) from e


def uses_ocdbt(path: Path, meta: dict) -> bool:
    """Whether the item keeps its arrays in OCDBT (Orbax's default) rather than one directory
    per array."""
    return bool(meta.get("use_ocdbt", (path / "manifest.ocdbt").exists()))


class LeafMeta:
    """Shape, dtype and parsed zarr metadata of one stored array (``info``: what
    ``codec.zarr.array_meta`` read from it, or None)."""

    __slots__ = ("dtype", "info", "shape", "zarr")

    def __init__(self, shape: tuple[int, ...], dtype: Any, zarr: dict, info: Any = None) -> None:
        self.shape, self.dtype, self.zarr, self.info = shape, dtype, zarr, info


def plain_tree(
    path: Path, meta: dict, listed: Any, held: dict[str, bytes] | None = None
) -> dict[tuple[str, ...], LeafMeta] | None:
    """The checkpoint's leaves ``{path tokens: LeafMeta}`` read from ``_METADATA`` and each
    array's zarr metadata alone, or None when the checkpoint holds anything but plain zarr
    arrays (OCDBT, custom leaf types, a layout ``codec.zarr`` does not read): then Orbax reads
    the metadata. ``listed``: the checkpoint's file names (its manifest); ``held``: bytes of
    its small files as the manifest check read them (``Manifest.held``).

    Orbax's own metadata reader opens every array through TensorStore (~0.8 ms an array); this
    reads the same JSON files the fast path needs anyway, so a restore reads them once.
    ``tests/params/test_params.py`` compares the two readers.
    """
    from jaxexp_mlflow.codec import zarr

    tree = meta.get("tree_metadata")
    if meta.get("use_ocdbt", True) or not isinstance(tree, dict) or not tree:
        return None
    found: dict[tuple[str, ...], LeafMeta] = {}
    try:
        for entry in tree.values():
            value = entry["value_metadata"]
            kind = value.get("value_type")
            if kind in _EMPTY_NODES and value.get("skip_deserialize") is True:
                continue  # None or an empty container: no array, as in jax's flattening
            if kind not in ("jax.Array", "np.ndarray") or value.get("skip_deserialize"):
                return None
            tokens = tuple(str(k["key"]) for k in entry["key_metadata"])
            zmeta = zarr.read_meta(path, dir_name(tokens), listed, held) if tokens else None
            if zmeta is None or tokens in found:
                return None
            info = zarr.array_meta(zmeta, len(listed) if listed is not None else None)
            found[tokens] = LeafMeta(info.shape, info.dtype, zmeta, info)
    except (zarr.NotPlain, AttributeError, KeyError, TypeError, ValueError):
        return None  # Orbax judges (and refuses) what this does not understand
    return found
