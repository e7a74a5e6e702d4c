"""Write the jaxexp files of a model directory: blob, params checkpoint, reference result."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax

from jaxexp_mlflow.codec import blob as blob_codec
from jaxexp_mlflow.codec.pytrees import register_for_save
from jaxexp_mlflow.errors import IncompatibleError, ParamsMismatchError, UnsupportedModelError
from jaxexp_mlflow.export import argument_names, export_function
from jaxexp_mlflow.params import names as named_params
from jaxexp_mlflow.store import artifact
from jaxexp_mlflow.store.section import FlavorSection, package_version


def _serialize(exported: Any, vjp_order: int) -> bytes:
    try:
        return bytes(exported.serialize(vjp_order=vjp_order))
    except Exception as err:
        text = str(err).lower()
        if any(w in text for w in ("pytree", "register", "keys", "serialization is supported")):
            hint = (
                "A given Exported whose arguments hold custom pytree nodes (Equinox modules, "
                "your own classes) needs them registered with "
                "jax.export.register_pytree_node_serialization. Simpler: pass the function "
                "fn(params, *inputs) with params=...: the flavor then exports against a flat "
                "dict of named arrays and keeps your tree inside the function."
            )
        else:
            hint = "Functions that cannot be differentiated need vjp_order=0."
        raise UnsupportedModelError(
            f"Exported.serialize(vjp_order={vjp_order}) failed for {exported.fun_name!r}: "
            f"{err}. {hint}"
        ) from err


def resolve_exported(
    exported: Any,
    *,
    params: Any,
    input_example: Any,
    vjp_order: int,
    batch_polymorphic: bool,
    platforms: Any,
    polymorphic_shapes: Any = None,
    route: str | None = None,
    taken: list | None = None,
) -> tuple[Any, bytes, tuple[str | None, str | None], Any]:
    """Normalise what the user passed into (Exported, blob bytes, exporter versions, description).

    Bytes are stored unchanged (a blob from an older JAX may not re-serialize under this one);
    one this JAX refuses is read through a route (``flavors.save_route``; ``route`` as asked),
    appended to ``taken``.
    """
    here = (jax.__version__, package_version("jaxlib"))
    if isinstance(exported, bytes | bytearray | memoryview):
        from jaxexp_mlflow.flavors import save_route

        data = bytes(exported)
        description = blob_codec.describe(data, source="the given blob")
        way = save_route.take(
            data,
            description,
            route=route,
            runs=input_example is not None,
            has_params=params is not None,
        )
        if taken is not None:
            taken.append(way)
        exp = way.exported
        depth = description.vjp_order
        if vjp_order > depth:
            raise UnsupportedModelError(
                f"vjp_order={vjp_order} was asked, but the given blob carries derivatives up to "
                f"order {depth} only. Serialize it again with Exported.serialize(vjp_order="
                f"{vjp_order}), or pass vjp_order<={depth}."
            )
        return exp, data, (None, None), description
    if polymorphic_shapes is not None and not (
        callable(exported) and not isinstance(exported, jax.export.Exported)
    ):
        raise UnsupportedModelError(
            "polymorphic_shapes= applies only to a function the flavor exports; an Exported "
            "or its bytes already has its shapes."
        )
    if route not in (None, "direct", "auto"):
        raise UnsupportedModelError(
            f"route={route!r} applies to a blob given as bytes only (a function or an Exported "
            "is exported or serialized by this jax, which reads it directly)."
        )
    if isinstance(exported, jax.export.Exported):
        exp = exported
    elif callable(exported):
        if platforms is not None and hasattr(exported, "platforms"):
            raise UnsupportedModelError("platforms= applies only to functions, not Exported.")
        fn, arrays = _named_function(exported, params)
        if platforms is not None:
            from jaxexp_mlflow.runtime.platforms import canonical

            platforms = tuple(canonical(p) for p in platforms)  # jax.export's: cuda, not gpu
        exp = export_function(
            fn,
            arrays,
            input_example,
            batch_polymorphic=batch_polymorphic,
            platforms=platforms,
            polymorphic_shapes=polymorphic_shapes,
            arg_names=argument_names(exported, has_params=params is not None),
        )
    else:
        raise UnsupportedModelError(
            f"Cannot save an object of type {type(exported).__name__} as a jaxexp model: expected "
            "a jax.export.Exported, the bytes of Exported.serialize(), or a jax.jit-wrapped "
            "function fn(params, *inputs). Export your function with jax.export.export first."
        )
    register_for_save(exp.in_tree)
    register_for_save(exp.out_tree)
    data = _serialize(exp, vjp_order)
    return exp, data, here, blob_codec.describe(data, source="the serialized export")


def _named_function(fn: Any, params: Any) -> tuple[Any, Any]:
    """``fn`` and ``params`` as exported: against a flat ``{name: array}`` of the params."""
    if params is None or isinstance(params, str | os.PathLike):
        return fn, params
    named = named_params.canonicalize(params)
    return named_params.bind(fn, named), named.arrays


def is_abstract(input_example: Any) -> bool:
    """An input example of ``jax.ShapeDtypeStruct`` leaves only: shapes to export against,
    no values to compute a reference from."""
    leaves = jax.tree.leaves(input_example)
    return bool(leaves) and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


def _host_reference(fn: Any, params: Any, input_example: Any, batch_polymorphic: bool) -> Any:
    """The reference outputs of a function exported for platforms this machine lacks: the same
    function lowered for this host's platform (not stored), run on the input example.
    ``jaxexp verify`` on the target machine compares against them with the cross-platform
    tolerances (``reproduce.DEFAULT_TOLERANCES``, docs/hardware.md)."""
    from jaxexp_mlflow.export import as_args
    from jaxexp_mlflow.runtime.platforms import running_platform

    fn, arrays = _named_function(fn, params)
    here = export_function(
        fn,
        arrays,
        input_example,
        batch_polymorphic=batch_polymorphic,
        platforms=(running_platform(),),
        announce=False,  # the export for the target platforms said it
    )
    args = as_args(input_example)
    outputs = here.call(arrays, *args) if arrays is not None else here.call(*args)
    return jax.block_until_ready(outputs)


def _refuse_if_it_cannot_run_here(conf: dict[str, Any], description: Any) -> None:
    """The reference outputs are computed here: judge first, rather than fail inside XLA."""
    from jaxexp_mlflow.runtime import compat

    verdict = compat.assess(conf, description=description)
    if verdict.status == compat.INCOMPATIBLE:
        raise IncompatibleError(
            "Cannot compute the reference outputs of this model here:\n- "
            + "\n- ".join(str(r) for r in verdict.reasons)
            + "\nSave it without input_example, or on a machine where it runs."
        )


def _prepare_for_iree(exp: Any, data: bytes, path: str | os.PathLike, n_params: int) -> Any:
    """The IREE backend's save-time preparation (``iree.prepare``); never fails a save."""
    from jaxexp_mlflow.iree.prepare import prepare

    try:
        return prepare(exp, data, path, n_param_leaves=n_params)
    except Exception as err:  # a model that IREE cannot run is still a good JAX model
        return {"problem": f"preparation failed: {type(err).__name__}: {err}"[:500]}


@dataclasses.dataclass(frozen=True)
class Written:
    """What :func:`write_model_files` wrote and the read-back needs."""

    section: FlavorSection  #: the MLmodel ``jaxexp`` section
    exported: Any  #: the ``Exported`` (to infer the signature from)
    params: Any  #: the params as stored, ``{name: array}`` (None: none, or a checkpoint path)
    host_outputs: Any  #: the reference of a host lowering (exported for another platform)
    params_proven: bool = False  #: every array file's checksum taken from ``params`` in memory
    #: what the user gave: ``readback.GIVEN_FUNCTION``, ``GIVEN_EXPORTED`` or ``GIVEN_BYTES``
    given: str | None = None


def write_model_files(
    exported: Any,
    path: str | os.PathLike,
    *,
    params: Any = None,
    vjp_order: int = 0,
    input_example: Any = None,
    batch_polymorphic: bool = True,
    platforms: Any = None,
    compression: Any = "default",
    durable: bool = True,
    polymorphic_shapes: Any = None,
    route: str | None = None,
) -> Written:
    """Write blob and params into ``path``.

    ``durable`` is kept for the callers' sake: the params are never fsynced here, the model's
    atomic directory (``store.atomic``) fsyncs every file at once when ``durable``.

    Returns a :class:`Written`: the MLmodel ``jaxexp`` section (a
    ``store.section.FlavorSection``), the ``Exported`` (to infer the signature from), the params
    as stored (``{name: array}``; None for none or an on-disk checkpoint), for a function
    exported for platforms this machine lacks the reference outputs of a host lowering of it
    (else None), and whether the manifest's checksum of every array file was taken from the
    params in memory (``params_proven``: the read-back then binds them). The reference
    result (the input example's, or a synthetic probe's) is computed later, by the read-back
    of the finished directory (``flavors.readback``), with the params as stored.
    """
    from jaxexp_mlflow import params as params_codec

    taken: list = []  # the route a blob given as bytes is read through (flavors.save_route)
    exp, data, versions, description = resolve_exported(
        exported,
        params=params,
        input_example=input_example,
        vjp_order=vjp_order,
        batch_polymorphic=batch_polymorphic,
        platforms=platforms,
        polymorphic_shapes=polymorphic_shapes,
        route=route,
        taken=taken,
    )
    artifact.check_free_space(path, artifact.model_bytes(data, params, input_example))
    n_params = 0
    proven = False  # every array's file checksum taken from the params in memory
    params_path = None
    params_conf: dict[str, Any] | None = None
    names_conf: dict[str, Any] = {}
    arrays = None  # the params as stored: {name: array}
    if params is not None:
        params_path = artifact.PARAMS_DIR
        target = Path(path, params_path)
        treedef = artifact.params_treedef(exp)
        names = named_params.export_param_names(treedef)
        avals = exp.in_avals[: treedef.num_leaves]
        names_conf = {
            "param_names": names,
            "param_keys": named_params.export_key_impls(names, avals),
            "params_layout": artifact.NAMED_LAYOUT,
        }
        if isinstance(params, str | os.PathLike):
            try:  # a checkpoint of this flavor's named layout (e.g. a refresh)...
                params_codec.check_checkpoint(params, artifact.params_target(exp, (), names_conf))
            except ParamsMismatchError:  # ... or of the export's own tree
                params_codec.check_checkpoint(params, artifact.params_target(exp))
                del names_conf["params_layout"]
            params_conf = params_codec.copy_checkpoint(params, target)
            n_params = treedef.num_leaves
        else:
            given = params
            if not isinstance(exported, bytes | bytearray | memoryview | jax.export.Exported):
                named = named_params.canonicalize(params)  # what export_function was given
                given = named.arrays
                names_conf["param_keys"].update(named.key_impls)
            n_params = artifact.check_params(exp, given)
            arrays = {
                n: named_params.unwrap_key(leaf)
                for n, leaf in zip(names, jax.tree.leaves(given), strict=True)
            }
            kw = {} if compression == "default" else {"compression": compression}
            # durable=False: save_model's atomic directory fsyncs the whole model before its
            # rename; checksums from memory: the read-back then reads every file against them
            # (flavors.readback), proving the files hold the params given (docs/params.md)
            report: dict[str, Any] = {}
            params_conf = params_codec.save_params(
                arrays, target, durable=False, checksums="memory", report=report, **kw
            )
            proven = _every_array_from_memory(report, exp)
        if not names_conf["param_keys"]:
            del names_conf["param_keys"]
    artifact.write_blob(path, data)

    node_types = sorted({*register_for_save(exp.in_tree), *register_for_save(exp.out_tree)})
    section = FlavorSection.describe_export(
        exp,
        vjp_order=description.vjp_order,
        exported_file=artifact.EXPORTED_FILE,
        exported_sha256=blob_codec.sha256(data),
        params_path=params_path,
        n_param_leaves=n_params,
        exporter_versions=versions,
        serialization_version=description.serialization_version,
        schema_generation=description.schema_generation,
        custom_call_targets=(
            None
            if description.custom_call_targets is None
            else list(description.custom_call_targets)
        ),
        node_types=node_types,
        in_shardings=description.in_shardings,
        out_shardings=description.out_shardings,
    )
    section = dataclasses.replace(
        section,
        params_format=params_conf,
        iree=_prepare_for_iree(exp, data, path, n_params),
        route=taken[0].record() if taken else None,
        **(taken[0].stored_facts(description) if taken else {}),
        **names_conf,
    )
    host_outputs = None
    if input_example is not None and not is_abstract(input_example):
        from jaxexp_mlflow.runtime.platforms import available_platforms

        function = callable(exported) and not isinstance(exported, jax.export.Exported)
        if function and not set(exp.platforms) & set(available_platforms()):
            # exported for a platform this machine lacks: reference from a host lowering
            host_outputs = _host_reference(exported, params, input_example, batch_polymorphic)
        elif taken and taken[0].route is not None:  # through the route: flavors.save_route
            from jaxexp_mlflow.flavors.save_route import check_runs

            check_runs(taken[0], section.to_dict(), description)
        else:  # the reference result is computed by the read-back
            _refuse_if_it_cannot_run_here(section.to_dict(), description)
    return Written(section, exp, arrays, host_outputs, proven, _given(exported))


def _given(exported: Any) -> str:
    """What the user passed, as the read-back's advice names it (``flavors.readback``)."""
    from jaxexp_mlflow.flavors import readback

    if isinstance(exported, bytes | bytearray | memoryview):
        return readback.GIVEN_BYTES
    if isinstance(exported, jax.export.Exported):
        return readback.GIVEN_EXPORTED
    return readback.GIVEN_FUNCTION


def _every_array_from_memory(report: dict[str, Any], exp: Any) -> bool:
    """Whether the manifest's checksum of every array's one chunk file was taken from the array
    in memory (``params.save_params(report=)``), for an export run on one device: the
    read-back's check of the files then proves the checkpoint equal to the params given, which
    it can bind rather than restore (``flavors.readback``)."""
    n = int(report.get("arrays", 0))
    files = report.get("from_memory") or {}
    return n > 0 and len(files) == n and int(getattr(exp, "nr_devices", 1)) == 1
