"""Compiled executables of pyfunc buckets, stored so that a warm first call skips lowering.

JAX's persistent cache is keyed by the lowered module: a hit still traces and lowers the
function (~0.35 s for the first function of a process, most of it one-time imports of MLIR
dialects), then reads the executable. ``Executables`` keys each compiled bucket by what
determines the lowering instead (the verified blob digest, the MLmodel section, the wrapper's
code, argument avals, JAX/XLA versions, flags and config, the host CPU), so a process that
finds its entry loads the executable without lowering. Entries live in the subdirectory
``jaxexp-executables`` of the compilation cache directory in use (local, absolute directories
only), in the format of ``runtime/entries.py``: authenticated with this user's secret, so an
entry runs only if a process of this user wrote it under that very name; the model directory
never chooses where they live.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from jaxexp_mlflow.runtime import entries
from jaxexp_mlflow.runtime.cache import host_cpu
from jaxexp_mlflow.runtime.capacity import (  # noqa: F401  (their home before)
    DEFAULT_MAX_SHAPES,
    ENV_MAX_SHAPES,
    max_shapes,
    release_freed_memory,
)

_logger = logging.getLogger(__name__)

#: Custom calls an executable may hold and still skip lowering: compile-time annotations and
#: shape checks. Others (LAPACK on CPU: its FFI handlers are initialised while lowering) make the
#: model take the plain ``jax.jit`` path.
STORABLE_CUSTOM_CALLS = frozenset(
    {
        "shape_assertion",
        "Sharding",
        "SPMDFullToShardShape",
        "SPMDShardToFullShape",
        "annotate_device_placement",
    }
)
EXEC_SUBDIR = "jaxexp-executables"
EXEC_MAX_ENTRIES = entries.MAX_ENTRIES


def executable_dir() -> Path | None:
    """Where compiled executables are kept: a subdirectory of the local compilation cache
    directory in use, or None (cache off, or a remote cache such as ``gs://``)."""
    import jax

    current = jax.config.values.get("jax_compilation_cache_dir")
    if not current or "://" in str(current):
        return None
    directory = Path(os.path.expanduser(str(current)))
    if not directory.is_absolute():  # never a directory of the working directory's choosing
        return None
    return directory / EXEC_SUBDIR


def environment_key() -> dict[str, Any]:
    """What of this process determines a compiled executable besides the function itself."""
    import jax
    import jaxlib

    from jaxexp_mlflow.runtime import cpu_compile

    devices = jax.devices()
    client = devices[0].client
    return {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "platform": [client.platform, client.platform_version],
        "devices": [[d.id, d.device_kind, d.process_index] for d in devices],
        "env": {k: os.environ.get(k) for k in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")},
        "config": sorted((k, repr(v)) for k, v in jax.config.values.items()),
        "cpu": host_cpu(),
        "cpu_compile": cpu_compile.settings(),
    }


def _entry_path(directory: Path, digest: str) -> Path:
    return directory / f"{digest}.bin"


def read_executable(digest: str, in_tree: Any, out_tree: Any) -> Any:
    """The ``jax.stages.Compiled`` stored under ``digest``, or None (absent, not ours, damaged)."""
    directory = executable_dir()
    if directory is None:
        return None
    try:
        entry = entries.read_entry(_entry_path(directory, digest))
    except OSError:
        return None
    if entry is None:
        return None
    from jax.experimental import serialize_executable

    try:
        return serialize_executable.deserialize_and_load(entry[1], in_tree, out_tree)
    except Exception as err:  # a stale or damaged entry: compile instead
        _logger.debug("jaxexp: cached executable %s unusable: %s", digest[:16], err)
        return None


def write_executable(
    digest: str, compiled: Any, args: tuple, outs: Any, recompile: Any = None
) -> bool:
    """Store ``compiled`` under ``digest`` (atomically) if it survives the trip: serialized,
    loaded back in this process and called on ``args``, it must give ``outs`` (its own outputs
    on them) bit for bit. An executable that JAX's persistent cache handed back serializes
    without its kernels on XLA:CPU (jax 0.10.2 and 0.12.0.1: "Function ... not found" when
    called), so a stored entry is proved, never assumed. When the trip fails, ``recompile()``
    (if given) compiles the same computation where that cache cannot answer, and its executable
    makes the trip once more. Whether it was stored; never fails the caller."""
    directory = executable_dir()
    if directory is None:
        return False
    from jax.experimental import serialize_executable

    for attempt in (0, 1):
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(compiled)
        except Exception as err:  # e.g. an executable that cannot be serialized
            _logger.debug("jaxexp: executable %s not stored: %s", digest[:16], err)
            return False
        try:
            again = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
            same = _same_outputs(again(*args), outs)
            why = "it differs once reloaded"
        except Exception as err:  # noqa: BLE001 - e.g. handed back by JAX's cache: no kernels
            same, why = False, str(err).splitlines()[0][:200] if str(err) else repr(err)
        if same:
            try:
                entries.write_entry(directory, _entry_path(directory, digest), payload)
                entries.prune(directory, "*.bin", EXEC_MAX_ENTRIES)
            except OSError as err:  # e.g. a full disk
                _logger.debug("jaxexp: executable %s not stored: %s", digest[:16], err)
                return False
            return True
        _logger.debug("jaxexp: executable %s not stored: %s", digest[:16], why)
        if recompile is None or attempt:
            return False
        try:
            compiled = recompile()
        except Exception as err:  # noqa: BLE001 - the entry stays missing, nothing else
            _logger.debug("jaxexp: executable %s not compiled again: %s", digest[:16], err)
            return False
    return False


def jit_named(fn: Any, name: str, *, fresh: bool = False) -> Any:
    """``jax.jit(fn)`` as a function called ``name`` (``fresh``: with 8 random hex digits of its
    own appended). A compile made for one of our stores is named after its entry: JAX's
    persistent cache keys a compile by its module, which holds the name, and an executable
    that cache hands back cannot be stored (:func:`write_executable`)."""
    import jax

    fn.__name__ = fn.__qualname__ = name + (f"_{os.urandom(4).hex()}" if fresh else "")
    return jax.jit(fn)


def store_later(digest: str, compiled: Any, args: tuple, outs: Any, recompile: Any = None) -> None:
    """:func:`write_executable` on the store's one worker thread: the caller already has its
    outputs, so serializing, proving and writing (~45 ms for a 24-layer MLP) stay off its first
    call. The inputs are copied (a caller may reuse its buffers); :func:`flush` waits for what
    is queued, and runs at interpreter exit so that a normal exit finishes its writes. A
    forked child (which inherits the queue but not the thread) starts its own."""
    leaves = tuple(np.array(x, copy=True) if isinstance(x, np.ndarray) else x for x in args)
    _queue().put((digest, compiled, leaves, outs, recompile))


def run_later(job: Any) -> None:
    """Run ``job()`` on the store's worker thread (after what is queued; :func:`flush` waits
    for it too): work that may follow a first call, off the caller's path."""
    _queue().put(job)


def _queue() -> Any:
    """The store's job queue, its worker started once per process."""
    import atexit
    import queue

    global _QUEUE, _QUEUE_PID
    with _QUEUE_LOCK:
        if _QUEUE is None or _QUEUE_PID != os.getpid():
            _QUEUE, _QUEUE_PID = queue.Queue(), os.getpid()
            threading.Thread(
                target=_store_worker, args=(_QUEUE,), name="jaxexp-store", daemon=True
            ).start()
            atexit.register(flush)
        return _QUEUE


def flush() -> None:
    """Wait until every executable queued by :func:`store_later` is stored (or refused)."""
    jobs = _QUEUE
    if jobs is not None and _QUEUE_PID == os.getpid():
        jobs.join()


def _store_worker(jobs: Any) -> None:
    while True:
        job = jobs.get()
        try:
            if callable(job):
                job()
            else:
                write_executable(*job)
        finally:
            del job
            jobs.task_done()


_QUEUE: Any = None
_QUEUE_PID = 0
_QUEUE_LOCK = threading.Lock()


def remove_executable(digest: str) -> None:
    """Drop the entry stored under ``digest`` (one that failed when called)."""
    directory = executable_dir()
    if directory is not None:
        _entry_path(directory, digest).unlink(missing_ok=True)


def _same_outputs(a: Any, b: Any) -> bool:
    import jax

    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            return False
    return True


class Executables:
    """``jitted(params, *leaves)`` through one compiled executable per input shape.

    ``jitted`` is a ``jax.jit`` function of ``(params, *leaves)`` returning a list of arrays.
    Calls with the bound ``params`` and numpy leaves run the executable compiled for their
    shapes and dtypes: found in memory, else in the executable store (no lowering), else
    lowered and compiled now (through JAX's persistent cache) and stored. Any other call goes
    to ``jitted`` itself. ``compiles`` counts the executables lowered here, ``loaded`` those
    read from the store (for tests). Like a ``jax.stages.Compiled``, a bucket keeps the JAX
    configuration of its first call: a later ``jax.config`` change does not recompile it.

    At most ``capacity`` executables are kept, the least recently used evicted first: an
    unusual shape costs a compile (or a load from the store), never unbounded memory. With
    ``store=False`` nothing is read from or written to the store (no local cache directory, or
    custom calls whose executables do not survive serialization). ``renew()``, when given,
    makes a new ``jitted`` after an eviction (see ``_keep``).
    """

    def __init__(
        self,
        jitted: Any,
        params: Any,
        identity: dict[str, Any],
        n_out: int,
        *,
        capacity: int | None = None,
        store: bool = True,
        renew: Any = None,
    ) -> None:
        from collections import OrderedDict

        self._jit = jitted
        self._params = params
        self._identity = identity
        self._n_out = n_out
        self._by_shape: OrderedDict[tuple, Any] = OrderedDict()
        self.capacity = max_shapes() if capacity is None else max(int(capacity), 1)
        self._store = store
        self._renew = renew
        self._lock = threading.Lock()
        self._key_locks: dict[tuple, threading.Lock] = {}
        self._base: str | None = None
        self.compiles = 0
        self.loaded = 0
        #: called as ``on_first(leaves, outs)`` after each shape's first call (e.g. the lite
        #: store's writer, serving/lite_pyfunc.py); never on the hot path
        self.on_first: Any = None

    def _get(self, key: tuple) -> Any:
        """The executable kept for ``key`` (now the most recently used), or None."""
        exe = self._by_shape.get(key)
        if exe is not None:
            try:
                self._by_shape.move_to_end(key)
            except KeyError:  # evicted by another thread meanwhile: still callable
                pass
        return exe

    def _cache_size(self) -> int:
        """How many shapes have an executable kept (``jax.jit``'s name for its own count)."""
        return len(self._by_shape)

    def _keep(self, key: tuple, exe: Any) -> None:
        """Keep ``exe`` for ``key``, evicting the least recently used past ``capacity``
        (under the lock: another shape may be kept meanwhile)."""
        with self._lock:
            self._keep_locked(key, exe)

    def _keep_locked(self, key: tuple, exe: Any) -> None:
        self._by_shape[key] = exe
        evicted = False
        while len(self._by_shape) > self.capacity:
            self._by_shape.popitem(last=False)
            evicted = True
        if evicted:
            if self._renew is not None:
                # JAX keeps what it traced, lowered and compiled for a shape in caches tied to
                # the jitted function (thousands of entries): a new function leaves the old
                # one's entries to be freed with it, so eviction frees the executable itself
                self._jit = self._renew()
            release_freed_memory()

    def __call__(self, params: Any, *leaves: Any) -> Any:
        # the one-array case first and short: it runs on every request
        if params is self._params and len(leaves) == 1 and type(leaves[0]) is np.ndarray:
            x = leaves[0]
            exe = self._get((x.shape, x.dtype))
            if exe is not None:
                return exe(params, x)
        return self._call(params, leaves)

    def _call(self, params: Any, leaves: tuple) -> Any:
        if params is not self._params or any(type(x) is not np.ndarray for x in leaves):
            return self._jit(params, *leaves)
        key = _key(leaves)
        exe = self._get(key)
        if exe is None:
            with self._key_lock(key):  # one shape's compile never waits on another's
                exe = self._get(key)
                if exe is None:
                    return self._first_call(key, leaves)
        return exe(params, *leaves)

    def _key_lock(self, key: tuple) -> threading.Lock:
        with self._lock:
            lock = self._key_locks.get(key)
            if lock is None:
                lock = self._key_locks[key] = threading.Lock()
            return lock

    def prepare(self, params: Any, *leaves: Any) -> None:
        """Load (else compile) the executable for these shapes without calling it: a server's
        precompile. Running it there would cost a whole call per bucket (for a generate loop at
        batch 1024, minutes of both cores); its first real call proves and stores it instead."""
        if params is not self._params or any(type(x) is not np.ndarray for x in leaves):
            return
        import jax

        key = _key(leaves)
        with self._key_lock(key):
            if self._get(key) is not None:
                return
            args = (params, *leaves)
            digest = self._digest(_shapes(leaves))
            exe = None
            if self._store:
                out_tree = jax.tree.structure([0] * self._n_out)
                exe = read_executable(digest, jax.tree.structure((args, {})), out_tree)
            stored = exe is not None
            if stored:
                self.loaded += 1
            else:
                from jaxexp_mlflow.runtime import cpu_compile

                exe = cpu_compile.compile_lowered(self._lower(digest, args))[0]
                self.compiles += 1
            self._keep(key, _Prepared(self, key, exe, stored))

    def executable(self, x: np.ndarray) -> Any:
        """The executable a call with the bound params and the one array ``x`` runs, once
        compiled or loaded (``None`` before, or when such calls go to ``jitted``)."""
        key = (x.shape, x.dtype)
        by_shape = self._by_shape  # inlined _get: this runs on every single-array predict
        exe = by_shape.get(key)
        if exe is None or exe is self._jit:
            return None
        try:
            by_shape.move_to_end(key)
        except KeyError:  # evicted by another thread meanwhile: still callable
            pass
        return exe

    def temp_bytes(self, *leaves: np.ndarray) -> int | None:
        """The temporaries one call with the bound params and these numpy ``leaves`` allocates
        (XLA's ``memory_analysis``), loading or compiling its executable if need be; None where
        it cannot tell (such calls go to ``jitted``, or the executable does not say)."""
        self.prepare(self._params, *leaves)
        key = _key(leaves)
        exe = self._by_shape.get(key)
        exe = exe.exe if isinstance(exe, _Prepared) else exe
        if exe is None or exe is self._jit:
            return None
        try:
            return int(exe.memory_analysis().temp_size_in_bytes)
        except Exception:  # noqa: BLE001 - an executable or backend without the analysis
            return None

    @property
    def function(self) -> Any:
        """The Python function ``jitted`` traces (None when it says none)."""
        return getattr(self._jit, "__wrapped__", None)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """``jitted.lower``."""
        return self._jit.lower(*args, **kwargs)

    def _first_call(self, key: tuple, leaves: tuple, prepared: _Prepared | None = None) -> Any:
        """Load (else compile, then store) the executable for ``key`` and make its first call
        (``prepared``: the one :meth:`prepare` loaded or compiled).

        A stored executable that fails when called (an entry written by an earlier release, a
        JAX that cannot run it) is removed and compiled again; arguments an executable does not
        take as given go to ``jitted``, which decides.
        """
        import jax

        digest = self._digest(_shapes(leaves))
        args = (self._params, *leaves)
        if prepared is not None:
            exe = prepared.exe if prepared.stored else None
        else:
            in_tree = jax.tree.structure((args, {}))
            out_tree = jax.tree.structure([0] * self._n_out)
            exe = read_executable(digest, in_tree, out_tree) if self._store else None
        if exe is not None:
            try:
                outs = jax.block_until_ready(exe(*args))
            except TypeError:
                return self._to_jit(key, args)
            except Exception as err:  # noqa: BLE001 - jax.errors.JaxRuntimeError and kin
                _logger.warning(
                    "jaxexp: a stored executable failed when called (%s); compiling the "
                    "bucket again",
                    (str(err).splitlines() or [type(err).__name__])[0][:200],
                )
                remove_executable(digest)
                self.loaded -= prepared is not None  # prepare counted it: not kept after all
            else:
                self.loaded += prepared is None
                self._keep(key, exe)
                self._first_done(leaves, outs)
                return outs
        if prepared is not None and not prepared.stored:
            exe = prepared.exe
        else:
            from jaxexp_mlflow.runtime import cpu_compile

            exe = cpu_compile.compile_lowered(self._lower(digest, args))[0]
            self.compiles += 1
        try:
            outs = exe(*args)
        except TypeError:
            return self._to_jit(key, args)
        self._keep(key, exe)
        if self._store:
            from jaxexp_mlflow.runtime import cpu_compile

            def recompile() -> Any:
                return cpu_compile.compile_lowered(self._lower(digest, args, fresh=True))[0]

            store_later(digest, exe, args, outs, recompile)
        self._first_done(leaves, outs)
        return outs

    def _lower(self, digest: str, args: tuple, *, fresh: bool = False) -> Any:
        """``jitted`` lowered for ``args``; with the store on, as a function named after the
        store entry ``digest``. JAX's persistent cache keys a compile by its module, and an
        executable it hands back serializes without its kernels on XLA:CPU (see
        :func:`write_executable`): under its entry's name, a bucket's compile comes from that
        cache only if it was compiled for this very entry before, not for a twin entry (the
        same module in another environment, e.g. ``JAX_PLATFORMS`` set or not), which left
        the bucket unstorable for good."""
        if not self._store:
            return self._jit.lower(*args)
        jitted = self._jit

        def bucket(*a: Any) -> Any:
            return jitted(*a)

        return jit_named(bucket, f"jaxexp_bucket_{digest[:16]}", fresh=fresh).lower(*args)

    def _first_done(self, leaves: tuple, outs: Any) -> None:
        hook = self.on_first
        if hook is not None:
            try:
                hook(leaves, outs)
            except Exception as err:  # noqa: BLE001 - a hook never fails the call
                _logger.debug("jaxexp: on_first hook failed: %s", err)

    def _to_jit(self, key: tuple, args: tuple) -> Any:
        self._keep(key, self._jit)
        return self._jit(*args)

    def _digest(self, shapes: tuple) -> str:
        import hashlib
        import json

        if self._base is None:
            base = {**self._identity, "environment": environment_key()}
            self._base = json.dumps(base, sort_keys=True, default=str)
        args = [[list(shape), str(dtype)] for shape, dtype in shapes]
        return hashlib.sha256((self._base + json.dumps(args)).encode()).hexdigest()


class _Prepared:
    """An executable :meth:`Executables.prepare` loaded or compiled and nobody called yet: its
    first call goes through ``_first_call`` (checked, stored), which keeps the bare one."""

    __slots__ = ("owner", "key", "exe", "stored")

    def __init__(self, owner: Executables, key: tuple, exe: Any, stored: bool) -> None:
        self.owner, self.key, self.exe, self.stored = owner, key, exe, stored

    def __call__(self, params: Any, *leaves: Any) -> Any:
        return self.owner._first_call(self.key, leaves, prepared=self)


def _key(leaves: tuple) -> tuple:
    """The executable's key for these leaves: ``(shape, dtype)`` of one, else of each."""
    return (leaves[0].shape, leaves[0].dtype) if len(leaves) == 1 else _shapes(leaves)


def _shapes(leaves: tuple) -> tuple:
    return tuple([(x.shape, x.dtype) for x in leaves])


def _code_key(fn: Any) -> str:
    """A digest of the Python code ``fn`` (a ``jax.jit`` function) traces."""
    import hashlib
    import types

    code = getattr(getattr(fn, "__wrapped__", fn), "__code__", None)
    if code is None:
        return repr(fn)
    consts = [c for c in code.co_consts if not isinstance(c, types.CodeType)]  # no addresses
    text = repr((consts, code.co_names, code.co_freevars)).encode()
    return hashlib.sha256(code.co_code + text).hexdigest()


def executables(
    jitted: Any, model: Any, n_out: int, *, capacity: int | None = None, renew: Any = None
) -> Any:
    """``jitted`` (a ``jax.jit`` function of ``(model.params, *leaves)``) behind an
    :class:`Executables` keyed by ``model`` and keeping at most ``capacity`` shapes; without a
    local cache directory, or when the blob's custom calls are unknown or not all in
    ``STORABLE_CUSTOM_CALLS``, nothing is read from or written to the store."""
    import jax

    from jaxexp_mlflow import __version__

    targets = getattr(model, "custom_call_targets", None)
    store = executable_dir() is not None and targets is not None
    store = store and STORABLE_CUSTOM_CALLS.issuperset(targets)
    params = jax.tree.leaves(model.params) if model.has_params else []
    identity = {
        "jaxexp": __version__,
        "code": _code_key(jitted),
        "section": model.metadata,
        "route": getattr(model, "route", None),
        "params_tree": str(jax.tree.structure(model.params)),
        "params": [[list(p.shape), str(p.dtype), str(p.sharding)] for p in params],
    }
    return Executables(
        jitted, model.params, identity, n_out, capacity=capacity, store=store, renew=renew
    )
