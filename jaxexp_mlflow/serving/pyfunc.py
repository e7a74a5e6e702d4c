"""The pyfunc face of a jaxexp model: numpy/pandas/JSON lists in, numpy out, no JAX for callers.

``JaxExpPyfunc.predict`` takes every form of the input contract (``serving/inputs.py``: by name
or position, dicts, DataFrames, lists, MLflow's JSON envelopes, lossless casts only) and returns
a numpy array for a single output leaf, a dict ``{output name: array}`` otherwise. The class
itself lives in ``serving/pyfunc_impl.py`` (re-exported here); this module loads it once per
process (``load_pyfunc``) and parses the requests of ``jaxexp serve`` for it (``parse_request``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from jaxexp_mlflow import settings
from jaxexp_mlflow.errors import IncompatibleError, InputError
from jaxexp_mlflow.runtime import rows as rows_mod
from jaxexp_mlflow.runtime.backend import backend_of
from jaxexp_mlflow.serving import lite_pyfunc, serving_guard
from jaxexp_mlflow.serving.inputs import from_records, from_split
from jaxexp_mlflow.serving.pyfunc_impl import DEFAULT_MAX_REQUEST_BYTES as DEFAULT_MAX_REQUEST_BYTES
from jaxexp_mlflow.serving.pyfunc_impl import ENV_MAX_REQUEST_BYTES as ENV_MAX_REQUEST_BYTES
from jaxexp_mlflow.serving.pyfunc_impl import JaxExpPyfunc

# -- loading, once per process -------------------------------------------------------------------
#
# Spark's ``spark_udf`` (local mode) and ``mlflow.models.evaluate`` call
# ``mlflow.pyfunc.load_model`` on the same directory again and again in one Python worker. Each
# implementation loaded is kept under the model's identity (the directory's real path, the sha256
# of its MLmodel, of its blob and of its params manifest, the model_config and the JAXEXP_*
# environment), never under its path alone: a directory rewritten in place is a new identity
# and loads again.

ENV_PYFUNC_CACHE = "JAXEXP_PYFUNC_CACHE"
_CACHE_SIZE = 4
_CACHE: OrderedDict[tuple, JaxExpPyfunc] = OrderedDict()
_CACHE_LOCK = threading.Lock()
#: What a scoring server's process has imported before it loads a model: ``mlflow models
#: serve``, ``jaxexp serve``, and MLServer (``mlserver start`` loads models in its main process,
#: or in spawned workers with ``parallel_workers`` > 0).
_SERVER_MODULES = (
    "mlflow.pyfunc.scoring_server.app",
    "jaxexp_mlflow.serving.server",
    "mlserver.server",
    "mlserver.parallel.worker",
)


def in_scoring_server() -> bool:
    """Whether this process is a scoring server (``mlflow models serve``, ``jaxexp serve``,
    MLServer)."""
    return any(name in sys.modules for name in _SERVER_MODULES)


def model_identity(model_dir: str | os.PathLike, config: dict[str, Any]) -> tuple:
    """What makes two loads the same model: real path, file digests, config, environment."""
    return _identity(model_dir, config)[0]


def _identity(model_dir: str | os.PathLike, config: dict[str, Any]) -> tuple[tuple, Any]:
    """``model_identity`` and the model directory it read (``store.model_files.ModelFiles``:
    MLmodel and the blob, read and checked once; the load takes it as it is)."""
    from jaxexp_mlflow.codec import files
    from jaxexp_mlflow.params.manifest import MANIFEST_FILE
    from jaxexp_mlflow.store import artifact
    from jaxexp_mlflow.store.model_files import read_model_files

    # an MLmodel that is no mapping: the load reports the missing flavor
    model_files = read_model_files(model_dir, mapping=False)
    model_files.blob  # noqa: B018 - read and checked against exported_sha256: its digest
    blob_digest = model_files.flavor["exported_sha256"]
    manifest = ""
    ckpt = artifact.params_dir(model_dir, model_files.flavor)
    if ckpt is not None and (ckpt / MANIFEST_FILE).is_file():
        data = files.read_file(ckpt / MANIFEST_FILE, what="params manifest", max_bytes=256 << 20)
        manifest = hashlib.sha256(data).hexdigest()
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("JAXEXP_")))
    key = (
        os.path.realpath(model_dir),
        model_files.mlmodel_sha256,
        blob_digest,
        manifest,
        json.dumps(config, sort_keys=True, default=str),
        env,
        in_scoring_server(),
    )
    return key, model_files


def load_pyfunc(path: str | os.PathLike, model_config: dict[str, Any] | None = None) -> Any:
    """The jaxexp pyfunc implementation of the model at ``path``, loaded once per process.

    A second load of the same model (see ``model_identity``) returns the implementation already
    loaded, with the buckets it has compiled. ``JAXEXP_PYFUNC_CACHE=0`` loads every time.
    """
    config = {k: v for k, v in (model_config or {}).items() if v is not None}
    model_dir = Path(path)
    if model_dir.is_file():
        model_dir = model_dir.parent
    if not settings.JAXEXP_PYFUNC_CACHE.get():
        return _load_uncached(model_dir, config)
    key, model_files = _identity(model_dir, config)
    with _CACHE_LOCK:
        impl = _CACHE.get(key)
        if impl is not None:
            _CACHE.move_to_end(key)
            return impl
    if backend_of(config, model_files.flavor) == "iree":  # runs without jax or jaxlib as it is
        impl = _load_uncached(model_dir, config, model_files)
    else:  # stored buckets run without importing jax (lite_pyfunc)
        serving = in_scoring_server()
        impl = lite_pyfunc.load(
            model_dir, config, model_files, key, _load_uncached, register, serving
        )
    with _CACHE_LOCK:
        _CACHE[key] = impl
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return impl


def _load_uncached(
    model_dir: Path, config: dict[str, Any], model_files: Any = None
) -> JaxExpPyfunc:
    """Read, judge and load the model at ``model_dir`` into a new ``JaxExpPyfunc``
    (``model_files``: the directory as the caller has just read it, ``store.model_files``)."""
    from jaxexp_mlflow.serving import signature as sig
    from jaxexp_mlflow.store.model_files import read_model_files

    if model_files is None:
        model_files = read_model_files(model_dir)
    flavor_conf = model_files.flavor
    saved = dict(flavor_conf.get("serving") or {})
    backend = backend_of(config, flavor_conf)
    load_options = {k: config[k] for k in ("allow_other_platform", "data_parallel") if k in config}
    if config.get("route") is not None:  # taken as asked, never chosen (runtime/routes.py)
        from jaxexp_mlflow.runtime.routes import check_name

        if backend == "iree":
            raise IncompatibleError(
                f"model_config route={config['route']!r} is a route of the JAX backend; "
                "backend 'iree' is a route of its own: pass one of them."
            )
        load_options["route"] = check_name(str(config["route"]))
    if backend == "iree":
        from jaxexp_mlflow.iree.loader import load_directory

        load_options.update({k: config[k] for k in ("iree_cache", "iree_driver") if k in config})
        load_options["model_files"] = model_files
    else:
        from jaxexp_mlflow.runtime.dispatch import inline_cpu_dispatch

        inline_cpu_dispatch(in_scoring_server())  # before jax's CPU client, in a server only
        from jaxexp_mlflow.runtime import cache
        from jaxexp_mlflow.runtime.loader import load_directory

        cache.configure(config.get("compilation_cache", saved.get("compilation_cache")))
        load_options["model_files"] = model_files
    model = load_directory(
        model_dir,
        flavor_conf,
        allow_incompatible=bool(config.get("allow_incompatible", False)),
        **load_options,
    )
    specs = sig.specs_from_conf(flavor_conf)
    inputs, outputs = specs if specs is not None else (None, None)
    impl = JaxExpPyfunc(
        model,
        config,
        inputs=inputs,
        outputs=outputs,
        saved_config=saved,
        classifier=flavor_conf.get("classifier"),
        serving=in_scoring_server(),
        rows_independent=rows_mod.proven(flavor_conf),
    )
    register(model_files.mlmodel.get("model_uuid"), impl)
    return impl


# -- requests of the jaxexp scoring server ------------------------------------------------------
#
# ``jaxexp serve`` (``serving/server.py``) parses ``/invocations`` bodies with ``parse_request``:
# the four JSON formats of MLflow's scoring protocol, through the input contract (the same rules
# as predict), at the cost of a plain ``json.loads`` + ``np.asarray``. ``mlflow models serve``
# keeps MLflow's own parsing: with no input schema in the signature it turns every format into
# numpy arrays or DataFrames, uncast, and ``predict`` applies the contract to them; nothing here
# changes MLflow's server.

_FORMATS = ("inputs", "instances", "dataframe_split", "dataframe_records")


def _model_uuid(metadata: Any) -> str | None:
    return getattr(metadata, "model_uuid", None)


# jaxexp pyfunc implementations loaded in this process, by MLmodel model_uuid
_LOADED: dict[str, JaxExpPyfunc] = {}


def register(model_uuid: str | None, impl: JaxExpPyfunc) -> None:
    """Remember a loaded implementation, found again from MLflow's metadata by ``impl_for``."""
    if model_uuid:
        _LOADED[model_uuid] = impl


def impl_for(metadata: Any) -> JaxExpPyfunc | None:
    """The implementation loaded for a ``PyFuncModel``'s metadata (``None``: not jaxexp)."""
    flavors = getattr(metadata, "flavors", None) or {}
    if "jaxexp" not in flavors:
        return None
    return _LOADED.get(_model_uuid(metadata))


def parse_request(impl: JaxExpPyfunc, body: Any) -> tuple[list[np.ndarray], dict | None]:
    """Parse a JSON request body into validated wire-dtype arrays and MLflow params.

    ``json.loads`` without per-number hooks (``serving_guard.loads``), then the contract on the
    converted arrays: finiteness, integer ranges and lossless casts checked vectorised.
    """
    if isinstance(body, bytes | bytearray | memoryview):
        try:
            body = bytes(body).decode("utf-8")
        except UnicodeDecodeError:
            raise InputError(
                "Expected a UTF-8 JSON object such as "
                f'{{"inputs": ...}} with: {impl._expected()}. Found bytes that are not UTF-8.'
            ) from None
    obj = serving_guard.loads(body, expected=impl._expected()) if isinstance(body, str) else body
    if not isinstance(obj, dict):
        raise InputError(
            f"Expected the request body to be a JSON object with one of the keys "
            f"{list(_FORMATS)}, found a JSON {type(obj).__name__}. Inputs: {impl._expected()}."
        )
    keys = [k for k in obj if k in _FORMATS]
    extra = [k for k in obj if k not in _FORMATS and k != "params"]
    if len(keys) != 1 or extra:
        raise InputError(
            f"Expected exactly one of the keys {list(_FORMATS)} (plus optional 'params'), "
            f"found keys {[str(k)[:40] for k in list(obj)[:10]]}. Inputs: {impl._expected()}."
        )
    fmt = keys[0]
    payload = obj[fmt]
    params = obj.get("params")
    if params is not None and not isinstance(params, dict):
        raise InputError(
            f"Expected the request's 'params' to be a JSON object, found a JSON "
            f"{type(params).__name__}. Inputs: {impl._expected()}."
        )
    if fmt in ("inputs", "instances"):
        data = payload
    elif fmt == "dataframe_split":
        data = from_split(impl.contract, payload)
    else:
        data = from_records(impl.contract, payload)
    return impl.convert_inputs(data, wire=True), params


def short(message: str, limit: int = 600) -> str:
    """``message`` cut to ``limit`` characters."""
    return message if len(message) <= limit else message[:limit] + " ..."
