"""The ``jaxexp`` section of MLmodel: one schema object, written and validated here only.

:class:`FlavorSection` lists every field ``save_model`` writes, with its type. Writers build one
(:meth:`FlavorSection.describe_export`, then ``dataclasses.replace`` as the save goes on) and
hand :meth:`FlavorSection.to_dict` to ``Model.add_flavor``; readers of a model directory go
through :func:`read_section` / :func:`flavor_section`, which check the untrusted mapping with
:meth:`FlavorSection.from_dict`: types, and bounds on every value that sizes an allocation
(``serving.max_batch``, buckets, io shapes, device count), so that a damaged or hostile file is
an ``ArtifactError`` naming the field, not an ``AttributeError`` deep in the loader or a
multi-gigabyte allocation. ``python_function.config`` (MLflow's ``model_config`` defaults) is
checked with the same bounds (:func:`validate_pyfunc_config`).

No JAX and no MLflow import: the CLI and the isolation child use it too.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jaxexp_mlflow.codec.files import MAX_BLOB_BYTES, check_relative, fail
from jaxexp_mlflow.codec.mlmodel import MLMODEL, check_node_type_names, read_mlmodel

__all__ = [
    "FLAVOR_NAME",
    "FlavorSection",
    "PYFUNC_LOAD_TIME_ONLY",
    "check_node_type_names",
    "flavor_section",
    "package_version",
    "read_section",
    "validate_flavor",
    "validate_pyfunc_config",
]

FLAVOR_NAME = "jaxexp"
#: Bounds of the MLmodel values that size allocations (see docs/security.md).
MAX_BATCH = 1 << 20
MAX_BUCKETS = 64
MAX_DIM = 1 << 31
MAX_RANK = 32
MAX_LEAVES = 100_000
MAX_DEVICES = 1 << 16
MAX_REQUEST_BYTES = 1 << 34
MAX_VJP_ORDER = 64

#: Fields written only when set (absent from MLmodel rather than null), as ``save_model`` always
#: did: an unset one is left out by :meth:`FlavorSection.to_dict`.
_WRITTEN_WHEN_SET = frozenset(
    {
        "param_names",
        "param_keys",
        "params_layout",
        "classifier",
        "serving",
        "reference",
        "reference_synthetic",
        "padding",
        "route",
    }
)


@dataclass(frozen=True)
class FlavorSection:
    """The MLmodel ``jaxexp`` section (docs/saving.md lists what each field holds).

    Required: ``exported_sha256`` (the blob is never read unchecked). Every other field may be
    absent in a model directory (older writers); present, it must have the type written here.
    Fields a newer writer adds are kept in ``extra`` and written back unchanged.
    """

    exported_sha256: str
    exported_file: str | None = None
    exported_nbytes: int | None = None
    jaxexp_mlflow_version: str | None = None
    jax_version: str | None = None
    jaxlib_version: str | None = None
    fun_name: str | None = None
    platforms: list[str] | None = None
    nr_devices: int | None = None
    vjp_order: int | None = None
    calling_convention_version: int | None = None
    serialization_version: int | None = None
    schema_generation: int | None = None
    in_tree: str | None = None
    out_tree: str | None = None
    in_avals: list[str] | None = None
    out_avals: list[str] | None = None
    in_shardings: list[str | None] | None = None
    out_shardings: list[str | None] | None = None
    custom_call_targets: list[str] | None = None
    pytree_node_types: list[str] | None = None
    #: the params checkpoint's relative path (None: no params) and its description
    params: str | None = None
    n_param_leaves: int | None = None
    params_format: dict[str, Any] | None = None
    param_names: list[str] | None = None
    param_keys: dict[str, Any] | None = None
    params_layout: str | None = None
    #: the model's own code directory (MLflow's ``code_paths`` copy); jaxexp never imports it
    code: str | None = None
    io: dict[str, Any] | None = None
    serving: dict[str, Any] | None = None
    classifier: dict[str, Any] | None = None
    reference: dict[str, Any] | None = None
    reference_synthetic: dict[str, Any] | None = None
    iree: dict[str, Any] | None = None
    #: whether pyfunc may pad batches to buckets: ``rows_independent`` (bool, proven at save
    #: by ``runtime.rows.prove``) and ``proof`` (how); absent: not proven, never padded
    padding: dict[str, Any] | None = None
    route: dict[str, Any] | None = None  # the route a refused blob was saved through
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The mapping ``Model.add_flavor`` writes (fields in ``_WRITTEN_WHEN_SET`` only when
        set, ``extra`` merged back)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            if value is None and f.name in _WRITTEN_WHEN_SET:
                continue
            out[f.name] = value
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, conf: Any) -> FlavorSection:
        """Check an untrusted ``jaxexp`` section (types and bounds) and build the object.

        ``ArtifactError`` naming the field, what was expected and what was found otherwise.
        """
        _validate(conf)
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        values = {k: v for k, v in conf.items() if k in known}
        extra = {k: v for k, v in conf.items() if k not in known}
        return cls(**values, extra=extra)

    @classmethod
    def describe_export(
        cls,
        exported: Any,
        *,
        vjp_order: int,
        exported_file: str,
        exported_sha256: str,
        params_path: str | None,
        n_param_leaves: int,
        exporter_versions: tuple[str | None, str | None],
        serialization_version: int | None,
        schema_generation: int | None,
        custom_call_targets: list[str] | None,
        node_types: list[str],
        in_shardings: Sequence[str | None],
        out_shardings: Sequence[str | None],
    ) -> FlavorSection:
        """The section's facts about an ``Exported`` and its blob (``save_model`` adds the rest:
        params description, io specs, reference, serving defaults). The shardings are the
        blob's own, as its JAX-free description reads them (``codec.reader``: HLO sharding text
        for schema < 6, JAX's ``NamedSharding`` repr after): ``Exported.in_shardings_hlo`` is
        all None for every export made since JAX serializes named shardings (and deprecated)."""
        from jaxexp_mlflow import __version__

        jax_version, jaxlib_version = exporter_versions
        return cls(
            jaxexp_mlflow_version=__version__,
            jax_version=jax_version,
            jaxlib_version=jaxlib_version,
            fun_name=exported.fun_name,
            platforms=list(exported.platforms),
            nr_devices=int(exported.nr_devices),
            vjp_order=int(vjp_order),
            calling_convention_version=int(exported.calling_convention_version),
            serialization_version=serialization_version,
            schema_generation=schema_generation,
            in_tree=str(exported.in_tree),
            out_tree=str(exported.out_tree),
            in_avals=[aval_str(a) for a in exported.in_avals],
            out_avals=[aval_str(a) for a in exported.out_avals],
            in_shardings=_sharding_strs(in_shardings),
            out_shardings=_sharding_strs(out_shardings),
            custom_call_targets=custom_call_targets,
            pytree_node_types=node_types,
            n_param_leaves=int(n_param_leaves),
            exported_file=exported_file,
            exported_sha256=exported_sha256,
            params=params_path,
        )


def aval_str(aval: Any) -> str:
    """``float32[b,784]``: dtype and shape, symbolic dimensions kept by name."""
    return aval.str_short(short_dtypes=False) if hasattr(aval, "str_short") else str(aval)


def _sharding_strs(shardings: Any) -> list[str | None]:
    return [None if s is None else str(s) for s in shardings]


@functools.lru_cache(maxsize=64)
def package_version(name: str) -> str | None:
    """Installed version of a distribution, or None (read once per process: a module already
    imported stays the version it was, whatever is installed over it later)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# -- reading a model directory --------------------------------------------------------------


def read_section(model_dir: str | os.PathLike) -> dict[str, Any]:
    """The validated ``jaxexp`` section of the MLmodel in ``model_dir`` (a confined, bounded
    read; ``python_function.config`` checked too)."""
    return flavor_section(read_mlmodel(model_dir))


def flavor_section(mlmodel: Mapping[str, Any], name: str = FLAVOR_NAME) -> dict[str, Any]:
    """The validated ``flavors.<name>`` section of an MLmodel dict, as written."""
    flavors = mlmodel.get("flavors")
    if not isinstance(flavors, dict) or name not in flavors:
        found = sorted(str(k) for k in flavors) if isinstance(flavors, dict) else "no flavors"
        raise fail(
            f"The model's {MLMODEL}: expected a '{name}' flavor, found {found!s:.200}. Load it "
            f"with the flavor it was logged with, or log it with mlflow.{name}."
        )
    validate_pyfunc_config(flavors.get("python_function"))
    return validate_flavor(flavors[name])


def _aval_kind(text: Any) -> tuple[str, int] | None:
    """``(dtype, rank)`` of an aval string (``"float32[b,784]"`` -> ``("float32", 2)``)."""
    m = re.fullmatch(r"([A-Za-z0-9_]+)\[(.*)\]", str(text).strip())
    if m is None:
        return None
    dims = m.group(2).strip()
    return m.group(1), (0 if not dims else dims.count(",") + 1)


def check_against_blob(conf: Mapping[str, Any], description: Any, source: str) -> None:
    """Refuse a section whose facts about the function differ from the blob's own.

    The loader and the CLI take some facts from MLmodel (how often the model may be
    differentiated, its devices and platforms, its inputs' dtypes); a section edited apart from
    its blob would have them promise what the blob cannot do, or refuse what it takes. Fields
    the section leaves unset (older models) are not compared. ``ArtifactError`` naming the first
    difference.
    """

    def differs(field: str, recorded: Any, actual: Any) -> Exception:
        def shown(v: Any) -> str:
            text = f"[{', '.join(map(str, v))}]" if isinstance(v, list | tuple) else str(v)
            return text if len(text) <= 120 else text[:117] + "..."

        return fail(
            f"The model's {MLMODEL} does not match its blob ({source}): jaxexp.{field} says "
            f"{shown(recorded)}, the blob says {shown(actual)}. The {MLMODEL} file was altered "
            "or belongs to another blob; download the model again."
        )

    for field, actual in (
        ("vjp_order", description.vjp_order),
        ("nr_devices", description.nr_devices),
        ("calling_convention_version", description.calling_convention_version),
    ):
        recorded = conf.get(field)
        if recorded is not None and recorded != actual:
            raise differs(field, recorded, actual)
    platforms = conf.get("platforms")
    if platforms is not None and [str(p).lower() for p in platforms] != [
        str(p).lower() for p in description.platforms
    ]:
        raise differs("platforms", platforms, list(description.platforms))
    for field, actual_avals in (
        ("in_avals", description.in_avals),
        ("out_avals", description.out_avals),
    ):
        recorded = conf.get(field)
        if recorded is None:
            continue
        if not isinstance(recorded, list) or len(recorded) != len(actual_avals):
            raise differs(
                f"{field} (count)",
                len(recorded) if isinstance(recorded, list) else recorded,
                len(actual_avals),
            )
        for i, (r, a) in enumerate(zip(recorded, actual_avals, strict=True)):
            if _aval_kind(r) != _aval_kind(a):
                raise differs(f"{field}[{i}]", r, a)
    io = conf.get("io")
    if not isinstance(io, Mapping):
        return
    skip = int(conf.get("n_param_leaves") or 0)  # the params' leaves come first
    for side, avals in (
        ("inputs", description.in_avals[skip:]),
        ("outputs", description.out_avals),
    ):
        specs = io.get(side) or []
        if len(specs) != len(avals):
            raise differs(f"io.{side} (count)", len(specs), len(avals))
        for spec, aval in zip(specs, avals, strict=True):
            kind = _aval_kind(aval)
            shape = spec.get("shape") if isinstance(spec, Mapping) else None
            mine = (str(spec.get("dtype")), len(shape)) if isinstance(shape, list) else None
            if kind is not None and mine != kind:
                name = spec.get("name") if isinstance(spec, Mapping) else spec
                raise differs(
                    f"io.{side} '{name}'", f"{mine[0]}[rank {mine[1]}]" if mine else spec, aval
                )


def validate_flavor(conf: Any) -> dict[str, Any]:
    """Check an untrusted ``jaxexp`` section (:meth:`FlavorSection.from_dict`); return it as
    written, for the readers that take it as a mapping."""
    FlavorSection.from_dict(conf)
    return conf


# -- python_function.config -------------------------------------------------------------------

#: ``python_function.config`` keys a model directory may not set (non-null): where compiled code
#: is loaded from (the caches), what compiles it (the backend) and whether the compatibility
#: verdict may be overruled are the choice of whoever loads the model, never of the model.
PYFUNC_LOAD_TIME_ONLY = {
    "compilation_cache": "JAXEXP_COMPILATION_CACHE",
    "iree_cache": "JAXEXP_IREE_CACHE",
    "backend": "JAXEXP_BACKEND",
    "allow_incompatible": None,
    "allow_other_platform": None,
    "route": None,
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


def _found(value: Any) -> str:
    return type(value).__name__ if not isinstance(value, int | float | str) else repr(value)


def _config_bad(
    key: str, expected: str, value: Any, *, where: str = "python_function.config"
) -> Exception:
    return fail(
        f"The model's {MLMODEL} {where}.{key}: expected {expected}, found {_found(value):.80}. "
        "The model directory sets it outside the bounds the flavor section has; download the "
        "model again, or pass the setting as a load option (model_config) instead."
    )


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
