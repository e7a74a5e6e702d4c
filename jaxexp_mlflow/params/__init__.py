"""A model's params: saved as an Orbax checkpoint, listed in a manifest, restored into a target.

The data path, one module a job:

* ``save``: ``save_params`` (Orbax writes; the manifest and an fsync pass follow),
  ``copy_checkpoint`` (an existing checkpoint, linked or copied as it is);
* ``orbax_io``: every call into Orbax, public API only (handler, save, metadata, restore);
* ``manifest``: every file with its size and CRC-32C, bound to the save that wrote it;
* ``memory_crc``: the arrays' CRC-32C taken in memory while Orbax writes them (``save_model``);
* ``layout``: item directory, ``_METADATA``, array directory names;
* ``tree``: leaf checks and tree comparisons with a target;
* ``restore``: ``restore_params`` (``codec.zarr`` reads plain arrays, Orbax the rest),
  ``check_checkpoint``, ``checkpoint_tree``, ``verify_manifest``;
* ``names``: the flat ``{name: array}`` form params are stored and exported in.

Importing this package imports neither JAX nor Orbax (the names below load on first use).
See docs/params.md.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "COMPRESSIONS": "save",
    "DEFAULT_COMPRESSION": "save",
    "save_params": "save",
    "copy_checkpoint": "save",
    "describe_checkpoint": "save",
    "fsync_tree": "save",
    "checkpoint_handler": "orbax_io",
    "quiet_ocdbt_merge": "orbax_io",
    "restore_params": "restore",
    "check_checkpoint": "restore",
    "checkpoint_tree": "restore",
    "verify_manifest": "restore",
    "MANIFEST_FILE": "manifest",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
