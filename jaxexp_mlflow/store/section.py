"""The ``jaxexp`` section of MLmodel: one schema object, written and validated here only.

:class:`FlavorSection` lists every field ``save_model`` writes, with its type. Writers build one
(:meth:`FlavorSection.describe_export`, then ``dataclasses.replace`` as the save goes on) and
hand :meth:`FlavorSection.to_dict` to ``Model.add_flavor``; readers of a model directory go
through :func:`read_section` / :func:`flavor_section`, which check the untrusted mapping with
:meth:`FlavorSection.from_dict`: types, and bounds on every value that sizes an allocation
(``serving.max_batch``, buckets, io shapes, device count), so that a damaged or hostile file is
an ``ArtifactError`` naming the field, not an ``AttributeError`` deep in the loader or a
multi-gigabyte allocation. ``python_function.config`` (MLflow's ``model_config`` defaults) is
checked with the same bounds (:func:`validate_pyfunc_config`). The bounds and field checks live
in ``store/section_fields.py``, the ``python_function.config`` checks in
``store/pyfunc_config.py``; their public names are re-exported here.

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

from jaxexp_mlflow.codec.files import fail
from jaxexp_mlflow.codec.mlmodel import MLMODEL, check_node_type_names, read_mlmodel
from jaxexp_mlflow.store.pyfunc_config import PYFUNC_LOAD_TIME_ONLY as PYFUNC_LOAD_TIME_ONLY
from jaxexp_mlflow.store.pyfunc_config import validate_pyfunc_config as validate_pyfunc_config
from jaxexp_mlflow.store.section_fields import MAX_BATCH as MAX_BATCH
from jaxexp_mlflow.store.section_fields import MAX_BUCKETS as MAX_BUCKETS
from jaxexp_mlflow.store.section_fields import MAX_DEVICES as MAX_DEVICES
from jaxexp_mlflow.store.section_fields import MAX_DIM as MAX_DIM
from jaxexp_mlflow.store.section_fields import MAX_LEAVES as MAX_LEAVES
from jaxexp_mlflow.store.section_fields import MAX_RANK as MAX_RANK
from jaxexp_mlflow.store.section_fields import MAX_REQUEST_BYTES as MAX_REQUEST_BYTES
from jaxexp_mlflow.store.section_fields import MAX_VJP_ORDER as MAX_VJP_ORDER
from jaxexp_mlflow.store.section_fields import _io as _io
from jaxexp_mlflow.store.section_fields import _validate

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
