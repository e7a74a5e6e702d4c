"""Params codec: write, read and copy the model's parameters as a standard Orbax checkpoint.

The checkpoint is what ``orbax.checkpoint.PyTreeCheckpointHandler`` writes (OCDBT + zarr3), so
any Orbax user can restore it without this package, and restore goes straight into the target
shardings and dtypes. The settings chosen for throughput (compression off by default, one OCDBT
data file per array, no byte limits on 2 cores) are explained in ``docs/params.md``.

Orbax, TensorStore and JAX are imported inside the functions: importing Orbax costs ~0.26 s and
the flavor module must stay cheap to import.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import json
import logging
import os
import re
import shutil
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from jaxexp_mlflow.errors import ArtifactError, ParamsMismatchError

__all__ = [
    "COMPRESSIONS",
    "DEFAULT_COMPRESSION",
    "check_checkpoint",
    "checkpoint_handler",
    "checkpoint_tree",
    "copy_checkpoint",
    "describe_checkpoint",
    "restore_params",
    "save_params",
]

#: Accepted values of ``compression=``: ``None`` (raw bytes, fastest) or ``"zstd"``.
COMPRESSIONS = (None, "zstd")
#: Default: no compression. Float weights barely compress (~5-10 % with zstd) while zstd halves
#: save/restore throughput on a small CPU; see docs/params.md for the measurements.
DEFAULT_COMPRESSION: str | None = None

FORMAT = "orbax-pytree"
# OCDBT off: each array is a plain zarr3 directory (``<name>/zarr.json`` + ``<name>/c/...``), which
# Orbax restores like any other checkpoint and which lets restore_params read uncompressed arrays
# with one ``preadv`` straight into the final buffer (see docs/params.md, "fast path").
_USE_OCDBT = False
_USE_ZARR3 = True
# Orbax's metadata file written by (Base)PyTreeCheckpointHandler: its presence is what makes a
# directory a PyTree checkpoint item.
_PYTREE_METADATA_FILE = "_METADATA"


# --------------------------------------------------------------------------------------------
# helpers


def _key_token(key: Any) -> str:
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


def _aval_str(shape: tuple[int, ...], dtype: Any) -> str:
    import numpy as np

    name = np.dtype(dtype).name
    return f"{name}[{','.join(str(int(d)) for d in shape)}]"


def _ckpt_path_str(tokens: tuple[str, ...]) -> str:
    return "params" + "".join(f"[{t!r}]" for t in tokens)


def _as_array_leaf(path: Any, leaf: Any) -> Any:
    """Accept jax/numpy arrays and numeric scalars; reject anything else with a clear error."""
    import jax
    import numpy as np

    if isinstance(leaf, np.generic | bool | int | float | complex):
        leaf = np.asarray(leaf)
    if isinstance(leaf, jax.Array | np.ndarray):
        if leaf.size == 0:
            raise ParamsMismatchError(
                f"params{jax.tree_util.keystr(path)}: expected a non-empty array, found "
                f"{_aval_str(leaf.shape, leaf.dtype)}. Orbax cannot store zero-size arrays; "
                "replace the leaf with None (or drop it) and build the empty array inside the "
                "function."
            )
        return leaf
    raise ParamsMismatchError(
        f"params{jax.tree_util.keystr(path)}: expected an array (jax.Array or numpy.ndarray), "
        f"found {type(leaf).__module__}.{type(leaf).__qualname__}. Params must be a pytree "
        "(dict/list/tuple/None, Flax FrozenDict or nnx.State) whose leaves are arrays; convert "
        "other leaves to arrays or move them out of params."
    )


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


def checkpoint_handler(
    *,
    use_compression: bool = False,
    copy_host_arrays: bool = True,
    concurrent_bytes: int | None = None,
    diverting: bool = False,
) -> Any:
    """The Orbax ``PyTreeCheckpointHandler`` with this codec's settings (for CheckpointManagers).

    ``copy_host_arrays=False`` lets Orbax write numpy leaves from their own buffers instead of
    deep-copying them first (its guard against a caller changing them during an *asynchronous*
    save): only for synchronous saves, where the caller waits for the write to finish.
    ``concurrent_bytes``: Orbax's limit on the bytes of jax arrays being written at once
    (``save_concurrent_gb``; it must exceed the biggest array). ``diverting`` (with
    ``copy_host_arrays=False``): numpy arrays of checkpoints registered with
    ``codec.divert.diverted`` go to its sink instead of the disk.
    """
    import orbax.checkpoint as ocp

    kwargs: dict[str, Any] = {}
    if not copy_host_arrays:
        kwargs["type_handler_registry"] = _no_copy_registry(diverting)
    if concurrent_bytes is not None:
        kwargs["save_concurrent_gb"] = concurrent_bytes / 10**9
    return ocp.PyTreeCheckpointHandler(
        use_ocdbt=_USE_OCDBT,
        use_zarr3=_USE_ZARR3,
        use_compression=use_compression,
        **kwargs,
    )


def _no_copy_registry(diverting: bool = False) -> Any:
    """Orbax's standard type handlers, except numpy arrays written without a deep copy.

    Orbax's default ``NumpyHandler`` copies every numpy leaf before writing it (a second copy of
    the params in memory, and half the save throughput: issue 10). The registry is private to
    this codec: Orbax's global registry, which the user's own checkpoints use, is left alone.
    """
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from jaxexp_mlflow.codec import divert

    th = ocp.type_handlers
    standard = (int, float, bytes, np.number, jax.Array, str, type(ocp.PLACEHOLDER))
    pairs = [(t, th.get_type_handler(t)) for t in standard if th.has_type_handler(t)]
    make = divert.numpy_handler if diverting else th.NumpyHandler
    try:
        numpy_handler = make(deepcopy_host_arrays=False)
    except TypeError:  # an Orbax without the option: keep its default (copying) handler
        numpy_handler = th.get_type_handler(np.ndarray)
    return th.create_type_handler_registry(*pairs, (np.ndarray, numpy_handler))


class _DropOcdbtMergeWarning(logging.Filter):
    """Drop Orbax's "Skipping merge of OCDBT checkpoints" warning, and nothing else.

    Orbax finalizes every PyTree save by merging per-process OCDBT files, even when OCDBT is off
    as here (see ``_USE_OCDBT``), and warns that there was nothing to merge.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "Skipping merge of OCDBT checkpoints" not in str(record.msg)


@contextlib.contextmanager
def quiet_ocdbt_merge() -> Any:
    """Silence that one warning on absl's logger while this codec saves a non-OCDBT checkpoint."""
    logger = logging.getLogger("absl")
    flt = _DropOcdbtMergeWarning()
    logger.addFilter(flt)
    try:
        yield
    finally:
        logger.removeFilter(flt)


def _is_item_dir(path: Path) -> bool:
    return (path / _PYTREE_METADATA_FILE).is_file()


def _require_item_dir(directory: str | os.PathLike) -> Path:
    path = Path(directory)
    if not path.exists():
        raise ArtifactError(
            f"Params checkpoint not found: expected an Orbax checkpoint directory at {path}, "
            "found nothing. Check the model URI, or re-log the model with its params."
        )
    if not path.is_dir() or not _is_item_dir(path):
        raise ArtifactError(
            f"Not an Orbax PyTree checkpoint: expected a directory holding "
            f"'{_PYTREE_METADATA_FILE}' at {path}, found "
            f"{'a file' if not path.is_dir() else sorted(p.name for p in path.iterdir())[:10]}. "
            "The params artifact is missing or was altered; re-log the model."
        )
    return path


def _read_internal_metadata(path: Path) -> dict:
    from jaxexp_mlflow.codec import files

    raw = files.read_file(
        path / _PYTREE_METADATA_FILE,
        what=f"params metadata {_PYTREE_METADATA_FILE}",
        max_bytes=files.MAX_SMALL_FILE_BYTES,
    )
    try:
        meta = json.loads(raw)
        if not isinstance(meta, dict):
            raise ValueError(f"a JSON {type(meta).__name__}")
        return meta
    except (ValueError, RecursionError) as e:
        raise ArtifactError(
            f"Corrupt Orbax checkpoint at {path}: expected '{_PYTREE_METADATA_FILE}' to be JSON, "
            f"found an unreadable file ({e}). Re-log the model with its params."
        ) from e


def describe_checkpoint(directory: str | os.PathLike) -> dict:
    """Small JSON-able description of the checkpoint at ``directory`` (stored in MLmodel)."""
    import orbax.checkpoint as ocp

    path = _require_item_dir(directory)
    meta = _read_internal_metadata(path)
    tree = checkpoint_tree(path)
    import jax

    leaves = jax.tree.leaves(tree)
    return {
        "format": FORMAT,
        "compression": _detect_compression(path),
        "use_ocdbt": bool(meta.get("use_ocdbt", (path / "manifest.ocdbt").exists())),
        "use_zarr3": bool(meta.get("use_zarr3", False)),
        "orbax_version": ocp.__version__,
        "num_arrays": len(leaves),
        "nbytes": int(sum(int(x.size) * x.dtype.itemsize for x in leaves)),
    }


def _detect_compression(path: Path) -> str:
    """Best effort: read the zarr metadata of the first array (no array data)."""
    try:
        import tensorstore as ts

        meta = _read_internal_metadata(path)
        names = [
            ".".join(str(k["key"]) for k in v["key_metadata"])
            for v in meta.get("tree_metadata", {}).values()
            if v.get("value_metadata", {}).get("value_type") in ("jax.Array", "np.ndarray")
        ]
        if not names:
            return "none"
        zarr3 = bool(meta.get("use_zarr3", False))
        if meta.get("use_ocdbt", True):
            kv = {
                "driver": "ocdbt",
                "base": f"file://{path.resolve()}/",
                "path": names[0],
            }
        else:
            kv = {"driver": "file", "path": str(path / names[0])}
        store = ts.open({"driver": "zarr3" if zarr3 else "zarr", "kvstore": kv}, read=True).result()
        spec = store.spec().to_json()["metadata"]
        text = json.dumps(spec.get("codecs", spec.get("compressor")))
        for algo in ("zstd", "blosc", "gzip", "zlib", "bz2", "lz4"):
            if algo in text:
                return algo
        return "none"
    except Exception:  # noqa: BLE001 - description only, never fatal
        return "unknown"


# --------------------------------------------------------------------------------------------
# public API


def save_params(
    params: Any,
    directory: str | os.PathLike,
    *,
    compression: str | None = DEFAULT_COMPRESSION,
    durable: bool = True,
) -> dict:
    """Write the params pytree as an Orbax PyTree checkpoint at ``directory`` (must not exist).

    Leaves may be jax or numpy arrays of any dtype (bfloat16 included) or numeric scalars; the
    containers dicts, lists, tuples, None, Flax ``FrozenDict`` or ``nnx.State``. Arrays are
    streamed to disk one by one from their own buffers: no second copy of the tree is made.
    Returns the JSON-able description stored in MLmodel (see :func:`describe_checkpoint`).
    ``durable=False`` skips the final fsync pass: for a staging directory that is uploaded
    and deleted (``log_model``), where durability is the artifact store's job. Inside
    ``codec.divert.sending`` (``log_model`` through a server) the chunk files of big arrays go
    to its sink instead of the disk; the manifest lists them all the same.
    """
    compression = _check_compression(compression)
    path = Path(directory)
    if path.exists():
        raise FileExistsError(
            f"Params directory {path} already exists: expected a new path. Choose another path "
            "or remove the existing one."
        )
    import jax
    import orbax.checkpoint as ocp

    from jaxexp_mlflow.codec import divert

    params = jax.tree_util.tree_map_with_path(_as_array_leaf, params)
    path.parent.mkdir(parents=True, exist_ok=True)
    watcher = _CHUNK_WATCHER.get()
    sink = divert.current_sink()
    handler = checkpoint_handler(
        use_compression=compression is not None,
        copy_host_arrays=False,
        concurrent_bytes=None if watcher is None else _watched_concurrency(params),
        diverting=sink is not None,
    )
    checkpointer = ocp.Checkpointer(handler)  # synchronous: numpy leaves need no copy
    poller = _ChunkPoller(path, watcher) if watcher is not None else None
    sent: dict[str, tuple[int, int]] = {}
    try:
        if poller is not None:
            poller.start()
        with contextlib.ExitStack() as stack:
            if sink is not None:
                sent = stack.enter_context(divert.diverted(path, sink)).sent
            stack.enter_context(quiet_ocdbt_merge())
            checkpointer.save(path.absolute(), args=ocp.args.PyTreeSave(params))
    except Exception as e:
        from jaxexp_mlflow.codec import files

        if files.is_disk_full(e):  # TensorStore wraps ENOSPC in its own error types
            nbytes = sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(params))
            raise files.disk_full(path, nbytes, e) from None
        raise
    finally:
        if poller is not None:
            poller.halt()
        checkpointer.close()
    _flatten_chunk_keys(path)
    divert.record(path, sent)
    _write_manifest(path, poller.known if poller is not None else None, sent)
    if durable:
        fsync_tree(path)
    return describe_checkpoint(path)


#: Bytes of arrays Orbax writes at once while a chunk watcher uploads them (at least twice the
#: biggest array): the first files are finished, and can go up, long before the last.
WATCHED_CONCURRENT_BYTES = 256 << 20


def _watched_concurrency(params: Any) -> int:
    import jax

    biggest = max((int(x.nbytes) for x in jax.tree.leaves(params)), default=0)
    return max(WATCHED_CONCURRENT_BYTES, 2 * biggest + 1)


#: Called as ``callback(final relative path, current path)`` for each array chunk file that
#: Orbax has finished writing, while :func:`save_params` runs (set with :func:`chunk_watcher`);
#: it may return ``(st_dev, st_ino, CRC-32C)`` of the file it read whole, which the manifest
#: then takes instead of reading that file again.
_CHUNK_WATCHER: contextvars.ContextVar[Callable[[str, Path], Any] | None] = contextvars.ContextVar(
    "jaxexp_chunk_watcher", default=None
)


@contextlib.contextmanager
def chunk_watcher(callback: Callable[[str, Path], Any]) -> Iterator[None]:
    """While inside, :func:`save_params` reports each array chunk file as soon as Orbax has
    written it whole, so that a caller can start uploading it before the save ends
    (``log_model`` through a server: ``transfer.EarlyUpload``). The path given is where the
    file is now (Orbax's temporary directory, renamed when the save commits): link or open it
    at once. TensorStore writes every file under a ``.__lock`` name and renames it into place,
    so a chunk file seen under its own name is complete. A callback that reads the file whole
    may return ``(st_dev, st_ino, CRC-32C)`` of what it read: the manifest takes that checksum
    for the file while it is the same inode, instead of reading it again."""
    token = _CHUNK_WATCHER.set(callback)
    try:
        yield
    finally:
        _CHUNK_WATCHER.reset(token)


def _final_chunk_name(rel: str) -> str | None:
    """``<array>/c/0/0`` (as Orbax writes it) -> ``<array>/c.0.0`` (after
    :func:`_flatten_chunk_keys`); None for any other file."""
    parts = rel.split("/")
    if len(parts) < 3 or parts[1] != "c" or not all(p.isdigit() for p in parts[2:]):
        return None
    return f"{parts[0]}/{'.'.join(parts[1:])}"


class _ChunkPoller(threading.Thread):
    """Polls Orbax's temporary checkpoint directory for finished chunk files (every 20 ms)."""

    def __init__(self, path: Path, callback: Callable[[str, Path], None]) -> None:
        super().__init__(name="jaxexp-chunk-poller", daemon=True)
        self.path, self.prefix = path, f"{path.name}.orbax-checkpoint-tmp"
        self.callback, self.seen = callback, set()
        #: final relative path -> (st_dev, st_ino, CRC-32C) the callback returned
        self.known: dict[str, tuple[int, int, int]] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(0.02):
            self.scan()

    def halt(self) -> None:
        """Stop polling; report what the polls missed from the committed checkpoint (the
        chunk files still have Orbax's names there until ``_flatten_chunk_keys``)."""
        self._halt.set()
        self.join()
        if self.path.is_dir():
            self.scan([str(self.path)])

    def scan(self, tops: list[str] | None = None) -> None:
        if tops is None:
            try:
                tops = [
                    e.path for e in os.scandir(self.path.parent) if e.name.startswith(self.prefix)
                ]
            except OSError:
                return
        for top in tops:
            for dirpath, _, names in os.walk(top):
                for name in names:
                    if name.endswith(".__lock"):
                        continue
                    final = _final_chunk_name(os.path.relpath(f"{dirpath}/{name}", top))
                    if final is not None and final not in self.seen:
                        self.seen.add(final)
                        read = self.callback(final, Path(dirpath, name))
                        if read is not None:
                            self.known[final] = read


#: File listing every file of the checkpoint with its size and CRC-32C, written by this package
#: so that a file lost or altered on the way (a partial download, an artifact store that skips
#: it, bit rot, an edit) is an error and not a silently zero-filled or corrupted array: zarr
#: reads a missing chunk file as its fill value. See ``codec.manifest``.
MANIFEST_FILE = "jaxexp_manifest.json"


def _flatten_chunk_keys(path: Path) -> None:
    """Store zarr3 chunks as ``c.0.0`` files instead of nested ``c/0/0`` directories.

    Both are standard zarr3 (``chunk_key_encoding`` separator ``.`` or ``/``), read by Orbax and
    TensorStore alike. The flat form avoids a directory ``0`` holding a single file ``0``, which
    MLflow's HTTP artifact repository (``mlflow server`` proxying artifacts) takes for a file and
    silently skips on download. Files in ``path`` may be hardlinks to a source checkpoint: they
    are renamed or replaced, never written in place.
    """
    for meta_file in path.rglob("zarr.json"):
        try:
            meta = json.loads(meta_file.read_bytes())
        except ValueError:
            continue
        encoding = meta.get("chunk_key_encoding", {})
        sep = encoding.get("configuration", {}).get("separator", "/")
        if meta.get("node_type") != "array" or encoding.get("name") != "default" or sep != "/":
            continue
        array_dir = meta_file.parent
        chunks = array_dir / "c"
        if chunks.is_dir():
            for f in sorted(chunks.rglob("*")):
                if f.is_file():
                    f.rename(array_dir / ".".join(f.relative_to(array_dir).parts))
            shutil.rmtree(chunks)
        meta["chunk_key_encoding"] = {"name": "default", "configuration": {"separator": "."}}
        meta_file.unlink()  # may be a hardlink: replace it, never rewrite it in place
        meta_file.write_text(json.dumps(meta))


def _write_manifest(
    path: Path,
    known: dict[str, tuple[int, int, int]] | None = None,
    absent: dict[str, tuple[int, int]] | None = None,
) -> None:
    from jaxexp_mlflow.codec import manifest

    manifest.write_manifest(path, known, absent)


def _is_chunk_file(rel: str) -> bool:
    """Array data (zarr chunks, OCDBT data files): checksummed while the fast path reads them."""
    name = rel.rsplit("/", 1)[-1]
    return name == "c" or bool(re.fullmatch(r"c(\.\d+)+", name)) or "/c/" in f"/{rel}"


def verify_manifest(directory: str | os.PathLike) -> Any:
    """Check the checkpoint at ``directory`` against its manifest (see ``codec.manifest``).

    File set, sizes, regular files inside the directory, and the CRC-32C of every file except
    the array chunks, which are checked as they are read. Returns the ``Manifest``; raises
    :class:`ArtifactError` when the manifest is missing or a file differs from it.
    """
    from jaxexp_mlflow.codec import divert, manifest

    return manifest.verify_checkpoint(
        directory,
        checksum=lambda rel: not _is_chunk_file(rel),
        absent=divert.sent_from_memory(directory),
    )


def fsync_tree(path: Path) -> None:
    """fsync every file and directory of the checkpoint: durable like a raw write + fsync.

    TensorStore already syncs what it writes, so this costs only the system calls; it makes the
    guarantee independent of the storage backend's settings.
    """
    for dirpath, _, files in os.walk(path):
        for name in [*files, "."]:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def checkpoint_tree(directory: str | os.PathLike) -> Any:
    """The checkpoint's tree of ``jax.ShapeDtypeStruct`` (metadata only, no array data read).

    Containers come back as Orbax stores them: dicts and lists (tuples are stored as lists);
    empty containers and None leaves are kept. To compare with an expected tree whose containers
    differ (tuples, FrozenDict, nnx.State...), use :func:`check_checkpoint`. ``directory`` may
    also be a CheckpointManager step directory holding one item.
    """
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from orbax.checkpoint import metadata as ocp_meta

    path = Path(directory)
    path = _require_item_dir(path if not path.is_dir() else _find_item_dir(path))
    _read_internal_metadata(path)  # ArtifactError when it is not JSON
    checkpointer = ocp.Checkpointer(checkpoint_handler())
    try:
        meta = checkpointer.metadata(path.absolute())
    except Exception as e:  # orbax raises many types for a damaged checkpoint
        raise ArtifactError(
            f"Cannot read the Orbax checkpoint metadata at {path}: expected a readable PyTree "
            f"checkpoint, found {type(e).__name__}: {e}. Re-log the model with its params."
        ) from e
    finally:
        checkpointer.close()
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    if tree is None:
        raise ArtifactError(
            f"Cannot read the Orbax checkpoint metadata at {path}: expected a PyTree metadata "
            f"tree in '{_PYTREE_METADATA_FILE}', found none. The artifact is damaged; re-log the "
            "model with its params."
        )

    def to_sds(x: Any) -> Any:
        if isinstance(x, ocp_meta.ArrayMetadata | ocp_meta.ScalarMetadata):
            return jax.ShapeDtypeStruct(tuple(x.shape), np.dtype(x.dtype))
        return x

    is_leaf = lambda x: isinstance(x, ocp_meta.ArrayMetadata | ocp_meta.ScalarMetadata)  # noqa: E731
    return jax.tree.map(to_sds, tree, is_leaf=is_leaf)


def _compare(found_tree: Any, target: Any) -> list[str]:
    """Per-leaf differences between the checkpoint tree and the target (empty when they fit)."""
    import jax

    found = {
        tuple(_key_token(k) for k in kp): leaf
        for kp, leaf in jax.tree_util.tree_flatten_with_path(found_tree)[0]
    }
    return _compare_flat(found, target)


def _compare_flat(found: dict[tuple[str, ...], Any], target: Any) -> list[str]:
    """:func:`_compare` with the checkpoint's leaves given as ``{path tokens: leaf}``."""
    import jax
    import numpy as np

    expected = {}
    names = {}
    for kp, leaf in jax.tree_util.tree_flatten_with_path(target)[0]:
        tokens = tuple(_key_token(k) for k in kp)
        expected[tokens] = leaf
        names[tokens] = "params" + jax.tree_util.keystr(kp)
    problems = []
    for tokens, exp in expected.items():
        name = names[tokens]
        if not hasattr(exp, "shape") or not hasattr(exp, "dtype"):
            problems.append(
                f"{name}: target leaf is {type(exp).__name__}, expected a jax.ShapeDtypeStruct"
            )
            continue
        want = _aval_str(exp.shape, exp.dtype)
        if tokens not in found:
            problems.append(f"{name}: expected {want}, found no such array in the checkpoint")
            continue
        got = found[tokens]
        if tuple(got.shape) != tuple(exp.shape) or np.dtype(got.dtype) != np.dtype(exp.dtype):
            problems.append(f"{name}: expected {want}, found {_aval_str(got.shape, got.dtype)}")
    for tokens, got in found.items():
        if tokens not in expected:
            problems.append(
                f"{_ckpt_path_str(tokens)}: expected nothing there, found "
                f"{_aval_str(got.shape, got.dtype)} in the checkpoint"
            )
    return problems


class _NoFastPath(Exception):
    """The leaf's storage layout is not the simple one the fast path reads; use Orbax."""


_MISSING = 2**64 - 1  # zarr3 sharding index entry of a chunk that was never written


def _aligned_empty(shape: tuple[int, ...], dtype: Any, align: int = 64) -> Any:
    """Uninitialised numpy array whose data is ``align``-byte aligned.

    Aligned host buffers are adopted by ``jax.device_put`` on CPU without a copy, which is what
    makes restore a single pass over the bytes (kernel -> final buffer).
    """
    import numpy as np

    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off : off + nbytes].view(dtype).reshape(shape)


class _Crc:
    """A CRC-32C computed on a helper thread while the next block is read (ctypes releases the
    GIL): checking costs no wall time as long as the checksum is faster than the disk."""

    _pool: Any = None

    def __init__(self, value: int = 0) -> None:
        import concurrent.futures

        if _Crc._pool is None:
            _Crc._pool = concurrent.futures.ThreadPoolExecutor(1, "jaxexp-crc32c")
        self.value = value
        self._last: Any = None

    def _extend(self, block: memoryview) -> None:
        from jaxexp_mlflow.codec.manifest import crc32c

        self.value = crc32c(block, self.value)

    def add(self, block: memoryview) -> None:
        """Queue ``block`` (it must stay unchanged until :meth:`result`)."""
        self._last = self._pool.submit(self._extend, block)  # one worker: blocks stay in order

    def result(self) -> int:
        if self._last is not None:
            self._last.result()
        return self.value


def _pread_into(fd: int, view: memoryview, offset: int, crc: _Crc | None) -> None:
    """Fill ``view`` from ``offset``; queue the bytes read on ``crc`` (if any)."""
    while len(view):
        n = os.preadv(fd, [view[: 8 << 20]], offset)  # blocks of 8 MiB: checksummed while cached
        if n <= 0:
            raise ArtifactError(
                f"Truncated params array file: expected {len(view)} more bytes at offset "
                f"{offset}, found end of file. The artifact is damaged; re-log the model."
            )
        if crc is not None:
            crc.add(view[:n])
        view = view[n:]
        offset += n


def _fast_read_leaf(
    root: Path,
    rel_dir: str,
    sds: Any,
    manifest: Any,
    meta: dict | None = None,
    mapped: dict[str, int] | None = None,
) -> Any:
    """Read one uncompressed zarr3 array written by Orbax straight into an aligned buffer.

    Handles the layouts Orbax writes for an unsharded array: ``sharding_indexed`` (or plain)
    zarr3 chunks with the ``bytes`` codec only, split along axis 0 at most. Anything else raises
    ``_NoFastPath`` and the leaf goes through Orbax. Every chunk file must be present and hold
    the array's bytes (checked before the buffer is allocated; a missing chunk is an error, not
    zeros: Orbax writes every chunk), and its CRC-32C, computed as it is read, must match the
    manifest. ``mapped`` (not None): an array held whole in one chunk file is mapped instead of
    copied, with the checksums ``mapped`` already knows (see :func:`_map_leaf`).
    """
    import numpy as np

    from jaxexp_mlflow.codec import files
    from jaxexp_mlflow.codec.manifest import file_crc32c

    if f"{rel_dir}/zarr.json" not in manifest.files:
        raise _NoFastPath("no zarr.json")
    if meta is None:
        meta = _read_zarr_meta(root, rel_dir)
    shape = tuple(int(d) for d in sds.shape)
    dtype = np.dtype(sds.dtype)
    try:
        if (
            meta.get("zarr_format") != 3
            or tuple(meta.get("shape", ())) != shape
            or meta.get("data_type") != dtype.name
            or meta.get("chunk_key_encoding", {}).get("name") != "default"
            or meta.get("chunk_key_encoding", {}).get("configuration", {}).get("separator", "/")
            not in ("/", ".")
            or meta.get("chunk_grid", {}).get("name") != "regular"
            or meta.get("storage_transformers")
            or sys.byteorder != "little"
        ):
            raise _NoFastPath("zarr metadata")
        outer = tuple(int(d) for d in meta["chunk_grid"]["configuration"]["chunk_shape"])
        codecs = meta.get("codecs", [])
        raw_codecs = [[{"name": "bytes", "configuration": {"endian": "little"}}]]
        if dtype.itemsize == 1:  # endianness is meaningless, so zarr3 omits it
            raw_codecs.append([{"name": "bytes"}])
        if len(codecs) == 1 and codecs[0].get("name") == "sharding_indexed":
            conf = codecs[0]["configuration"]
            inner = tuple(int(d) for d in conf["chunk_shape"])
            if (
                conf.get("codecs") not in raw_codecs
                or conf.get("index_location", "end") != "end"
                or conf.get("index_codecs")
                != [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
            ):
                raise _NoFastPath("codecs")
            sharded = True
        elif codecs in raw_codecs:
            inner, sharded = outer, False
        else:
            raise _NoFastPath("codecs")
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise _NoFastPath("zarr metadata") from e  # Orbax judges (and refuses) it
    if len(outer) != len(shape) or len(inner) != len(shape) or outer[1:] != shape[1:]:
        raise _NoFastPath("chunk shape")
    if inner[1:] != shape[1:] or (shape and (not inner[0] or outer[0] % inner[0])):
        raise _NoFastPath("chunk shape")
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize if shape else 0
    rows = shape[0] if shape else 1
    outer0 = outer[0] if shape else 1
    inner0 = inner[0] if shape else 1
    if not shape:
        row_bytes = dtype.itemsize
    if rows == 0 or row_bytes == 0:
        return _aligned_empty(shape, dtype)
    layout = _Layout(rows, row_bytes, inner0, outer0 // inner0, sharded)
    sep = meta["chunk_key_encoding"].get("configuration", {}).get("separator", "/")
    rest = f"{sep}0" * (len(shape) - 1)
    keys = [f"c{sep}{s}{rest}" if shape else "c" for s in range(-(-rows // outer0))]
    missing = [k for k in keys if f"{rel_dir}/{k}" not in manifest.files]
    if missing:
        raise ArtifactError(
            f"The params array {rel_dir} lacks its chunk file {missing[0]!r} (and "
            f"{len(missing) - 1} more): expected every chunk of the array, found none, which "
            "would read as zeros. The checkpoint is incomplete; download the model again."
        )
    on_disk = sum(manifest.files[f"{rel_dir}/{k}"][0] for k in keys)
    nbytes = rows * row_bytes
    if on_disk < nbytes:  # before allocating: the files must hold the bytes they claim
        raise ArtifactError(
            f"The params array {rel_dir} claims {nbytes} bytes ({dtype.name}{list(shape)}) but "
            f"its chunk files hold {on_disk}. The checkpoint is damaged or forged; download the "
            "model again."
        )
    if mapped is not None and len(keys) == 1 and rows * row_bytes >= _MAP_MIN_BYTES and _CAN_MAP:
        rel = f"{rel_dir}/{keys[0]}"
        host = _map_leaf(root, rel, shape, dtype, manifest, layout, mapped.get(rel))
        if host is not None:
            return host
    out = _aligned_empty(shape, dtype)
    flat = out.reshape(-1).view(np.uint8) if out.ndim else out.reshape(1).view(np.uint8)
    for s_idx, key in enumerate(keys):
        rel = f"{rel_dir}/{key}"
        fd, size = files.open_regular(
            root / rel, what=f"params file {rel!r}", max_bytes=manifest.files[rel][0]
        )
        try:
            regions = [  # (file offset, destination) of every chunk this file holds
                (offset, flat[first : first + valid])
                for offset, first, valid in _file_regions(fd, size, rel, s_idx * outer0, layout)
            ]
            crc, pos = _Crc(), 0
            for offset, dst in sorted(regions, key=lambda r: r[0]):
                if offset < pos:  # overlapping chunks: checksum the file on its own
                    crc, pos = None, size
                    break
                if offset > pos:  # bytes between chunks (padding of a partial chunk)
                    crc = _Crc(file_crc32c(fd, offset - pos, pos, crc.result()))
                _pread_into(fd, memoryview(dst), offset, crc)
                pos = offset + len(dst)
            if crc is None:
                for offset, dst in regions:
                    _pread_into(fd, memoryview(dst), offset, None)
                value = file_crc32c(fd, size)
            else:
                value = file_crc32c(fd, size - pos, pos, crc.result())
            manifest.check(rel, value)
        finally:
            os.close(fd)
    return out


#: Arrays below this size are copied even when mapping is allowed: a mapping costs a page
#: and a kernel map entry (at most ``vm.max_map_count``, 65530 by default, per process).
_MAP_MIN_BYTES = 1 << 20
#: POSIX private read-only mappings (elsewhere arrays are copied).
_CAN_MAP = os.name == "posix"


class _Layout(NamedTuple):
    """How one array's bytes lie in its chunk files (from its zarr.json)."""

    rows: int  # along axis 0, the axis chunks split
    row_bytes: int
    inner0: int  # rows per inner chunk
    n_inner: int  # inner chunks per chunk file
    sharded: bool  # sharding_indexed codec: chunk index at the end of each file


def _file_regions(
    fd: int, size: int, rel: str, row0: int, layout: _Layout
) -> list[tuple[int, int, int]]:
    """``(file offset, byte offset in the array, length)`` of every chunk one chunk file holds,
    checked against the file's size (a chunk never written or lying past the end is an error)."""
    import numpy as np

    chunk_bytes = layout.inner0 * layout.row_bytes
    if layout.sharded:
        index_bytes = layout.n_inner * 16
        if size < index_bytes + 4:
            raise ArtifactError(
                f"Truncated params array file {rel}: expected at least "
                f"{index_bytes + 4} bytes, found {size}. Re-log the model."
            )
        index = np.frombuffer(os.pread(fd, index_bytes, size - index_bytes - 4), "<u8")
        entries = [(int(o), int(n)) for o, n in index.reshape(layout.n_inner, 2)]
    else:
        entries = [(0, chunk_bytes)]
    regions = []
    for c_idx, (offset, nb) in enumerate(entries):
        start_row = row0 + c_idx * layout.inner0
        if start_row >= layout.rows:
            break
        if offset == _MISSING and nb == _MISSING:
            raise ArtifactError(
                f"The params array file {rel} marks chunk {c_idx} as never written: "
                "expected every chunk of the array (it would read as zeros). The "
                "checkpoint is damaged; download the model again."
            )
        if nb != chunk_bytes:
            raise _NoFastPath("chunk size (compressed?)")
        if offset + nb > size:
            raise ArtifactError(
                f"The params array file {rel} is damaged: chunk {c_idx} lies past its "
                f"end ({offset + nb} > {size} bytes). Download the model again."
            )
        valid = min(layout.inner0, layout.rows - start_row) * layout.row_bytes
        regions.append((offset, start_row * layout.row_bytes, valid))
    return regions


def _map_leaf(
    root: Path,
    rel: str,
    shape: tuple[int, ...],
    dtype: Any,
    manifest: Any,
    layout: _Layout,
    known_crc: int | None = None,
) -> Any:
    """The array as a read-only private mapping of its one chunk file, checksummed whole, or
    None when its bytes are not one aligned run at the start of the file (then it is copied).

    No anonymous memory is touched: the pages are the page cache's, which a download has just
    filled (a fresh buffer costs this VM ~1 s/GiB the first time it is touched, a copy from the
    page cache 0.45 s/GiB; mapping with MAP_POPULATE plus the CRC-32C pass ~0.13 s/GiB). Only
    for directories this process owns and nobody else writes (``load_model``'s private download
    directory): a mapped file truncated by someone else would kill the process with SIGBUS.
    ``known_crc``: the file's CRC-32C as this process computed it when it wrote the file (its
    download), checked against the manifest instead of reading the pages again.
    """
    import mmap

    import numpy as np

    from jaxexp_mlflow.codec import files
    from jaxexp_mlflow.codec.manifest import crc32c

    nbytes = layout.rows * layout.row_bytes
    fd, size = files.open_regular(
        root / rel, what=f"params file {rel!r}", max_bytes=manifest.files[rel][0]
    )
    try:
        regions = _file_regions(fd, size, rel, 0, layout)
        if sum(n for _, _, n in regions) != nbytes or any(o != a for o, a, _ in regions):
            return None  # chunks out of order or padded: the copy path reassembles them
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)
        mapping = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    manifest.check(rel, crc32c(memoryview(mapping)) if known_crc is None else known_crc)
    return np.frombuffer(mapping, dtype, count=nbytes // dtype.itemsize).reshape(shape)


def _param_dir_name(tokens: tuple[str, ...]) -> str:
    return ".".join(tokens)


def _check_leaf_names(target: Any) -> None:
    """Array directories are named from the params' keys: refuse keys that would leave it."""
    import jax

    for kp, _ in jax.tree_util.tree_flatten_with_path(target)[0]:
        name = _param_dir_name(tuple(_key_token(k) for k in kp))
        parts = name.split("/")
        if "\\" in name or "\x00" in name or any(p in ("", ".", "..") for p in parts):
            raise ArtifactError(
                f"params{jax.tree_util.keystr(kp)}: expected a key usable as a directory name "
                "inside the checkpoint, found one with an empty, '.' or '..' path segment. The "
                "exported function's params tree was forged or damaged; do not load this model."
            )


def _read_zarr_meta(root: Path, rel_dir: str) -> dict:
    """The parsed ``zarr.json`` of one array directory (bounded read, typed errors)."""
    from jaxexp_mlflow.codec import files

    try:
        meta = json.loads(
            files.read_file(
                root / rel_dir / "zarr.json",
                what=f"array metadata {rel_dir}/zarr.json",
                max_bytes=files.MAX_SMALL_FILE_BYTES,
            )
        )
    except (ValueError, RecursionError) as e:
        raise ArtifactError(
            f"The params array metadata {rel_dir}/zarr.json is not valid JSON "
            f"({type(e).__name__}). The checkpoint is damaged; download the model again."
        ) from None
    if not isinstance(meta, dict):
        raise _NoFastPath("zarr metadata")
    return meta


# Orbax's value types for leaves that hold no array (stored with skip_deserialize).
_EMPTY_NODES = ("None", "Dict", "List", "Tuple")


def _plain_tree(path: Path, meta: dict, manifest: Any) -> dict[tuple[str, ...], Any] | None:
    """The checkpoint's leaves ``{path tokens: ShapeDtypeStruct}`` read from ``_METADATA`` and
    each array's ``zarr.json`` alone, or None when the checkpoint holds anything but plain
    zarr3 arrays (OCDBT, custom leaf types, a format it does not know): then Orbax reads the
    metadata.

    Orbax's own metadata reader opens every array through TensorStore (~0.8 ms an array); this
    reads the same two JSON files, which the fast path needs anyway, so restore reads the
    checkpoint's metadata once.
    """
    import numpy as np

    tree = meta.get("tree_metadata")
    if meta.get("use_ocdbt", True) or not isinstance(tree, dict) or not tree:
        return None
    found: dict[tuple[str, ...], Any] = {}
    try:
        for entry in tree.values():
            value = entry["value_metadata"]
            kind = value.get("value_type")
            if kind in _EMPTY_NODES and value.get("skip_deserialize") is True:
                continue  # None or an empty container: no array, as in jax's flattening
            if kind not in ("jax.Array", "np.ndarray") or value.get("skip_deserialize"):
                return None
            tokens = tuple(str(k["key"]) for k in entry["key_metadata"])
            rel_dir = _param_dir_name(tokens)
            if not tokens or f"{rel_dir}/zarr.json" not in manifest.files:
                return None
            zmeta = _read_zarr_meta(path, rel_dir)
            shape = tuple(int(d) for d in zmeta["shape"])
            dtype = np.dtype(str(zmeta["data_type"]))
            if any(d < 0 for d in shape) or dtype.hasobject or tokens in found:
                return None
            found[tokens] = _LeafMeta(shape, dtype, zmeta)
    except (_NoFastPath, AttributeError, KeyError, TypeError, ValueError):
        return None  # Orbax judges (and refuses) what this does not understand
    return found


class _LeafMeta:
    """Shape, dtype and parsed zarr metadata of one stored array."""

    __slots__ = ("dtype", "shape", "zarr")

    def __init__(self, shape: tuple[int, ...], dtype: Any, zarr: dict) -> None:
        self.shape, self.dtype, self.zarr = shape, dtype, zarr


def _raise_mismatch(path: Path, problems: list[str]) -> None:
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ParamsMismatchError(
            f"The params checkpoint at {path} does not match the expected params "
            f"({len(problems)} difference(s)):\n  {shown}{more}\n"
            "Log the model again with params that match the exported function's first "
            "argument, or pass params of the right structure, shapes and dtypes."
        )


def check_checkpoint(directory: str | os.PathLike, target: Any) -> None:
    """Raise :class:`ParamsMismatchError` unless the checkpoint's arrays fit ``target``.

    Compares leaf paths (dict keys, sequence indices and attribute names alike, so a tuple in
    ``target`` matches the list Orbax stored), shapes and dtypes; reads metadata only. Every
    differing leaf is listed, e.g. ``params['w']: expected float32[784,10], found
    float32[784,12]``.
    """
    path = Path(directory)
    _raise_mismatch(path, _compare(checkpoint_tree(path), target))


def restore_params(
    directory: str | os.PathLike, *, target: Any, mapped: bool | dict[str, int] | None = False
) -> Any:
    """Read the checkpoint into jax arrays laid out as ``target``.

    ``target`` is a pytree of ``jax.ShapeDtypeStruct`` with the exact structure expected; when a
    leaf has ``.sharding`` the array is read straight into that sharding (each device reads only
    its shard), otherwise onto the first local device. A structure, shape or dtype difference
    raises :class:`ParamsMismatchError` listing every differing leaf; a missing or damaged
    checkpoint raises :class:`ArtifactError`.

    Uncompressed arrays bound for a single device are read by a fast path (one ``preadv``
    into a 64-byte aligned buffer that JAX adopts without a copy); every other leaf (sharded
    targets, zstd, OCDBT checkpoints) is restored by Orbax itself.

    ``mapped=True`` maps each array held whole in one file read-only instead of copying it
    (checksummed all the same): no new memory is touched. Only for a directory this process
    owns and nobody else writes, such as ``load_model``'s private download directory; a mapped
    file truncated by another process would kill this one (SIGBUS). ``mapped`` may also be a
    dict ``{file path relative to directory: CRC-32C}`` of checksums this process computed
    over those very files (as its download wrote them), used instead of reading them again.
    """
    import jax
    import orbax.checkpoint as ocp

    # None: copy; a dict (checksums already known, maybe none): map
    known = {} if mapped is True else (None if mapped is False else mapped)
    path = _require_item_dir(directory)
    manifest = verify_manifest(path)
    meta = _read_internal_metadata(path)
    plain = _plain_tree(path, meta, manifest)
    if plain is None:
        check_checkpoint(path, target)
    else:
        _raise_mismatch(path, _compare_flat(plain, target))
    _check_leaf_names(target)
    default_sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    ocdbt = bool(meta.get("use_ocdbt", (path / "manifest.ocdbt").exists()))
    stats = {"fast": 0, "orbax": 0}

    def fast(kp: Any, sds: Any) -> Any:
        sharding = getattr(sds, "sharding", None) or default_sharding
        if ocdbt or len(sharding.device_set) != 1:
            return ocp.PLACEHOLDER
        tokens = tuple(_key_token(k) for k in kp)
        leaf = plain.get(tokens) if plain is not None else None
        try:
            host = _fast_read_leaf(
                path,
                _param_dir_name(tokens),
                sds,
                manifest,
                leaf.zarr if leaf else None,
                known,
            )
        except _NoFastPath:
            return ocp.PLACEHOLDER
        except OSError as e:
            raise ArtifactError(
                f"Cannot read params{jax.tree_util.keystr(kp)} from {path}: expected a readable "
                f"array file, found {type(e).__name__}: {e}. Re-log the model with its params."
            ) from e
        stats["fast"] += 1
        return jax.device_put(host, sharding)

    restored = jax.tree_util.tree_map_with_path(fast, target)
    todo = jax.tree.map(
        lambda sds, r: sds if r is ocp.PLACEHOLDER else ocp.PLACEHOLDER, target, restored
    )
    manifest.verify_files()  # what the fast path did not read, before Orbax reads it
    if not any(x is not ocp.PLACEHOLDER for x in jax.tree.leaves(todo)):
        _LAST_RESTORE_STATS.update(stats)
        return restored

    def restore_arg(sds: Any) -> Any:
        if sds is ocp.PLACEHOLDER:
            return ocp.PLACEHOLDER
        stats["orbax"] += 1
        return ocp.ArrayRestoreArgs(
            restore_type=jax.Array,
            sharding=getattr(sds, "sharding", None) or default_sharding,
            global_shape=tuple(sds.shape),
            dtype=sds.dtype,
        )

    restore_args = jax.tree.map(restore_arg, todo)
    checkpointer = ocp.Checkpointer(checkpoint_handler())
    try:
        from_orbax = checkpointer.restore(
            path.absolute(), args=ocp.args.PyTreeRestore(item=todo, restore_args=restore_args)
        )
    except (ArtifactError, ParamsMismatchError):
        raise
    except Exception as e:  # tensorstore/orbax raise ValueError/OSError/... on damaged data
        raise ArtifactError(
            f"Cannot read the params checkpoint at {path}: expected intact Orbax array data, "
            f"found {type(e).__name__}: {e}. The artifact is damaged or incomplete; re-log the "
            "model with its params."
        ) from e
    finally:
        checkpointer.close()
    _LAST_RESTORE_STATS.update(stats)
    return jax.tree.map(lambda r, o: o if r is ocp.PLACEHOLDER else r, restored, from_orbax)


#: How the last restore_params call read its leaves ({"fast": n, "orbax": m}); for benchmarks
#: and tests.
_LAST_RESTORE_STATS: dict[str, int] = {}


def _find_item_dir(src: Path) -> Path:
    """``src`` itself, or the single PyTree item inside a CheckpointManager step directory."""
    if _is_item_dir(src):
        return src
    if not src.is_dir():
        raise ArtifactError(
            f"Not an Orbax checkpoint: expected a directory at {src}, found "
            f"{'nothing' if not src.exists() else 'a file'}. Pass the path of an Orbax checkpoint "
            "or of a CheckpointManager step (<root>/<step> or <root>/<step>/<item>)."
        )
    items = sorted(p for p in src.iterdir() if p.is_dir() and _is_item_dir(p))
    if len(items) == 1:
        return items[0]
    if len(items) > 1:
        named = [p for p in items if p.name in ("params", "default", "state")]
        if len(named) == 1:
            return named[0]
        raise ArtifactError(
            f"{src} is a CheckpointManager step with several items: expected one, found "
            f"{[p.name for p in items]}. Pass the item holding the params, e.g. "
            f"{items[0]}."
        )
    steps = sorted(
        (p for p in src.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)
    )
    hint = (
        f" It looks like a CheckpointManager root: pass a step, e.g. {steps[-1]}." if steps else ""
    )
    raise ArtifactError(
        f"Not an Orbax PyTree checkpoint: expected '{_PYTREE_METADATA_FILE}' in {src} or in one "
        f"of its subdirectories, found {sorted(p.name for p in src.iterdir())[:10]}.{hint}"
    )


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
    copied otherwise. Returns the same description as :func:`save_params`.
    """
    from jaxexp_mlflow.codec import files

    item = _find_item_dir(Path(src))
    # a link leading out of the checkpoint, a FIFO or a device is refused, never copied
    for _ in files.walk_files(item, ".", what="params checkpoint"):
        pass
    checkpoint_tree(item)  # validates that Orbax can read its metadata
    out = Path(dst)
    if out.exists():
        raise FileExistsError(
            f"Params directory {out} already exists: expected a new path. Choose another path "
            "or remove the existing one."
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(item, out, copy_function=_link_or_copy)
    _flatten_chunk_keys(out)
    _write_manifest(out)
    return describe_checkpoint(out)
