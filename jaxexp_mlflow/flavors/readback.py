"""Read a model directory back the way ``load_model`` does, before ``save_model`` publishes it.

``save_model`` never leaves behind a model that cannot load. Once every file is written (in the
temporary directory of ``store.atomic``), :func:`read_back`:

1. reads ``MLmodel`` from disk and takes its ``jaxexp`` section, as ``load_model`` does;
2. loads the directory with ``runtime.loader.load_directory`` (checksum, format, verdict,
   deserialization, device placement, params restored into the export's avals and shardings)
   when the model can run here, else the part that does not depend on this machine (blob
   deserialized, params restored to the export's avals on the host); a blob this JAX refuses
   is loaded through the route MLmodel records (``jaxexp.route``, ``flavors.save_route``);
3. checks the deserialized export against the one saved (trees, avals, platforms, devices);
4. with an input example, computes the reference outputs, which become the stored reference
   result. Where the manifest's checksum of every array file was taken from the params in
   memory while they were written (``params.memory_crc``; ``save_model``'s default, uncompressed
   host arrays), step 2 has read every file against those checksums, which proves the files
   hold the params given: the given arrays are bound (no second copy) and the model runs once,
   computing exactly what ``load_model`` of the directory computes. Otherwise (compressed
   params, arrays on an accelerator or sharded) the params are restored (up to
   ``RESTORE_MAX_BYTES``) and the model runs with the restored and with the given params
   through the same compiled function; they must agree, else the params were not stored
   faithfully and the model is refused.

:func:`check_reference` finally reads the stored reference arrays back and compares them bit for
bit with what was computed. Every failure is a typed error (``jaxexp_mlflow.errors``) saying
what was expected, what was found and what to do.
"""

from __future__ import annotations

import dataclasses
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlflow.models import Model
from mlflow.models.model import MLMODEL_FILE_NAME
from mlflow.utils.file_utils import get_total_file_size

from jaxexp_mlflow import settings
from jaxexp_mlflow.errors import ArtifactError, JaxExpError
from jaxexp_mlflow.store.section import FLAVOR_NAME, FlavorSection

#: Params bigger than this (bytes; env ``JAXEXP_READBACK_RESTORE_MAX_BYTES``) are not restored
#: into a second copy by the read-back: their checkpoint is verified whole (every file's
#: CRC-32C, tree, shapes, dtypes) and the given arrays are bound, so that saving or logging big
#: params keeps peak memory near one copy (docs/saving.md, docs/remote.md).
RESTORE_MAX_BYTES = 256 * 1024**2

#: Seconds spent in the last read-back (for benchmarks and tests; never asserted).
LAST_TIMINGS: dict[str, float] = {}


@dataclass
class ReadBack:
    """What the read-back found: the outputs for the input example (None without one)."""

    outputs: Any = None
    loaded_here: bool = False
    model: Any = None  # the JaxExpModel loaded from the directory (None when not loadable here)
    seconds: dict[str, float] = field(default_factory=dict)


def _flavor_conf(path: Path, flavor_name: str) -> dict[str, Any]:
    from jaxexp_mlflow.codec.mlmodel import read_mlmodel
    from jaxexp_mlflow.store.section import flavor_section

    return flavor_section(read_mlmodel(path), flavor_name)  # as load_model reads it


#: What the user gave ``save_model``, as the read-back's advice names it.
GIVEN_FUNCTION, GIVEN_EXPORTED, GIVEN_BYTES = "function", "Exported", "bytes"


def _kept(value: Any) -> str:
    """A field of an ``Exported`` as its serialization keeps it: avals by dtype and shape
    (``int32[b]``), since ``jax.export`` does not serialize an aval's ``weak_type`` (a weak
    type means nothing to a caller of the deserialized function, which gets the dtype)."""
    from jaxexp_mlflow.store.section import aval_str

    if isinstance(value, tuple | list) and all(hasattr(a, "str_short") for a in value):
        return str([aval_str(a) for a in value])
    return str(value)


def same_export_advice(given: str | None) -> str:
    """What to do when the export read back differs from the one saved, for what was given:
    a function (the flavor exported it), an ``Exported``, or its bytes."""
    if given == GIVEN_BYTES:
        return (
            "This is a bug in the serialization; save the jax.export.Exported object (not its "
            "bytes) and report the issue."
        )
    if given == GIVEN_EXPORTED:
        return (
            "The Exported given does not survive jax.export's own serialization round trip: "
            "pass the function fn(params, *inputs) with params= and input_example= instead "
            "(the flavor exports it), and report the issue with this message."
        )
    if given == GIVEN_FUNCTION:
        return (
            "The function's export does not survive jax.export's own serialization round "
            "trip (Exported.serialize, then jax.export.deserialize): report the issue with "
            "this message; batch_polymorphic=False or polymorphic_shapes= may avoid the "
            "difference meanwhile."
        )
    return "This is a bug in the serialization: report the issue with this message."


def _same_export(
    saved: Any, loaded: Any, given: str | None = None, *, remeshed: bool = False
) -> None:
    fields = ("in_tree", "out_tree", "in_avals", "out_avals", "platforms", "nr_devices")
    if remeshed:  # read back by the remesh route: the same function on the devices here
        fields = fields[:-1]
    diff = [
        f"{f}: expected {getattr(saved, f)}, found {getattr(loaded, f)}"
        for f in fields
        if _kept(getattr(saved, f)) != _kept(getattr(loaded, f))
    ]
    if diff:
        raise ArtifactError(
            "The serialized function read back from the model directory differs from the one "
            "saved:\n- " + "\n- ".join(diff) + "\n" + same_export_advice(given)
        )


def binds(params: Any, proven: bool = False) -> bool:
    """Whether the read-back binds these params (``{name: array}``) instead of restoring a
    second copy of them: more than ``RESTORE_MAX_BYTES`` (``JAXEXP_READBACK_RESTORE_MAX_BYTES``).
    Then only the checkpoint's files (every CRC-32C), tree, shapes and dtypes are checked.
    ``proven``: every array file's checksum was taken from these params in memory
    (``saving.Written.params_proven``): that check of the files proves them equal, at any size."""
    import jax

    if params is None or isinstance(params, str | os.PathLike):
        return False
    if proven:
        return True
    limit = settings.JAXEXP_READBACK_RESTORE_MAX_BYTES.get(RESTORE_MAX_BYTES)
    return sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(params)) > limit


def _bind_params(path: Path, conf: dict[str, Any]) -> None:
    """Bind the params checkpoint to this save (``params.manifest.bind_manifest``): MLmodel is
    written last, so a directory that mixes two saves (a re-log into the same ``model_id`` cut
    between the new params and the new MLmodel) is refused at load, never the previous function
    with the new weights. Done before the read-back's own load, which checks it."""
    from jaxexp_mlflow.codec import mlmodel
    from jaxexp_mlflow.params import manifest

    ckpt = Path(path, conf["params"]) if isinstance(conf.get("params"), str) else None
    if ckpt is None or ckpt.parent.resolve() != path.resolve():
        return  # the binding is checked against the MLmodel beside the checkpoint
    if (ckpt / manifest.MANIFEST_FILE).is_file():
        manifest.bind_manifest(ckpt, manifest.model_identity(mlmodel.read_mlmodel(path)))


def _portable_load(path: Path, conf: dict[str, Any], bind: Any = None) -> Any:
    """Deserialize the blob and restore the params to the export's avals (no placement);
    ``bind``: check the checkpoint against those avals and take these params instead."""
    from jaxexp_mlflow.codec import blob
    from jaxexp_mlflow.params import check_checkpoint, restore_params, verify_manifest
    from jaxexp_mlflow.store import artifact

    data = artifact.read_blob(path, conf)
    source = str(Path(path, conf.get("exported_file", artifact.EXPORTED_FILE)))
    exported = blob.deserialize_checked(
        data, source=source, node_types=conf.get("pytree_node_types")
    )
    params = None
    if conf.get("params"):
        target = artifact.params_target(exported, (), conf)
        ckpt = Path(path, conf["params"])
        if bind is None:
            params = restore_params(ckpt, target=target)
        else:
            verify_manifest(ckpt).verify_files()
            check_checkpoint(ckpt, target)
            params = bind
    return exported, params


def _verify_params_files(path: Path, conf: dict[str, Any]) -> None:
    """Every file of the model's checkpoint against its manifest (sizes, CRC-32C): the
    manifest's array checksums were taken from the params in memory (``params.memory_crc``),
    so this proves that the files hold the params given."""
    from jaxexp_mlflow.params import verify_manifest

    if isinstance(conf.get("params"), str):
        verify_manifest(Path(path, conf["params"])).verify_files()


def _assert_outputs_agree(got: list, want: list, what: str) -> None:
    """Compare flat output leaves: exact for integers/bools, within float rounding otherwise."""
    import jax.numpy as jnp
    import numpy as np

    problems = []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape or g.dtype != w.dtype:
            found = f"{g.dtype}{list(g.shape)}"
            problems.append(f"out_{i}: expected {w.dtype}{list(w.shape)}, found {found}")
        elif not jnp.issubdtype(w.dtype, jnp.inexact):
            if not np.array_equal(g, w):
                problems.append(f"out_{i}: values differ")
        else:
            wide = np.complex128 if jnp.issubdtype(w.dtype, jnp.complexfloating) else np.float64
            g64, w64 = g.astype(wide), w.astype(wide)
            if not np.allclose(g64, w64, rtol=1e-5, atol=1e-6, equal_nan=True):
                err = float(np.nanmax(np.abs(g64 - w64))) if g64.size else 0.0
                problems.append(f"out_{i}: values differ (max abs difference {err:.3g})")
    if problems:
        raise ArtifactError(f"{what}:\n- " + "\n- ".join(problems))


def read_back(
    path: str | os.PathLike,
    exported: Any,
    *,
    flavor_name: str,
    params: Any = None,
    inputs: tuple | None = None,
    target: str | os.PathLike | None = None,
    params_proven: bool = False,
    given: str | None = None,
) -> ReadBack:
    """Load the model at ``path`` as ``load_model`` would and run it on ``inputs`` if given.

    ``exported`` is the ``Exported`` that was saved; ``params`` the params as written
    (``{name: array}``, see ``saving.write_model_files``; None for none or for an on-disk
    checkpoint, which the model's copy is made of). ``target`` is the path the model is being
    saved to (named in errors). ``params_proven``: every array file's checksum in the manifest
    was taken from ``params`` in memory (``saving.Written``), so the files checked against it
    hold exactly ``params``, which are then bound and run once. ``given``: what the user
    passed (``GIVEN_FUNCTION``, ``GIVEN_EXPORTED``, ``GIVEN_BYTES``), which the advice of a
    failed comparison names. Returns the outputs for
    ``inputs`` (the model run with the params as stored), and the loaded model.
    """
    import jax

    from jaxexp_mlflow.flavors import save_route
    from jaxexp_mlflow.runtime import cache, compat, routes
    from jaxexp_mlflow.runtime.loader import load_directory

    # the persistent compilation cache, as load_model turns it on: a later save of the same
    # function (a training hook's checkpoints, a re-log) and a later load's first call of the
    # example's shape read the executables compiled here instead of compiling them again
    cache.configure()
    path = Path(path)
    where = os.fspath(target if target is not None else path)
    t0 = time.perf_counter()
    conf = _flavor_conf(path, flavor_name)
    _bind_params(path, conf)
    route = save_route.recorded_name(conf)  # a blob this jax refuses: read through its route
    verdict = save_route.verdict_for(conf)
    result = ReadBack(loaded_here=verdict.status != compat.INCOMPATIBLE)
    bind = params if binds(params, params_proven) else None
    try:
        if route in (routes.BRIDGE, routes.RECORDED_ENV):
            model = save_route.load_for_readback(path, conf, bind)
            loaded_exp, restored = model.exported, model.params
            result.loaded_here = route == routes.BRIDGE
            if route == routes.RECORDED_ENV or bind is not None:  # params not read there
                _verify_params_files(path, conf)
        elif result.loaded_here:
            model = load_directory(path, conf, bind=bind, route=route)
            if bind is not None:
                _commit_params(model)
            loaded_exp, restored = model.exported, model.params
        else:
            model = None
            scope = routes.expired_flag if route == routes.EXPIRED_FLAG else nullcontext
            with scope():
                loaded_exp, restored = _portable_load(path, conf, bind)
    except JaxExpError as err:
        raise type(err)(
            f"The model saved to {where} does not load back, so it was not saved: {err.message}"
        ) from err
    except Exception as err:  # noqa: BLE001 - a raw JAX/Orbax error: say what it was
        raise ArtifactError(
            f"The model saved to {where} does not load back, so it was not saved: "
            f"{type(err).__name__}: {err}. Check that params are arrays of the export's avals; "
            "report the issue with this message if they are."
        ) from err
    result.model = model if route != routes.RECORDED_ENV else None  # no synthetic probes there
    _same_export(exported, loaded_exp, given, remeshed=route == routes.REMESH)
    result.seconds["load"] = time.perf_counter() - t0
    if inputs is not None and model is not None:
        t1 = time.perf_counter()
        if model.has_params and params is not None and bind is None:
            # restored params against the given ones, through the same executable
            outputs = model.call_with_params(model.params, *inputs)
            placed = _placed_like(_as_model_params(params, conf), restored)
            expected = model.call_with_params(placed, *inputs)
            _assert_outputs_agree(
                jax.tree.leaves(outputs),
                jax.tree.leaves(expected),
                "The params read back from the model directory do not reproduce the outputs "
                "of the params given to save_model, so the model was not saved. Check that "
                "params have distinct key paths (e.g. not both {'a.b': x} and {'a': {'b': y}})"
                " and report the issue if they do",
            )
        else:  # the call load_model's model makes: its executable, as runtime.cpu_compile chose
            outputs = model(*inputs)
        result.outputs = jax.block_until_ready(outputs)
        result.seconds["run"] = time.perf_counter() - t1
    LAST_TIMINGS.clear()
    LAST_TIMINGS.update(result.seconds)
    return result


def _commit_params(model: Any) -> None:
    """Put the bound params where a restore puts them: committed to the placement's shardings
    (the default device where it leaves the choice to JAX). The reference run then compiles the
    very module ``load_model``'s first call compiles, whose executable the persistent cache
    keeps (uncommitted arrays lower without sharding annotations: another cache key). A jax
    array already there is not copied; numpy arrays are moved once rather than at every call."""
    import jax

    placement = model.placement
    if not isinstance(model.params, dict):  # an export's own tree (a checkpoint's layout)
        return
    try:
        default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        names = list(model.params)  # {name: array} in the export's leaf order
        shardings = list(placement.in_shardings[: len(names)]) or [None] * len(names)
        model.params = {
            name: jax.device_put(model.params[name], s if s is not None else default)
            for name, s in zip(names, shardings, strict=True)
        }
    except Exception:  # noqa: BLE001 - left as given: it runs the same, compiled apart
        return


def _as_model_params(params: Any, conf: dict[str, Any]) -> Any:
    """The params as stored (``{name: array}``) in the form ``model.params`` has: typed keys."""
    if conf.get("param_names") is None:
        return params
    from jaxexp_mlflow.params.names import wrap_keys

    return wrap_keys(params, conf.get("param_keys"))


def _placed_like(params: Any, restored: Any) -> Any:
    """The given params, leaf by leaf on the devices/shardings of the restored ones."""
    import jax

    leaves = jax.tree.leaves(params)
    placed = [
        jax.device_put(g, r.sharding)
        for g, r in zip(leaves, jax.tree.leaves(restored), strict=True)
    ]
    return jax.tree.unflatten(jax.tree.structure(restored), placed)


def check_reference(path: str | os.PathLike, flavor_name: str, outputs: Any) -> None:
    """The stored reference outputs must equal ``outputs`` bit for bit (npz round trip)."""
    import jax
    import numpy as np

    from jaxexp_mlflow.store import artifact

    conf = _flavor_conf(Path(path), flavor_name)
    stored = artifact.read_reference(path, conf)
    if stored is None:
        raise ArtifactError(
            f"The reference result written to {path} is not recorded in MLmodel. Report the issue."
        )
    _, stored_out = stored
    want = [np.asarray(x) for x in jax.tree.leaves(outputs)]
    bad = [
        f"out_{i}"
        for i, (g, w) in enumerate(zip(stored_out, want, strict=True))
        if g.dtype != w.dtype or g.shape != w.shape or g.tobytes() != w.tobytes()
    ]
    if len(stored_out) != len(want) or bad:
        raise ArtifactError(
            f"The reference outputs stored in {path} do not read back as computed ({bad or 'count'}"
            "). Report the issue; save without input_example meanwhile."
        )


def one_batch_axis(in_specs: list[Any], out_specs: list[Any]) -> bool:
    """Whether every input and output leaf shares one symbolic leading dimension: the models
    pyfunc could pad to buckets, whose rows the read-back then tries to prove independent."""
    from jaxexp_mlflow.runtime.buckets import batch_symbol

    if not in_specs:
        return False
    syms = batch_symbol([s.symbols for s in in_specs], [s.symbols for s in out_specs])
    return syms is not None


def read_back_and_record(
    path: str,
    target: str,
    exp: Any,
    mlflow_model: Model,
    section: FlavorSection,
    *,
    params: Any,
    input_example: Any,
    host_outputs: Any = None,
    batched: bool = False,
    params_proven: bool = False,
    given: str | None = None,
) -> None:
    """Never publish what cannot load: read ``path`` back as load_model does, store the reference.

    ``batched`` (one symbolic batch axis everywhere): the loaded model's rows are also put to
    the proof of ``runtime.rows`` on the same inputs, recorded as ``jaxexp.padding`` (not run,
    and recorded not proven, when the saved ``serving_config`` turns buckets off).

    With an input example its outputs (computed from the params as stored) become the reference;
    without one, a synthetic probe's when the model runs here (``probes``), from the same
    loaded model: the export is compiled once either way. ``params`` are the params as stored
    (``{name: array}``, from ``saving.write_model_files``), None for none or a checkpoint path.
    ``host_outputs``: for a function exported for platforms this machine lacks, the reference
    computed by a host lowering of it (the read-back then deserializes and restores only).
    ``params_proven``, ``given``: see :func:`read_back` (without ``given``, a section that
    records no exporting jax, as for a blob given as bytes, names bytes).
    """
    from jaxexp_mlflow.export import as_args
    from jaxexp_mlflow.runtime import probes
    from jaxexp_mlflow.store import artifact

    inputs = None if input_example is None else as_args(input_example)
    found = read_back(
        path,
        exp,
        flavor_name=FLAVOR_NAME,
        params=params,
        inputs=inputs,
        target=target,
        params_proven=params_proven,
        given=given or (GIVEN_BYTES if section.jax_version is None else None),
    )
    outputs, platform = found.outputs, None if found.model is None else found.model.platform
    if outputs is None and host_outputs is not None:
        from jaxexp_mlflow.runtime.platforms import running_platform

        outputs, platform = host_outputs, running_platform()
    if inputs is not None:
        reference = {"reference": artifact.write_reference(path, inputs, outputs, platform)}
    elif found.model is not None:
        reference = probes.store_reference(path, exp, section.to_dict(), None, model=found.model)
    else:
        reference = {}
    if batched and found.model is not None:
        from jaxexp_mlflow.runtime import buckets

        if buckets.saved_off(section.serving):  # nothing to pad for: no padded run
            reference["padding"] = {
                "rows_independent": False,
                "proof": "not run: saved with serving_config buckets off",
            }
        else:
            reference["padding"] = _prove_rows(found.model, exp, inputs, found.outputs)
    if reference.get("reference") or reference.get("padding"):
        mlflow_model.add_flavor(FLAVOR_NAME, **dataclasses.replace(section, **reference).to_dict())
        write_mlmodel(mlflow_model, path)
    if inputs is not None:
        check_reference(path, FLAVOR_NAME, outputs)


def _prove_rows(model: Any, exp: Any, inputs: Any, outputs: Any = None) -> dict[str, Any]:
    """The ``jaxexp.padding`` record: ``runtime.rows.prove`` on the input example's leaves, or
    on the synthetic probe the reference was made of (a probe of the export's avals otherwise).
    ``outputs``: the read-back's run of the same model on the input example, reused as the
    proof's unpadded run (one model run fewer per save). A model that loops (a decode loop:
    ``runtime.buckets.has_loop``) is proven on one padded batch (``rows.LOOP_FILLERS``)."""
    import jax

    from jaxexp_mlflow.runtime import buckets, probes, rows

    def call(leaves: list[Any]) -> list[Any]:
        return probes.call_flat(model, leaves)

    fillers = rows.LOOP_FILLERS if buckets.has_loop(model.exported) else rows.FILLERS
    if inputs is not None:
        exact = None if outputs is None else jax.tree.leaves(outputs)
        return rows.prove(
            call, jax.tree.leaves(inputs), source="input example", exact=exact, fillers=fillers
        )
    try:
        avals = list(exp.in_avals)[model._n_param_leaves :]
        leaves = probes.make(avals).leaves
    except Exception as err:  # noqa: BLE001 - no probe: not proven, never a failed save
        return {"rows_independent": False, "proof": f"no synthetic probe: {err}"[:300]}
    return rows.prove(call, leaves, source="synthetic probe", fillers=fillers)


def write_mlmodel(mlflow_model: Model, path: str) -> None:
    """Write ``MLmodel`` into ``path`` with the directory's size; a metadata value YAML cannot
    hold is an ``UnsupportedModelError`` (``save_model`` writes it before the read-back,
    which rewrites it with the reference)."""
    import yaml

    from jaxexp_mlflow.errors import UnsupportedModelError

    if size := get_total_file_size(path):
        mlflow_model.model_size_bytes = size
    try:
        mlflow_model.save(os.path.join(path, MLMODEL_FILE_NAME))
    except yaml.YAMLError as err:
        raise UnsupportedModelError(
            f"Cannot write MLmodel: expected metadata= (and the other MLmodel fields) to hold "
            f"YAML-serializable values (str, numbers, bool, None, lists, dicts), found {err}. "
            "Convert those values, e.g. with str()."
        ) from err
