"""Read a model's MLmodel file and validate its ``jaxexp`` section (no JAX, no MLflow import).

MLmodel is YAML written by MLflow. From an untrusted directory it is read with bounds: at most
``files.MAX_MLMODEL_BYTES``, at most ``MAX_ALIASES`` YAML aliases, nesting at most
``MAX_DEPTH`` deep and at most ``MAX_NODES`` values once aliases are expanded (an "alias bomb"
of a few kB otherwise expands to gigabytes in whoever walks the result: ``json.dumps``,
``copy.deepcopy``). The ``jaxexp`` section is then checked field by field: types, and bounds on
every value that sizes an allocation (``serving.max_batch``, buckets, io shapes, device count),
so that a damaged or hostile file is an ``ArtifactError`` naming the field, not an
``AttributeError`` deep in the loader or a multi-gigabyte allocation.
"""

from __future__ import annotations

import os
import re
from typing import Any

from jaxexp_mlflow.codec import files
from jaxexp_mlflow.codec.files import fail

__all__ = [
    "MLMODEL",
    "check_node_type_names",
    "flavor_section",
    "load_yaml",
    "read_mlmodel",
    "validate_flavor",
]

MLMODEL = "MLmodel"
MAX_ALIASES = 100
MAX_DEPTH = 64
MAX_NODES = 200_000
#: Bounds of the MLmodel values that size allocations (see docs/security.md).
MAX_BATCH = 1 << 20
MAX_BUCKETS = 64
MAX_DIM = 1 << 31
MAX_RANK = 32
MAX_LEAVES = 100_000
MAX_DEVICES = 1 << 16
MAX_REQUEST_BYTES = 1 << 34
#: Bounds of ``pytree_node_types``: names are import paths (``flax.core.frozen_dict.FrozenDict``).
MAX_NODE_TYPES = 1024
MAX_NODE_TYPE_NAME = 512


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
    data = load_yaml(raw)
    if not isinstance(data, dict):
        raise fail(
            f"The model's {MLMODEL} file: expected a YAML mapping, found "
            f"{type(data).__name__}. Download the model again."
        )
    return data


def flavor_section(mlmodel: dict[str, Any], name: str = "jaxexp") -> dict[str, Any]:
    """The validated ``flavors.<name>`` section of an MLmodel dict."""
    flavors = mlmodel.get("flavors")
    if not isinstance(flavors, dict) or name not in flavors:
        found = sorted(str(k) for k in flavors) if isinstance(flavors, dict) else "no flavors"
        raise fail(
            f"The model's {MLMODEL}: expected a '{name}' flavor, found {found!s:.200}. Load it "
            f"with the flavor it was logged with, or log it with mlflow.{name}."
        )
    validate_pyfunc_config(flavors.get("python_function"))
    return validate_flavor(flavors[name])


#: ``python_function.config`` keys a model directory may not set (non-null): where compiled code
#: is loaded from (the caches), what compiles it (the backend) and whether the compatibility
#: verdict may be overruled are the choice of whoever loads the model, never of the model.
PYFUNC_LOAD_TIME_ONLY = {
    "compilation_cache": "JAXEXP_COMPILATION_CACHE",
    "iree_cache": "JAXEXP_IREE_CACHE",
    "backend": "JAXEXP_BACKEND",
    "allow_incompatible": None,
    "allow_other_platform": None,
}
_FLAGS = (True, False, 0, 1, "0", "1", "true", "false", "on", "off", "yes", "no")


def validate_pyfunc_config(section: Any) -> None:
    """Check ``python_function.config`` of an MLmodel like the ``jaxexp.serving`` section.

    MLflow passes that mapping to the pyfunc loader as the defaults of ``model_config``, so a
    model directory could otherwise set through it what the flavor section refuses or bounds.
    ``save_model`` writes every key as null (the keys ``model_config`` may set at load). Refused
    with an ``ArtifactError`` naming the key: a non-null value for a key in
    ``PYFUNC_LOAD_TIME_ONLY``; ``max_batch`` / ``max_request_bytes`` / bucket lists beyond the
    flavor section's bounds; values of the wrong type.
    """
    if section is None:
        return
    if not isinstance(section, dict):
        raise _config_bad("(section)", "a mapping", section, where="python_function")
    config = section.get("config")
    if config is None:
        return
    if not isinstance(config, dict) or len(config) > MAX_BUCKETS:
        raise _config_bad("(config)", f"a mapping of at most {MAX_BUCKETS} keys", config)
    for key, value in config.items():
        if value is None:
            continue
        if key in PYFUNC_LOAD_TIME_ONLY:
            env = PYFUNC_LOAD_TIME_ONLY[key]
            raise fail(
                f"The model's {MLMODEL} python_function.config sets {key}: the model directory "
                f"tried to set {key}, which only whoever loads the model may choose. Remove it "
                f"from the model and pass it as a load option instead (model_config="
                f"{{{key!r}: ...}}{f' or {env}' if env else ''})."
            )
    _config_int(config, "max_batch", MAX_BATCH)
    _config_int(config, "max_request_bytes", MAX_REQUEST_BYTES)
    from jaxexp_mlflow.errors import ArtifactError

    for key in ("buckets", "precompile"):
        try:
            _sizes(config.get(key), key)
        except ArtifactError:
            raise _config_bad(
                key,
                f"'pow2', 'off', a bool or at most {MAX_BUCKETS} sizes in [1, {MAX_BATCH}]",
                config.get(key),
            ) from None
    for key in ("allow_nan", "data_parallel"):
        value = config.get(key)
        if value is not None and (
            not isinstance(value, bool | int | str)
            or (value.lower() if isinstance(value, str) else value) not in _FLAGS
        ):
            raise _config_bad(key, "true or false", value)
    driver = config.get("iree_driver")
    if driver is not None and (not isinstance(driver, str) or len(driver) > 64):
        raise _config_bad("iree_driver", "an IREE driver name", driver)


def _config_int(config: dict, key: str, hi: int) -> None:
    value = config.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
        raise _config_bad(key, f"an integer in [1, {hi}]", value)


def _config_bad(
    key: str, expected: str, value: Any, *, where: str = "python_function.config"
) -> Exception:
    found = type(value).__name__ if not isinstance(value, int | float | str) else repr(value)
    return fail(
        f"The model's {MLMODEL} {where}.{key}: expected {expected}, found {found:.80}. The "
        "model directory sets it outside the bounds the flavor section has; download the model "
        "again, or pass the setting as a load option (model_config) instead."
    )


def _bad(field: str, expected: str, value: Any) -> Exception:
    found = type(value).__name__ if not isinstance(value, int | float | str) else repr(value)
    return fail(
        f"The model's {MLMODEL} jaxexp.{field}: expected {expected}, found {found:.80}. The file "
        "is damaged or was altered; download the model again."
    )


def _int(conf: dict, key: str, lo: int, hi: int, *, field: str | None = None) -> None:
    value = conf.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _bad(field or key, f"an integer in [{lo}, {hi}]", value)


def _str_list(conf: dict, key: str, *, limit: int = MAX_LEAVES) -> None:
    value = conf.get(key)
    if value is None:
        return
    if (
        not isinstance(value, list)
        or len(value) > limit
        or not all(isinstance(v, str) or v is None for v in value)
    ):
        raise _bad(key, f"a list of at most {limit} strings", value)


def _sizes(value: Any, field: str) -> None:
    """A bucket/precompile setting: a keyword, a bool, or a short list of bounded sizes."""
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, str):
        items = [v for v in value.split(",") if v.strip()]
        if not all(v.strip().isdigit() for v in items) and value.lower() not in (
            "pow2",
            "off",
            "none",
            "on",
            "true",
            "false",
            "",
            "0",
            "1",
        ):
            raise _bad(field, "'pow2', 'off' or a comma-separated list of sizes", value)
        value = [int(v) for v in items if v.strip().isdigit()]
        if len(value) == 1 and value[0] in (0, 1):
            return
    if not isinstance(value, list) or len(value) > MAX_BUCKETS:
        raise _bad(field, f"a list of at most {MAX_BUCKETS} sizes", value)
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_BATCH:
            raise _bad(field, f"sizes in [1, {MAX_BATCH}]", v)


def _io(io: Any) -> None:
    if io is None:
        return
    if not isinstance(io, dict):
        raise _bad("io", "a mapping with 'inputs' and 'outputs'", io)
    for side in ("inputs", "outputs"):
        entries = io.get(side)
        if not isinstance(entries, list) or len(entries) > MAX_LEAVES:
            raise _bad(f"io.{side}", f"a list of at most {MAX_LEAVES} leaf specs", entries)
        for i, e in enumerate(entries):
            where = f"io.{side}[{i}]"
            if not isinstance(e, dict):
                raise _bad(where, "a mapping {name, dtype, shape, symbols}", e)
            if not isinstance(e.get("name"), str) or not isinstance(e.get("dtype"), str):
                raise _bad(where, "string 'name' and 'dtype'", e.get("name"))
            shape = e.get("shape")
            if not isinstance(shape, list) or len(shape) > MAX_RANK:
                raise _bad(f"{where}.shape", f"a list of at most {MAX_RANK} dimensions", shape)
            for d in shape:
                if isinstance(d, bool) or not isinstance(d, int) or not -1 <= d <= MAX_DIM:
                    raise _bad(f"{where}.shape", f"dimensions in [0, {MAX_DIM}] or -1", d)
            symbols = e.get("symbols")
            if symbols is not None and (
                not isinstance(symbols, list)
                or len(symbols) != len(shape)
                or not all(s is None or isinstance(s, str) for s in symbols)
            ):
                raise _bad(f"{where}.symbols", "one string or null per dimension", symbols)


_SHA256 = re.compile(r"[0-9a-f]{64}")


def check_node_type_names(names: Any) -> list[Any]:
    """``pytree_node_types`` as written by ``save_model``: a list of at most ``MAX_NODE_TYPES``
    printable names without spaces, each at most ``MAX_NODE_TYPE_NAME`` characters (or null);
    ``ArtifactError`` naming the field otherwise."""
    field = "pytree_node_types"
    if names is None:
        return []
    if not isinstance(names, list) or len(names) > MAX_NODE_TYPES:
        raise _bad(field, f"a list of at most {MAX_NODE_TYPES} node type names", names)
    for name in names:
        if name is None:
            continue
        if (
            not isinstance(name, str)
            or not 0 < len(name) <= MAX_NODE_TYPE_NAME
            or not name.isprintable()
            or any(c.isspace() for c in name)
        ):
            shown = name if not isinstance(name, str) else f"{name[:60]!r} ({len(name)} chars)"
            raise _bad(
                field,
                f"import paths of node types (at most {MAX_NODE_TYPE_NAME} printable "
                "characters, no spaces)",
                shown,
            )
    return names


def _code_dir(conf: dict) -> None:
    """``code``: the model's own code directory (MLflow's ``code_paths`` copy), relative and
    inside the model, or null. jaxexp never imports from it (docs/security.md)."""
    code = conf.get("code")
    if code is None:
        return
    if not isinstance(code, str):
        raise _bad("code", "the relative path of the model's code directory, or null", code)
    files.check_relative(code, what="code directory (jaxexp.code)")


def validate_flavor(conf: Any) -> dict[str, Any]:
    """Check the types and bounds of the ``jaxexp`` flavor section; return it unchanged.

    Required: ``exported_sha256`` (the blob is never read unchecked). Optional fields, when
    present, must have the type ``save_model`` writes; the values that size allocations are
    bounded (``MAX_BATCH``, ``MAX_BUCKETS``, ``MAX_DIM``, ``MAX_RANK``, ``MAX_DEVICES``).
    """
    if not isinstance(conf, dict):
        raise _bad("(section)", "a mapping of the flavor's fields", conf)
    sha = conf.get("exported_sha256")
    if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
        raise _bad(
            "exported_sha256",
            "the sha256 of the blob (64 hex digits), without which the blob cannot be trusted",
            sha,
        )
    for key in ("exported_file", "fun_name", "jax_version", "jaxlib_version", "in_tree"):
        value = conf.get(key)
        if value is not None and not isinstance(value, str):
            raise _bad(key, "a string", value)
    params = conf.get("params")
    if params is not None and not isinstance(params, str):
        raise _bad("params", "the relative path of the params checkpoint, or null", params)
    if params is not None:
        files.check_relative(params, what="params checkpoint (params)")
    if conf.get("exported_file") is not None:
        files.check_relative(conf["exported_file"], what="serialized function (exported_file)")
    _int(conf, "n_param_leaves", 0, MAX_LEAVES)
    _int(conf, "nr_devices", 0, MAX_DEVICES)
    _int(conf, "vjp_order", 0, 64)
    _int(conf, "exported_nbytes", 0, files.MAX_BLOB_BYTES)
    _code_dir(conf)
    for key in ("platforms", "in_avals", "out_avals"):
        _str_list(conf, key)
    check_node_type_names(conf.get("pytree_node_types"))
    for key in ("in_shardings", "out_shardings", "custom_call_targets"):
        _str_list(conf, key)
    for key in ("reference", "params_format", "serving"):
        value = conf.get(key)
        if value is not None and not isinstance(value, dict):
            raise _bad(key, "a mapping", value)
    ref = conf.get("reference")
    if ref:
        for key in ("input_dtypes", "output_dtypes"):
            if not isinstance(ref.get(key), list):
                raise _bad(f"reference.{key}", "a list of dtype names", ref.get(key))
            _str_list(ref, key)
    serving = conf.get("serving") or {}
    _int(serving, "max_batch", 1, MAX_BATCH, field="serving.max_batch")
    _int(serving, "max_request_bytes", 1, MAX_REQUEST_BYTES, field="serving.max_request_bytes")
    _sizes(serving.get("buckets"), "serving.buckets")
    _sizes(serving.get("precompile"), "serving.precompile")
    if serving.get("compilation_cache") not in (None, False, "off", "none", "0"):
        # JAX loads compiled executables from that directory: a model must not choose it
        raise _bad(
            "serving.compilation_cache",
            "no directory (the cache location is the server's choice: model_config or "
            "JAXEXP_COMPILATION_CACHE)",
            serving.get("compilation_cache"),
        )
    _io(conf.get("io"))
    return conf
