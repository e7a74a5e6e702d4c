"""CRC-32C of the params' bytes in memory, computed on a helper thread while Orbax writes them.

``save_params(..., checksums="memory")`` (what ``save_model`` and ``log_model`` use) takes the
manifest's CRC-32C of each array's chunk file from the array in memory, computed while
TensorStore writes the same bytes on its own threads, instead of reading every file back after
the write: one pass over the bytes less, and it overlaps the write on a second core.

A checksum taken from memory says what the file *should* hold, not what it holds. That is the
point: the caller then checks the files against the manifest (``save_model``'s read-back reads
every chunk file and compares its CRC-32C), which proves that the bytes on disk are the bytes of
the params given, a stronger proof than a manifest computed from the files themselves, which a
later check of the same files can only confirm. A file whose bytes differ (a TensorStore
layout this module misjudged, a flipped bit) is then refused before the model is published.

Only what is unambiguous is taken from memory: a C-contiguous host array (numpy, or a jax array
on one CPU device, viewed without a copy) stored as one uncompressed chunk file of exactly its
bytes (``codec.zarr.array_meta`` judges the layout). Every other file is checksummed from disk
as before. Uses public APIs (``jax.Array``, numpy) and ``internals.crc32c_private.extend``
(google_crc32c's library with the GIL released; ``google_crc32c.extend`` where it is not found).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

#: Bytes checksummed per call: where the checksum holds the GIL (the public fallback), Orbax's
#: own Python threads get it back between blocks (~0.3 ms each).
_BLOCK = 4 << 20


def _host_bytes(leaf: Any) -> Any:
    """A flat uint8 view of ``leaf``'s bytes when they sit in host memory as one C-contiguous
    buffer (no copy made), else None (the file is checksummed from disk instead)."""
    import jax
    import numpy as np

    if isinstance(leaf, jax.Array):
        try:
            devices = leaf.sharding.device_set
            if not leaf.is_fully_addressable or len(devices) != 1:
                return None
            if next(iter(devices)).platform != "cpu":
                return None  # np.asarray would copy it off the accelerator
            leaf = np.asarray(leaf)
        except Exception:  # noqa: BLE001 - deleted, donated...: Orbax reports it, not this
            return None
    if not isinstance(leaf, np.ndarray) or not leaf.flags.c_contiguous or leaf.dtype.hasobject:
        return None
    return leaf.reshape(-1).view(np.uint8)


class MemoryChecksums:
    """The CRC-32C of every host-resident leaf of ``params``, computed on one helper thread.

    ``start()`` before Orbax writes, ``files(path)`` after: ``{chunk file: (size, crc)}`` for
    the arrays whose single chunk file holds exactly their bytes.
    """

    def __init__(self, params: Any) -> None:
        import jax

        from jaxexp_mlflow.params import layout

        self._leaves: list[tuple[str, Any, Any]] = []  # (array directory, leaf, bytes view)
        for kp, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
            view = _host_bytes(leaf)
            if view is not None:
                self._leaves.append((layout.dir_name(tuple(map(layout.key_token, kp))), leaf, view))
        self._crcs: dict[str, int] = {}
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="jaxexp-params-crc32c", daemon=True)

    def _run(self) -> None:
        from jaxexp_mlflow.internals.crc32c_private import extend

        try:
            for name, _, view in self._leaves:
                value = 0
                for start in range(0, view.size, _BLOCK):
                    value = extend(value, view[start : start + _BLOCK])
                self._crcs[name] = int(value)
        except BaseException as err:  # noqa: BLE001 - the files are checksummed instead
            self._failed = err

    def start(self) -> MemoryChecksums:
        """Start checksumming (returns self)."""
        self._thread.start()
        return self

    def join(self) -> None:
        """Wait for the helper thread (also after a failed write: nothing left running)."""
        if self._thread.is_alive() or self._thread.ident is not None:
            self._thread.join()

    def files(self, path: Path, listed: dict[str, int]) -> dict[str, tuple[int, int]]:
        """Wait for the checksums; return ``{file relative to path: (size, crc32c)}`` for each
        array whose one chunk file of ``listed`` (``{relative path: size}`` on disk) holds
        exactly its bytes in the layout ``codec.zarr`` reads. Other files: not included."""
        import numpy as np

        from jaxexp_mlflow.codec import zarr

        self.join()
        if self._failed is not None:
            return {}
        known: dict[str, tuple[int, int]] = {}
        for name, leaf, view in self._leaves:
            crc = self._crcs.get(name)
            if crc is None:
                continue
            try:
                meta = zarr.read_meta(path, name, listed)
                if meta is None:
                    continue
                info = zarr.array_meta(meta, len(listed), expect=tuple(leaf.shape))
            except Exception:  # noqa: BLE001 - a layout not read here: checksummed from disk
                continue
            if len(info.keys) != 1 or info.sharded:
                continue
            if info.shape != tuple(leaf.shape) or info.dtype != np.dtype(leaf.dtype):
                continue
            rel = f"{name}/{info.keys[0]}"
            if listed.get(rel) == view.size:
                known[rel] = (view.size, crc)
        return known
