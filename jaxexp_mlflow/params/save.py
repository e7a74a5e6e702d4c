"""Write a model's params as an Orbax checkpoint, or copy one in, with its manifest.

Orbax writes every array (``params.orbax_io``); this module adds only what Orbax does not do:
the manifest of every file with its CRC-32C (``params.manifest``), a final fsync pass, and the
description MLmodel records. Nothing Orbax writes is rewritten afterwards.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

from jaxexp_mlflow import settings
from jaxexp_mlflow.codec.files import fsync_path
from jaxexp_mlflow.params import layout, orbax_io

#: Accepted values of ``compression=``: ``None`` (raw bytes, fastest) or ``"zstd"``.
COMPRESSIONS = (None, "zstd")
#: Default: no compression. Float weights barely compress (~5-10 % with zstd) while zstd halves
#: save/restore throughput on a small CPU; see docs/params.md for the measurements.
DEFAULT_COMPRESSION: str | None = None
FORMAT = "orbax-pytree"


def _check_compression(compression: str | None) -> str | None:
    if isinstance(compression, str) and compression.lower() in ("none", ""):
        compression = None
    if isinstance(compression, str):
        compression = compression.lower()
    if compression not in COMPRESSIONS:
        raise ValueError(
            f"compression={compression!r} is not supported: expected one of {COMPRESSIONS} "
            "(None = raw bytes, fastest; 'zstd' = smaller files, about half the throughput)."
        )
    return compression


def _new_dir(path: Path) -> None:
    if path.exists():
        raise FileExistsError(
            f"Params directory {path} already exists: expected a new path. Choose another path "
            "or remove the existing one."
        )
    path.parent.mkdir(parents=True, exist_ok=True)


def save_params(
    params: Any,
    directory: str | os.PathLike,
    *,
    compression: str | None = DEFAULT_COMPRESSION,
    durable: bool = True,
    checksums: str = "files",
    report: dict[str, Any] | None = None,
) -> dict:
    """Write the params pytree as an Orbax PyTree checkpoint at ``directory`` (must not exist).

    Leaves may be jax or numpy arrays of any dtype (bfloat16 included) or numeric scalars; the
    containers dicts, lists, tuples, None, Flax ``FrozenDict`` or ``nnx.State``. Orbax writes
    each array from its own buffer: no second copy of the tree is made. Returns the JSON-able
    description stored in MLmodel (see :func:`describe_checkpoint`). ``durable=False`` skips
    the final fsync pass: for a staging directory that is uploaded and deleted (``log_model``),
    or one its caller fsyncs whole (``save_model``'s atomic directory).

    ``checksums`` says where the manifest's CRC-32C of the array files come from: ``"files"``
    (default) reads every file back once written; ``"memory"`` checksums the arrays in memory
    on a helper thread while Orbax writes them (``params.memory_crc``), with no read of the
    files: the caller must then check the files against the manifest, as ``save_model``'s
    read-back does (a file that differs from the params given is refused there).

    ``report`` (a dict, filled in when given): ``arrays``, the number of arrays written, and
    ``from_memory``, ``{chunk file: size}`` of the files whose checksum was taken from an array
    in memory. One such file per array means that a check of the files against the manifest
    proves every array of the checkpoint equal to the params given (``flavors.readback``).
    """
    import jax

    from jaxexp_mlflow.codec import files
    from jaxexp_mlflow.params import manifest
    from jaxexp_mlflow.params.tree import as_array_leaf

    compression = _check_compression(compression)
    if checksums not in ("files", "memory"):
        raise ValueError(
            f"checksums={checksums!r} is not supported: expected 'files' (read the files back) "
            "or 'memory' (checksum the arrays while they are written; the caller verifies)."
        )
    path = Path(directory)
    _new_dir(path)
    params = jax.tree_util.tree_map_with_path(as_array_leaf, params)
    crcs = None
    if checksums == "memory" and compression is None:
        from jaxexp_mlflow.params.memory_crc import MemoryChecksums

        crcs = MemoryChecksums(params).start()  # beside TensorStore's writing threads
    try:
        orbax_io.save(params, path, use_compression=compression is not None)
    except Exception as e:
        if files.is_disk_full(e):  # TensorStore wraps ENOSPC in its own error types
            nbytes = sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(params))
            raise files.disk_full(path, nbytes, e) from None
        raise
    finally:
        if crcs is not None:
            crcs.join()
    from_memory: dict[str, int] = {}

    def known(found: dict[str, int]) -> dict[str, tuple[int, int]]:
        given = crcs.files(path, found) if crcs is not None else {}
        from_memory.update({rel: size for rel, (size, _) in given.items()})
        return given

    manifest.write_manifest(path, None if crcs is None else known)
    if report is not None:
        report.update(arrays=len(jax.tree.leaves(params)), from_memory=from_memory)
    if durable:
        fsync_tree(path)
    return describe_checkpoint(path)


#: Threads that fsync a tree's files at once (env ``JAXEXP_FSYNC_THREADS``).
FSYNC_THREADS = 8


def fsync_tree(path: Path) -> None:
    """fsync every file and directory under ``path``: durable like a raw write + fsync.

    TensorStore does not sync what it writes, so this flushes the params themselves. The fsyncs
    run on a few threads at once (``FSYNC_THREADS``): the file system then commits them
    together (one journal commit and device flush for many files instead of one each), 2-3x
    faster for a checkpoint's ~3 files an array, ~20x for files already clean (measured on
    ext4 on this VM, docs/params.md). It returns once every one has succeeded; the first error
    is raised.
    """
    import concurrent.futures

    targets = []
    for dirpath, _, names in os.walk(path):
        targets += [os.path.join(dirpath, name) for name in names]
        targets.append(dirpath)
    workers = max(1, min(settings.JAXEXP_FSYNC_THREADS.get(FSYNC_THREADS), len(targets)))
    if workers == 1:
        for target in targets:
            fsync_path(target)
        return
    with concurrent.futures.ThreadPoolExecutor(workers, "jaxexp-fsync") as pool:
        for _ in pool.map(fsync_path, targets):
            pass


def describe_checkpoint(directory: str | os.PathLike) -> dict:
    """Small JSON-able description of the checkpoint at ``directory`` (stored in MLmodel)."""
    import jax

    from jaxexp_mlflow.params.restore import checkpoint_tree

    path = layout.require_item_dir(directory)
    meta = layout.read_metadata(path)
    leaves = jax.tree.leaves(checkpoint_tree(path))
    first = next(
        (
            layout.dir_name(tuple(str(k["key"]) for k in v["key_metadata"]))
            for v in meta.get("tree_metadata", {}).values()
            if v.get("value_metadata", {}).get("value_type") in ("jax.Array", "np.ndarray")
        ),
        None,
    )
    return {
        "format": FORMAT,
        "compression": orbax_io.compression_of(path, meta, first),
        "use_ocdbt": layout.uses_ocdbt(path, meta),
        "use_zarr3": bool(meta.get("use_zarr3", False)),
        "orbax_version": orbax_io.version(),
        "num_arrays": len(leaves),
        "nbytes": int(sum(int(x.size) * x.dtype.itemsize for x in leaves)),
    }


def _link_or_copy(src: str, dst: str) -> None:
    """Hardlink when on the same filesystem, else reflink/copy (copy_file_range via shutil)."""
    try:
        os.link(src, dst)
        return
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
            raise
    shutil.copy2(src, dst)


def copy_checkpoint(src: str | os.PathLike, dst: str | os.PathLike) -> dict:
    """Copy an existing Orbax checkpoint to ``dst`` without loading its arrays into memory.

    ``src`` may be a PyTree checkpoint directory or a CheckpointManager step directory with one
    item (``<root>/<step>``, the item is found) or ``<root>/<step>/<item>``. Files are hardlinked
    when ``dst`` is on the same filesystem (Orbax never rewrites checkpoint files in place),
    copied otherwise, and kept as they are. Returns the same description as :func:`save_params`.
    """
    from jaxexp_mlflow.codec import files
    from jaxexp_mlflow.params import manifest
    from jaxexp_mlflow.params.restore import checkpoint_tree

    item = layout.find_item_dir(Path(src))
    # a link leading out of the checkpoint, a FIFO or a device is refused, never copied
    for _ in files.walk_files(item, ".", what="params checkpoint"):
        pass
    checkpoint_tree(item)  # validates that Orbax can read its metadata
    out = Path(dst)
    _new_dir(out)
    shutil.copytree(item, out, copy_function=_link_or_copy)
    if (out / manifest.MANIFEST_FILE).exists():  # ours, from an earlier save: written anew
        (out / manifest.MANIFEST_FILE).unlink()
    manifest.write_manifest(out)
    return describe_checkpoint(out)
