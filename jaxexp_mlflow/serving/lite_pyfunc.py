"""The lite pyfunc: a fresh process answers its first predictions without importing jax.

``import jax`` is ~0.35 s of a fresh process, more than the whole load of an ``mlflow.onnx``
model. A model whose batch buckets an earlier process stored in the lite store
(``runtime/lite.py``: executables with the params folded in as constants) is loaded here from
its MLmodel alone, and a numpy batch of the input's exact dtype and shape is padded to its
bucket and run on jaxlib's CPU client (``internals/jaxlib_private.py``); another numpy dtype is
cast (or refused) by the contract's ``convert`` first, as on the JAX path. Anything else
(another input form, a bucket not stored, a batch over the largest bucket, any attribute besides
``predict``) loads the model through jax as always, once, and goes there from then on: the
answers and the errors are the JAX path's.

Entries are written by the JAX path (:func:`LiteWriter`) in a process that had not imported jax
before the load, for each bucket on its first call, in the background: the folded executable
must give the jitted function's outputs within ``archive.reproduce.DEFAULT_TOLERANCES`` and,
reloaded through jaxlib, the same bytes. See docs/serving/batching.md ("Start-up: the lite store").
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import math
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from jaxexp_mlflow import settings
from jaxexp_mlflow.internals.jaxlib_private import LiteUnavailable
from jaxexp_mlflow.runtime import buckets as buckets_mod
from jaxexp_mlflow.runtime import lite
from jaxexp_mlflow.runtime import rows as rows_mod
from jaxexp_mlflow.serving import background
from jaxexp_mlflow.serving.casts import convert

_logger = logging.getLogger(__name__)

#: "0": a server loaded lite stays lite until a request needs jax (default: its first request
#: starts loading through jax in the background, and the other buckets compile meanwhile)
ENV_LITE_SERVER_UPGRADE = "JAXEXP_LITE_SERVER_UPGRADE"
_GPU_PLUGINS = ("jax_plugins", "jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm7_plugin")


def cpu_only() -> bool:
    """Whether jax would run on the CPU here: ``JAX_PLATFORMS=cpu``, or unset with no
    accelerator plugin installed."""
    platforms = os.environ.get("JAX_PLATFORMS")
    if platforms is not None:
        return platforms.strip().lower() == "cpu"
    if importlib.util.find_spec("libtpu") is not None:
        return False
    return all(importlib.util.find_spec(name) is None for name in _GPU_PLUGINS)


def _plain(dtype: np.dtype) -> bool:
    """A dtype numpy's DLPack reads (no bfloat16 and kin, no strings)."""
    return dtype.kind in "biufc" and dtype.type.__module__ == "numpy"


def shape_of(flavor: dict[str, Any], config: dict[str, Any], serving: bool) -> Any:
    """``(input spec, output spec, bucket policy)`` when the model takes the lite path's one
    case (one batched array in, one out, rows proven independent, one CPU device, the JAX
    backend, no classifier); else None."""
    from jaxexp_mlflow.serving import signature as sig

    saved = dict(flavor.get("serving") or {})
    backend = config.get("backend", settings.JAXEXP_BACKEND.get(saved.get("backend")))
    if str(backend or "jax").lower() != "jax" or flavor.get("classifier") is not None:
        return None
    if int(flavor.get("nr_devices") or 1) != 1 or "cpu" not in (flavor.get("platforms") or []):
        return None
    if any(k in config for k in ("route", "data_parallel", "allow_other_platform")):
        return None
    try:
        specs = sig.specs_from_conf(flavor)
    except Exception:  # noqa: BLE001 - the JAX path reports a damaged section, typed
        return None
    if specs is None or len(specs[0]) != 1 or len(specs[1]) != 1:
        return None
    (spec,), (out,) = specs
    if not rows_mod.proven(flavor) or len(spec.shape) < 1 or spec.shape[0] is not None:
        return None
    if (
        None in spec.shape[1:]
        or None in out.shape[1:]
        or not (_plain(spec.dtype) and _plain(out.dtype))
    ):
        return None
    policy = buckets_mod.resolve(config, saved, serving=serving)
    symbol = buckets_mod.batch_symbol([spec.symbols], [out.symbols])
    if not policy.enabled or symbol is None:
        return None
    return spec, out, policy


class LitePyfunc:
    """A pyfunc implementation that runs stored lite executables until it needs jax.

    ``upgrade_later`` (a scoring server): the first ``predict`` starts loading through jax in
    the background (answering itself from the store where it can), so that the server's other
    buckets compile meanwhile as they do for a server loaded through jax, after ``/ping``.
    """

    def __init__(
        self,
        spec: Any,
        out: Any,
        policy: Any,
        found: dict[int, tuple[Path, str]],
        full: Any,
        *,
        allow_nan: bool,
        upgrade_later: bool = False,
    ) -> None:
        self._found = found  # bucket size -> (directory, key) of its stored entry
        self._exes: dict[int, Any] = {}
        self._load_full = full
        self._full: Any = None
        self._lock = threading.Lock()
        self.backend = "jax-lite"
        target, tail = spec.dtype, tuple(spec.shape[1:])
        rank, largest, bucket_for = len(spec.shape), policy.largest, policy.bucket_for
        out_shape, out_dtype = tuple(out.shape[1:]), out.dtype
        wire = None if out.wire_dtype == out.dtype else out.wire_dtype
        floats = not allow_nan and target.kind in "fc"
        pad_rows, ndarray = buckets_mod.pad_rows, np.ndarray
        finite_number, all_true, isfinite = math.isfinite, np.logical_and.reduce, np.isfinite
        exes = self._exes

        def run(x: np.ndarray, n: int) -> Any:
            size = bucket_for(n)
            exe = exes.get(size)
            if exe is None:
                exe = self._executable(size, (size, *out_shape), out_dtype)
                if exe is None:
                    return None
            try:
                out = exe([np.ascontiguousarray(x if size == n else pad_rows(x, size))])[0]
            except LiteUnavailable:  # a forked child: through jax from now on
                exes.clear()
                self._found.clear()
                return None
            out = out if size == n else out[:n]
            return out if wire is None else out.astype(wire)

        def accept(data: np.ndarray) -> np.ndarray:
            """The JAX path's single-array check: the array as it is, else ``convert``'s cast
            (which raises its typed error for what it refuses, as the JAX path does)."""
            shape = data.shape
            if data.dtype == target and shape[1:] == tail and 0 < shape[0]:
                if not floats:
                    return data
                if data.size <= 32:
                    if finite_number(sum(data.ravel().tolist())):
                        return data
                elif all_true(isfinite(data), axis=None):
                    return data
            return convert(data, spec, allow_nan=allow_nan)

        kick = [bool(upgrade_later)]  # a server loads jax meanwhile, from its first request

        def predict(data: Any, params: dict[str, Any] | None = None) -> Any:
            if kick[0]:
                kick[0] = False
                self.upgrade_in_background()
            if self._full is None and type(data) is ndarray and data.ndim == rank:
                x = accept(data)
                n = x.shape[0]
                if n <= largest:
                    got = run(x, n)
                    if got is not None:
                        return got
            return self._upgrade().predict(data, params)

        predict.__signature__ = inspect.signature(predict)  # type: ignore[attr-defined]
        self.predict = predict

    def _executable(self, size: int, shape: tuple, dtype: np.dtype) -> Any:
        """The stored executable of bucket ``size`` (loaded once), or None (not stored,
        damaged, or this jaxlib cannot run it)."""
        from jaxexp_mlflow.internals import jaxlib_private

        where = self._found.get(size)
        if where is None:
            return None
        with self._lock:
            exe = self._exes.get(size)
            if exe is not None or self._full is not None:  # loaded through jax meanwhile
                return exe
            entry = lite.read_entry(*where)
            if entry is None:  # not ours (no valid HMAC), damaged: through jax, then rewritten
                self._found.pop(size, None)
                return None
            header, payload = entry
            if header.get("output") != [list(shape), str(dtype)]:
                return None
            try:
                exe = jaxlib_private.CpuExecutable(payload, [(shape, dtype)])
            except jaxlib_private.LiteUnavailable as err:
                _logger.info("jaxexp: lite executable unusable (%s); loading through jax", err)
                lite.remove_entry(*where)
                return None
            self._exes[size] = exe
            return exe

    def _upgrade(self) -> Any:
        """The model loaded through jax (once): every call goes there from now on."""
        with self._lock:
            if self._full is None:
                self._full = self._load_full()
                self._exes.clear()
            return self._full

    def upgrade_in_background(self) -> threading.Thread:
        """Load through jax on a background thread (a server's other buckets then compile
        meanwhile, as a server loaded through jax does); a failure is logged, and met again,
        typed, by the request that needs it."""

        def upgrade() -> None:
            if background.stopping():  # the process is exiting
                return
            try:
                self._upgrade()
            except Exception as err:  # noqa: BLE001 - a request meets it again
                _logger.warning("jaxexp: loading the model through jax failed: %s", err)

        return background.start(upgrade, name="jaxexp-lite-upgrade")

    def __getattr__(self, name: str) -> Any:
        # anything besides predict (the raw model, the contract, the buckets): the JAX path's
        if name.startswith("__") or name in ("_full", "_lock", "_load_full"):
            raise AttributeError(name)
        return getattr(self._upgrade(), name)


def load(
    model_dir: Path,
    config: dict[str, Any],
    model_files: Any,
    identity: tuple,
    load_full: Any,
    register: Any,
    serving: bool,
) -> Any:
    """The pyfunc implementation of a model: a :class:`LitePyfunc` where :func:`try_lite` gives
    one (``register``-ed by its MLmodel ``model_uuid``), else ``load_full(model_dir, config,
    model_files)`` (``serving.pyfunc._load_uncached``), with a :class:`LiteWriter` attached
    when jax was not imported before (the process stores its buckets for the lite path).
    ``serving``: whether this process is a scoring server (its bucket policy)."""
    import sys

    if "jax" in sys.modules:  # jax's configuration may not be the environment's alone
        return load_full(model_dir, config, model_files)

    def full() -> Any:
        fresh = "jax" not in sys.modules
        impl = load_full(model_dir, config, model_files)
        if fresh:
            attach_writer(impl, model_files.flavor, config, identity)
        return impl

    impl = try_lite(model_files.flavor, config, identity, full, serving)
    if impl is None:
        return full()
    register(model_files.mlmodel.get("model_uuid"), impl)
    return impl


def try_lite(
    flavor: dict[str, Any], config: dict[str, Any], identity: tuple, full: Any, serving: bool
) -> LitePyfunc | None:
    """A :class:`LitePyfunc` when jax is not imported yet, the model takes the lite path's case
    and at least one of its buckets is stored; else None (load through jax)."""
    import sys

    from jaxexp_mlflow.internals import jaxlib_private

    if "jax" in sys.modules or not lite.enabled() or not cpu_only():
        return None
    shaped = shape_of(flavor, config, serving)
    if shaped is None:
        return None
    spec, out, policy = shaped
    directory = lite.lite_dir(
        config.get("compilation_cache", (flavor.get("serving") or {}).get("compilation_cache"))
    )
    if directory is None or not directory.is_dir() or not jaxlib_private.available():
        return None
    ident = lite_identity(identity, flavor)
    if ident is None:
        return None
    env = lite.environment()
    found = {}
    for size in policy.sizes:
        key = lite.entry_key(ident, env, (size, *spec.shape[1:]), spec.dtype)
        if lite.has_entry(directory, key):
            found[size] = (directory, key)
    if not found:
        return None
    allow = config.get(
        "allow_nan",
        settings.JAXEXP_ALLOW_NAN.get((flavor.get("serving") or {}).get("allow_nan")),
    )
    allow_nan = str(allow).lower() in ("1", "true", "on", "yes")
    later = serving and settings.JAXEXP_LITE_SERVER_UPGRADE.get()
    _logger.info("jaxexp: buckets %s run without jax (the lite store)", sorted(found))
    return LitePyfunc(spec, out, policy, found, full, allow_nan=allow_nan, upgrade_later=later)


#: model_config keys and variables that change how a model is served, not its executables
_SERVING_ONLY = ("buckets", "max_batch", "precompile", "allow_nan", "max_request_bytes")
_SERVING_ONLY_ENV = (
    "JAXEXP_COMPILATION_CACHE",
    "JAXEXP_LITE",
    "JAXEXP_PYFUNC_CACHE",
    "JAXEXP_MAX_",
    "JAXEXP_SERVE_",
    "JAXEXP_BODY_TIMEOUT_S",
    "JAXEXP_PROGRESS",
    "JAXEXP_DEBUG",
    "JAXEXP_TRANSFER_",
    "JAXEXP_FSYNC_",
    "JAXEXP_EARLY_UPLOAD",
    "JAXEXP_IREE_",
)


def lite_identity(identity: tuple, flavor: dict[str, Any]) -> list | None:
    """The model identity of ``serving.pyfunc.model_identity`` (real path, MLmodel, blob and
    manifest digests, config, ``JAXEXP_*`` variables, whether serving) with the path replaced
    by the params' content (``lite.params_digest``: a folded executable holds their values, and
    the same model downloaded anew finds its entries), less what changes how the model is
    served but not an executable of a given input shape: the bucket settings, the input checks,
    the caches, whether this process serves. None: params too big to hash for the lite path."""
    import json

    path, mlmodel, blob, manifest, config, env = identity[:6]
    content = lite.params_digest(path, flavor)
    if content is None:
        return None
    config = {k: v for k, v in json.loads(config).items() if k not in _SERVING_ONLY}
    env = [
        (k, v)
        for k, v in env
        if not k.startswith(_SERVING_ONLY_ENV) and k[len("JAXEXP_") :].lower() not in _SERVING_ONLY
    ]
    return [content, mlmodel, blob, manifest, config, env]


class LiteWriter:
    """Stores each bucket's lite executable after its first call on the JAX path.

    Made by the pyfunc load of a process that had not imported jax before (so jax's
    configuration comes from the environment alone); a bucket is written once, in the
    background, only while ``jax.config`` is as it was at load.
    """

    def __init__(self, impl: Any, identity: tuple, flavor: dict[str, Any], setting: Any) -> None:
        import jax

        self._impl = impl
        self._model_identity, self._flavor = identity, flavor
        self._setting = setting
        self._config = dict(jax.config.values)
        self._environment = lite.environment()
        self._done: set[tuple] = set()
        self._lock = threading.Lock()
        #: the function names of the entries this writer stored (for tests)
        self.written: list[str] = []

    def __call__(self, x: np.ndarray, out: Any) -> None:
        """Queue the lite entry of ``x``'s bucket (``out``: the JAX path's output on it)."""
        key = (x.shape, x.dtype)
        with self._lock:
            if key in self._done:
                return
            self._done.add(key)
        if lite.lite_dir(self._setting) is None:
            return
        from jaxexp_mlflow.runtime import executables

        x = np.array(x, copy=True)
        executables.run_later(lambda: self.write(x, out))  # the key too: it hashes the params

    @functools.cached_property
    def _identity(self) -> list | None:
        """:func:`lite_identity`, computed on the writer's thread (it reads the params' files),
        never on the request path."""
        return lite_identity(self._model_identity, self._flavor)

    def _key(self, x: np.ndarray) -> str:
        return lite.entry_key(self._identity, self._environment, x.shape, x.dtype)

    def write(self, x: np.ndarray, out: Any) -> bool:
        """Compile, prove and store the folded executable of ``x``'s shape; whether it was
        stored. Never raises."""
        try:
            return self._write(x, np.asarray(out))
        except Exception as err:  # noqa: BLE001 - a missed entry costs start-up time only
            _logger.debug("jaxexp: lite entry not stored: %s", err)
            return False

    def _write(self, x: np.ndarray, want: np.ndarray) -> bool:
        import jax

        from jaxexp_mlflow.internals import jaxlib_private

        if dict(jax.config.values) != self._config:
            return False
        directory = lite.lite_dir(self._setting)
        if directory is None or self._identity is None:
            return False
        key = self._key(x)
        if lite.read_entry(directory, key) is not None:
            return False  # stored already (e.g. by the process before, whose lite path it left)
        # an entry that does not verify (planted, renamed, another machine's) is replaced
        # named after this entry, so that only an earlier compile of this very entry can come
        # from JAX's cache (whose executables run no more once reloaded); if one does, it is
        # compiled once more under a name of its own (executables.jit_named)
        for fresh in (False, True):
            name, got, payload = self._folded(x, f"jaxexp_lite_{key[:16]}", fresh)
            if got.shape != want.shape or got.dtype != want.dtype or not _close(got, want):
                return False
            try:
                again = jaxlib_private.CpuExecutable(payload, [(got.shape, got.dtype)])([x])[0]
            except Exception as err:  # noqa: BLE001 - handed back by JAX's cache: no kernels
                _logger.debug("jaxexp: the lite executable did not run reloaded (%s)", err)
                continue
            if again.dtype != got.dtype or again.tobytes() != got.tobytes():
                return False
            header = {"output": [list(got.shape), str(got.dtype)]}
            lite.write_entry(directory, key, header, payload)
            self.written.append(name)
            return True
        return False

    def _folded(self, x: np.ndarray, name: str, fresh: bool) -> tuple[str, np.ndarray, bytes]:
        """The function name, the outputs on ``x`` and the serialized executable of the model
        with its params folded in as constants, compiled as ``executables.jit_named`` names
        it."""
        from jaxexp_mlflow.internals import jaxlib_private
        from jaxexp_mlflow.runtime.cpu_compile import compile_lowered
        from jaxexp_mlflow.runtime.executables import jit_named

        flat_call, params = self._impl._flat.function, self._impl.model.params

        def folded(x: Any) -> Any:
            return flat_call(params, x)

        compiled = compile_lowered(jit_named(folded, name, fresh=fresh).lower(x))[0]
        return folded.__name__, np.asarray(compiled(x)[0]), jaxlib_private.serialize(compiled)


def _close(got: np.ndarray, want: np.ndarray) -> bool:
    """``got`` within ``DEFAULT_TOLERANCES`` of ``want`` (floats), else equal."""
    from jaxexp_mlflow.archive.reproduce import DEFAULT_TOLERANCES

    if got.dtype.kind in "fc":
        rtol, atol = DEFAULT_TOLERANCES.get(
            got.dtype.itemsize // (2 if got.dtype.kind == "c" else 1), (0.0, 0.0)
        )
        return bool(np.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True))
    return bool(np.array_equal(got, want))


def params_bytes(model: Any) -> int:
    """The bytes of the model's params (0 without)."""
    if not model.has_params:
        return 0
    import jax

    return sum(int(getattr(p, "nbytes", 0)) for p in jax.tree.leaves(model.params))


def attach_writer(
    impl: Any, flavor: dict[str, Any], config: dict[str, Any], identity: tuple
) -> bool:
    """Give ``impl`` (a ``JaxExpPyfunc`` just loaded by a process that had not imported jax) a
    :class:`LiteWriter` when its model takes the lite path's case: small params (at most
    ``JAXEXP_LITE_MAX_PARAM_BYTES``, default 64 MiB: they are folded into each executable), the
    CPU, custom calls the executable store keeps. Whether one was attached."""
    from jaxexp_mlflow.internals import jaxlib_private
    from jaxexp_mlflow.runtime import executables

    if not lite.enabled() or not cpu_only() or not jaxlib_private.available():
        return False
    flat = getattr(impl, "_flat", None)
    model = impl.model
    if not isinstance(flat, executables.Executables) or flat.function is None:
        return False
    if shape_of(flavor, config, False) is None or not impl._one_array_path():
        return False
    targets = getattr(model, "custom_call_targets", None)
    if targets is None or not executables.STORABLE_CUSTOM_CALLS.issuperset(targets):
        return False
    if model.platform != "cpu" or params_bytes(model) > lite.max_param_bytes():
        return False
    setting = config.get(
        "compilation_cache", (flavor.get("serving") or {}).get("compilation_cache")
    )
    if lite.lite_dir(setting) is None:
        return False
    writer = LiteWriter(impl, identity, flavor, setting)
    bound = model.params

    def on_first(leaves: tuple, outs: Any) -> None:
        if len(leaves) == 1 and type(leaves[0]) is np.ndarray and model.params is bound:
            writer(leaves[0], outs[0])

    flat.on_first = on_first
    impl.lite_writer = writer
    return True
