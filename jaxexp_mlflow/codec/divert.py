"""Hand Orbax's array writes to a sink instead of the disk (``log_model`` through a server).

While :func:`diverted` is active for a checkpoint directory, :func:`codec.params.save_params`
lets Orbax write everything as usual (``_METADATA``, ``_sharding``, each array's ``zarr.json``),
except the chunk files of arrays of at least ``min_bytes`` whose layout ``codec.shards`` can
make from the array itself: those are given to ``sink(rel, parts)``, with ``rel`` the file's
final path in the checkpoint (``w/c.0.0``) and ``parts`` its bytes as (the array's own buffer,
the shard index). The sink returns the file's CRC-32C, which the params manifest records;
:func:`sent_from_memory` tells the read-back which files were never written. They never exist
locally: the directory is a staging copy that is uploaded and deleted, and the upload sends
them from memory (``transfer.EarlyUpload``; docs/remote.md).

Orbax has no public hook for this. Numpy arrays go through ``NumpyHandler._open_and_write``
(overridden in this package's private type handler registry); jax arrays through
``serialization.async_serialize_from_host``, which is wrapped for the duration of the save and
only diverts the paths registered here, passing every other call through unchanged. With an
Orbax that has neither, nothing is diverted and Orbax writes the files.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

#: ``sink(final relative path, (buffer, shard index)) -> CRC-32C of the file``
Sink = Callable[[str, tuple[memoryview, bytes]], int]

#: Arrays smaller than this are written as usual (``diverted``'s default ``min_bytes``): few
#: bytes, and the small-file cost is the request, not the write.
MIN_BYTES = 1 << 20

_lock = threading.Lock()
_active: dict[Path, _Diversion] = {}  # checkpoint directory -> its diversion
_wrapped = 0  # saves using the async_serialize_from_host wrapper


class _Diversion:
    def __init__(self, path: Path, sink: Sink, min_bytes: int) -> None:
        self.path, self.sink, self.min_bytes = path, sink, min_bytes
        #: final relative path -> (size, CRC-32C) of each file given to the sink
        self.sent: dict[str, tuple[int, int]] = {}

    def owner(self, array_dir: Path) -> bool:
        """Whether ``array_dir`` is an array of this checkpoint (or of Orbax's temporary
        directory for it, ``<name>.orbax-checkpoint-tmp...``)."""
        parent = array_dir.parent
        return parent.parent == self.path.parent and (
            parent.name == self.path.name
            or parent.name.startswith(f"{self.path.name}.orbax-checkpoint-tmp")
        )

    def take(self, tspec: dict[str, Any], fragments: list[tuple[Any, Any]]) -> bool:
        """Give the array's chunk files to the sink if they can be made from memory."""
        from jaxexp_mlflow.codec import shards

        if sum(int(v.nbytes) for _, v in fragments) < self.min_bytes:
            return False
        chunks = shards.plan(tspec, fragments)
        if chunks is None:
            return False
        name = Path(tspec["kvstore"]["path"]).name
        for chunk in chunks:
            rel = f"{name}/{chunk.key.replace('/', '.')}"  # as codec.params flattens them
            data = shards.parts(chunk.value)
            crc = self.sink(rel, data)
            with _lock:
                self.sent[rel] = (data[0].nbytes + len(data[1]), crc)
        return True


def _find(tspec: dict[str, Any]) -> _Diversion | None:
    kvstore = tspec.get("kvstore") if isinstance(tspec, dict) else None
    if not isinstance(kvstore, dict) or kvstore.get("driver") != "file" or not _active:
        return None
    array_dir = Path(os.path.abspath(str(kvstore.get("path", "")).rstrip("/")))
    with _lock:
        return next((d for d in _active.values() if d.owner(array_dir)), None)


async def _create(tspec: dict[str, Any], context: Any, transaction: Any = None) -> None:
    """Create the array (its ``zarr.json``) as Orbax does before writing the data."""
    import tensorstore as ts

    await ts.open(ts.Spec(tspec), create=True, open=True, context=context, transaction=transaction)


def _numpy_handler_class() -> Any:
    import orbax.checkpoint as ocp

    base = ocp.type_handlers.NumpyHandler
    if not hasattr(base, "_open_and_write"):
        return None

    class DivertingNumpyHandler(base):
        """Orbax's ``NumpyHandler``; chunk files of diverted checkpoints go to the sink."""

        async def _open_and_write(self, value: Any, tspec: dict, ts_context: Any) -> None:
            diversion = _find(tspec)
            index = tuple(slice(0, n) for n in value.shape)
            if diversion is not None and diversion.take(tspec, [(index, value)]):
                await _create(tspec, ts_context)
                return
            await super()._open_and_write(value, tspec, ts_context)

    return DivertingNumpyHandler


def numpy_handler(**kwargs: Any) -> Any:
    """A ``NumpyHandler`` that diverts the arrays of registered checkpoints (Orbax's own one
    when this Orbax has no ``_open_and_write`` to override)."""
    import orbax.checkpoint as ocp

    cls = _numpy_handler_class() or ocp.type_handlers.NumpyHandler
    return cls(**kwargs)


def _serialization_module() -> Any:
    try:
        from orbax.checkpoint._src.serialization import serialization
    except ImportError:
        return None
    return serialization if hasattr(serialization, "async_serialize_from_host") else None


def _single_process() -> bool:
    """One JAX process writes the whole checkpoint (multi-host saves are left to Orbax)."""
    import jax

    return jax.process_count() == 1


def _wrap(original: Any) -> Any:
    async def async_serialize_from_host(rslices_on_host: Any, tensorstore_spec: Any, **kw: Any):
        diversion = _find(tensorstore_spec)
        if diversion is not None and _single_process():
            try:
                fragments = [(f.index, f.value) for f in rslices_on_host.to_fragments().fragments]
            except AttributeError:  # another Orbax: write as usual
                fragments = None
            if fragments and diversion.take(tensorstore_spec, fragments):
                await _create(tensorstore_spec, kw.get("context"), kw.get("transaction"))
                return
        return await original(rslices_on_host, tensorstore_spec, **kw)

    async_serialize_from_host.jaxexp_original = original
    return async_serialize_from_host


@contextlib.contextmanager
def diverted(
    path: str | os.PathLike, sink: Sink, min_bytes: int | None = None
) -> Iterator[_Diversion]:
    """While inside, an Orbax save of the checkpoint ``path`` (through this package's type
    handlers) gives the chunk files it can to ``sink``; yields what it gave (``.sent``)."""
    global _wrapped
    min_bytes = MIN_BYTES if min_bytes is None else min_bytes
    diversion = _Diversion(Path(os.path.abspath(path)), sink, min_bytes)
    module = _serialization_module()
    with _lock:
        _active[diversion.path] = diversion
        if module is not None:
            if _wrapped == 0:
                module.async_serialize_from_host = _wrap(module.async_serialize_from_host)
            _wrapped += 1
    try:
        yield diversion
    finally:
        with _lock:
            del _active[diversion.path]
            if module is not None:
                _wrapped -= 1
                if _wrapped == 0:
                    current = module.async_serialize_from_host
                    module.async_serialize_from_host = current.jaxexp_original


#: The sink of this context's saves, and what each diverted checkpoint sent: {path: {rel: (size,
#: CRC-32C)}}.
_SENDING: contextvars.ContextVar[tuple[Sink, dict[Path, dict]] | None] = contextvars.ContextVar(
    "jaxexp_divert_sink", default=None
)


@contextlib.contextmanager
def sending(sink: Sink) -> Iterator[None]:
    """While inside, ``codec.params.save_params`` in this context diverts what it can to
    ``sink`` (``transfer.EarlyUpload.send_memory``), and the read-back of those checkpoints
    knows which files went up from memory (:func:`sent_from_memory`)."""
    token = _SENDING.set((sink, {}))
    try:
        yield
    finally:
        _SENDING.reset(token)


def current_sink() -> Sink | None:
    """The sink set by :func:`sending` in this context, if any."""
    state = _SENDING.get()
    return None if state is None else state[0]


def record(path: str | os.PathLike, sent: dict[str, tuple[int, int]]) -> None:
    """Remember what the save of ``path`` sent from memory (for :func:`sent_from_memory`)."""
    state = _SENDING.get()
    if state is not None:
        state[1][Path(os.path.realpath(path))] = dict(sent)


def sent_from_memory(path: str | os.PathLike) -> dict[str, tuple[int, int]]:
    """``{rel: (size, CRC-32C)}`` of the chunk files of checkpoint ``path`` that this context's
    save sent from memory: they are in its manifest but were never written to ``path``."""
    state = _SENDING.get()
    return {} if state is None else state[1].get(Path(os.path.realpath(path)), {})
