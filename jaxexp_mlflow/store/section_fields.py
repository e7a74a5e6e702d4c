"""Field checks of the MLmodel ``jaxexp`` section: the bounds and the type checks behind
:meth:`~jaxexp_mlflow.store.section.FlavorSection.from_dict`.

The ``MAX_*`` bounds of every value that sizes an allocation (batch, buckets, io shapes, leaf
and device counts) and the checks of each field of an untrusted section (``_validate`` and its
helpers), each refusal an ``ArtifactError`` naming the field. They live apart from the schema
object so that ``store/section.py`` stays the schema and its readers, and so that the
``python_function.config`` checks (``store/pyfunc_config.py``) share the same bounds without
importing the schema. No JAX and no MLflow import.
"""

from __future__ import annotations

import re
from typing import Any

from jaxexp_mlflow.codec.files import MAX_BLOB_BYTES, check_relative, fail
from jaxexp_mlflow.codec.mlmodel import MLMODEL, check_node_type_names

#: Bounds of the MLmodel values that size allocations (see docs/security.md).
MAX_BATCH = 1 << 20
MAX_BUCKETS = 64
MAX_DIM = 1 << 31
MAX_RANK = 32
MAX_LEAVES = 100_000
MAX_DEVICES = 1 << 16
MAX_REQUEST_BYTES = 1 << 34
MAX_VJP_ORDER = 64


def _found(value: Any) -> str:
    return type(value).__name__ if not isinstance(value, int | float | str) else repr(value)


# -- field checks of the jaxexp section ---------------------------------------------------------


def _bad(field: str, expected: str, value: Any) -> Exception:
    return fail(
        f"The model's {MLMODEL} jaxexp.{field}: expected {expected}, found {_found(value):.80}. "
        "The file is damaged or was altered; download the model again."
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


_SIZE_WORDS = ("pow2", "off", "none", "on", "true", "false", "", "0", "1")


def _sizes(value: Any, field: str) -> None:
    """A bucket/precompile setting: a keyword, a bool, or a short list of bounded sizes."""
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, str):
        items = [v for v in value.split(",") if v.strip()]
        if not all(v.strip().isdigit() for v in items) and value.lower() not in _SIZE_WORDS:
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
            once = e.get("batched", True)  # false: an input of fixed leading dim, one value
            if once is not True and (
                once is not False or side == "outputs" or shape[:1] in ([], [-1])
            ):
                raise _bad(
                    f"{where}.batched", "true, or false for an input of fixed shape[0]", once
                )


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _relative(conf: dict, key: str, expected: str, what: str) -> None:
    """A path written in the model: null, or relative and inside the model directory."""
    value = conf.get(key)
    if value is None:
        return
    if not isinstance(value, str):
        raise _bad(key, expected, value)
    check_relative(value, what=what)


def _validate(conf: Any) -> None:
    if not isinstance(conf, dict):
        raise _bad("(section)", "a mapping of the flavor's fields", conf)
    sha = conf.get("exported_sha256")
    if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
        raise _bad(
            "exported_sha256",
            "the sha256 of the blob (64 hex digits), without which the blob cannot be trusted",
            sha,
        )
    for key in (
        "exported_file",
        "fun_name",
        "jax_version",
        "jaxlib_version",
        "jaxexp_mlflow_version",
        "in_tree",
        "out_tree",
        "params_layout",
    ):
        value = conf.get(key)
        if value is not None and not isinstance(value, str):
            raise _bad(key, "a string", value)
    _relative(
        conf,
        "params",
        "the relative path of the params checkpoint, or null",
        "params checkpoint (params)",
    )
    _relative(conf, "exported_file", "a string", "serialized function (exported_file)")
    # the model's own code (MLflow's code_paths copy): jaxexp never imports it (docs/security.md)
    _relative(
        conf,
        "code",
        "the relative path of the model's code directory, or null",
        "code directory (jaxexp.code)",
    )
    _int(conf, "n_param_leaves", 0, MAX_LEAVES)
    _int(conf, "nr_devices", 0, MAX_DEVICES)
    _int(conf, "vjp_order", 0, MAX_VJP_ORDER)
    _int(conf, "exported_nbytes", 0, MAX_BLOB_BYTES)
    for key in ("calling_convention_version", "serialization_version", "schema_generation"):
        _int(conf, key, 0, 1 << 16)
    for key in ("platforms", "in_avals", "out_avals", "param_names"):
        _str_list(conf, key)
    check_node_type_names(conf.get("pytree_node_types"))
    for key in ("in_shardings", "out_shardings", "custom_call_targets"):
        _str_list(conf, key)
    for key in (
        "reference",
        "reference_synthetic",
        "params_format",
        "param_keys",
        "serving",
        "classifier",
        "iree",
        "padding",
        "route",
    ):
        value = conf.get(key)
        if value is not None and not isinstance(value, dict):
            raise _bad(key, "a mapping", value)
    padding = conf.get("padding") or {}
    if not isinstance(padding.get("rows_independent", False), bool):
        raise _bad("padding.rows_independent", "true or false", padding.get("rows_independent"))
    ref = conf.get("reference")
    if ref:
        for key in ("input_dtypes", "output_dtypes"):
            if not isinstance(ref.get(key), list):
                raise _bad(f"reference.{key}", "a list of dtype names", ref.get(key))
            _str_list(ref, key)
        if ref.get("platform") is not None and not isinstance(ref["platform"], str):
            raise _bad("reference.platform", "a platform name (cpu, cuda, tpu)", ref["platform"])
        digests = ref.get("sha256")
        if digests is not None and (
            not isinstance(digests, dict)
            or set(digests) - {"inputs", "outputs"}
            or not all(
                isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) for v in digests.values()
            )
        ):
            raise _bad(
                "reference.sha256",
                "a mapping of 'inputs' and 'outputs' to hex sha256 digests",
                digests,
            )
    serving = conf.get("serving") or {}
    _int(serving, "max_batch", 1, MAX_BATCH, field="serving.max_batch")
    _int(serving, "max_request_bytes", 1, MAX_REQUEST_BYTES, field="serving.max_request_bytes")
    _sizes(serving.get("buckets"), "serving.buckets")
    _sizes(serving.get("precompile"), "serving.precompile")
    cache = serving.get("compilation_cache")  # exact types: 0.0 == False, but "0.0" is a path
    off = cache is None or cache is False or (type(cache) is str and cache in ("off", "none", "0"))
    if not off:
        # JAX loads compiled executables from that directory: a model may turn it off only
        raise _bad(
            "serving.compilation_cache",
            "false or 'off' (a model may turn the cache off; where it lives is the server's "
            "choice: model_config or JAXEXP_COMPILATION_CACHE)",
            cache,
        )
    _io(conf.get("io"))
