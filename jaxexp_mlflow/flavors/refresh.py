"""Refresh an archived model: re-export it with the running JAX and log it as a new model.

JAX reads a serialized export for about 6 months after it was written (newer jax refuse older
blobs outright). ``refresh`` is how an archive outlives that window: it deserializes the blob
while this JAX still reads it, wraps ``Exported.call`` in a new ``jax.export.export`` (same
platforms, shardings, symbolic shapes, vjp order and disabled safety checks), checks that the
refreshed function reproduces the model's stored reference outputs, and logs the result (same
params checkpoint, signature and reference input) as a new model with tags pointing at its source.
A model without a reference (a bare blob saved as bytes) is proved on synthetic probes instead
(``probes.py``: the old and the refreshed blob on inputs made from the avals), and the refreshed
model says so in its tags (``jaxexp.refresh.proof``, ``jaxexp.refresh.synthetic_probes``).

The module inside is the old one, inlined: a refresh renews the serialization, not the kernels.
A blob that calls custom-call targets this jaxlib no longer registers (LAPACK kernels of
jax 0.4.x) cannot be refreshed; export it again from its Python source.

jax >= 0.11.1 reads a blob of serialization schema < 5 (jax <= 0.7) only with its flag
``jax_export_deserialize_expired_versions`` (``JAX_EXPORT_DESERIALIZE_EXPIRED_VERSIONS=1``): with
it set, the refresh runs (the verdict's ``expired`` is then a warning); without, it is refused
naming the flag. A blob with old-style HLO shardings it does not read at all: refresh it with an
older jax (e.g. the model's recorded environment).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from jaxexp_mlflow.errors import ArtifactError, IncompatibleError
from jaxexp_mlflow.runtime import compat, devices, routes
from jaxexp_mlflow.runtime.loader import bind_model

_logger = logging.getLogger(__name__)

TAG_PREFIX = "jaxexp.refresh."
#: Reasons a refresh fixes rather than suffers from.
_REFRESHABLE = {"window_backward", "jaxlib_unknown"}


class RefreshError(IncompatibleError):
    """The model cannot be refreshed here, or the refreshed model does not reproduce it."""


def reexport(exported: Any, placement: Any = None) -> Any:
    """A new ``Exported`` made by the running JAX that calls ``exported``.

    Keeps platforms, symbolic shapes, input/output shardings (as ``NamedSharding`` on the
    placement's mesh, which is what jax >= 0.10 serializes) and disabled safety checks.
    ``placement`` (from ``devices.plan``) is required for multi-device exports.
    """
    import jax

    n = int(exported.nr_devices)
    if n > 1 and (placement is None or placement.mesh is None):
        placement = devices.plan(exported)
    in_shardings = placement.in_shardings if n > 1 else (None,) * len(exported.in_avals)
    specs = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
        for a, s in zip(exported.in_avals, in_shardings, strict=True)
    ]
    args, kwargs = jax.tree.unflatten(exported.in_tree, specs)
    call = placement.exported if placement is not None else exported

    def wrapper(*a: Any, **k: Any) -> Any:
        return call.call(*a, **k)

    wrapper.__name__ = wrapper.__qualname__ = str(exported.fun_name)
    if n > 1:
        out = jax.tree.unflatten(exported.out_tree, list(placement.out_shardings))
        jitted = jax.jit(wrapper, out_shardings=out)
    else:
        jitted = jax.jit(wrapper)
    checks = list(exported.disabled_safety_checks)
    return jax.export.export(jitted, platforms=tuple(exported.platforms), disabled_checks=checks)(
        *args, **kwargs
    )


def _judge(
    meta: dict,
    description: Any,
    model_uri: str,
    options: dict,
    *,
    flag: bool = False,
    remesh: bool = False,
) -> compat.Verdict:
    from jaxexp_mlflow.runtime import routes

    other = bool(options.get("allow_other_platform", False))
    if flag:  # the expired-flag route: judged as this jax reads it with the flag set
        verdict = routes.judged_with_flag(meta, description, allow_other_platform=other)
    else:
        verdict = compat.assess(meta, description=description, allow_other_platform=other)
    if remesh:  # judged as the re-meshed blob runs: on the devices here
        from jaxexp_mlflow.runtime.device_routes import judged_for_remesh

        try:
            verdict = judged_for_remesh(verdict, meta, description, "")
        except IncompatibleError as err:
            raise RefreshError(f"Cannot refresh {model_uri} by remesh: {err}") from err
    blocking = [
        r
        for r in verdict.reasons
        if r.severity == compat.INCOMPATIBLE and r.code not in _REFRESHABLE
    ]
    if blocking:
        why = "\n- ".join(str(r) for r in blocking)
        extra = ""
        codes = {r.code for r in blocking}
        if "expired" in codes and not codes & {"hlo_sharding", "custom_calls", "kernel_abi"}:
            extra += (
                f"\nSet {compat.EXPIRED_ENV}=1 and run the refresh again, or take the route that "
                f"sets it around the deserialization only (`jaxexp refresh --route "
                f"{routes.EXPIRED_FLAG}`, refresh(uri, route={routes.EXPIRED_FLAG!r})): the "
                "refreshed model is of this jax's schema and loads without the flag."
            )
        if "hlo_sharding" in codes:
            extra += (
                "\nA refresh must read the blob, and this jax cannot read its old-style "
                "shardings: run `jaxexp refresh --route bridge` (jax 0.10.2 in a cached venv "
                "reads and re-exports it first), or `jaxexp refresh` with an older jax/jaxlib "
                "that still reads it (e.g. in the model's recorded environment, the one "
                "`jaxexp verify --env-manager uv` builds)."
            )
        if codes & {"custom_calls", "kernel_abi"}:
            extra += (
                "\nA refresh re-serializes the same module, so it would keep calling these "
                "kernels: it cannot fix this. Export the function again from its Python source "
                "with this jax (its new lowering uses the kernels this jaxlib has), or keep "
                "running the model with a jaxlib that has them."
            )
        raise RefreshError(f"Cannot refresh {model_uri} here:\n- {why}{extra}")
    for r in verdict.reasons:
        _logger.info("jaxexp refresh: %s", r)
    return verdict


def _check(
    new_exp: Any,
    local: Path,
    meta: dict,
    placement: Any,
    *,
    rtol: float | None,
    atol: float | None,
) -> list[Any]:
    from jaxexp_mlflow.archive import reproduce

    model = bind_model(new_exp, local, meta, placement)
    return reproduce.verify_directory(model, local, rtol=rtol, atol=atol)


def _check_on_probes(
    old: Any, new: Any, *, rtol: float | None, atol: float | None
) -> tuple[list[Any], list[Any]]:
    """Run the old and the refreshed model on synthetic probes; (checks, probes)."""
    from jaxexp_mlflow.archive import reproduce
    from jaxexp_mlflow.runtime import probes

    n = old._n_param_leaves
    avals = list(old.exported.in_avals)[n:]

    def both(leaves: list) -> list[Any]:
        want = probes.call_flat(old, leaves)
        got = probes.call_flat(new, leaves)
        return reproduce.compare_outputs(got, want, rtol=rtol, atol=atol)

    runs = probes.run_probes(avals, both)
    checks = [c for _, cs in runs for c in cs]
    return checks, [p for p, _ in runs]


def _proof(meta: dict, probes_used: list[Any]) -> str:
    """What the before/after comparison ran on (the ``jaxexp.refresh.proof`` tag)."""
    if probes_used:
        shapes = " | ".join(p.describe() for p in probes_used)
        return f"{len(probes_used)} synthetic probes, old vs refreshed blob ({shapes})"
    if meta.get("reference_synthetic"):
        return "stored synthetic reference (made at save time from a probe)"
    return "stored reference input/outputs"


def _bridge(
    data: bytes, description: Any, model_uri: str, synthetic: bool
) -> tuple[bytes, str, Any, str]:
    """(the blob re-exported by jax ``routes.BRIDGE_JAX`` in a cached venv, its source label,
    its description, that jax version), for ``refresh(bridge=True)``."""
    from jaxexp_mlflow.archive import env_routes
    from jaxexp_mlflow.codec import blob
    from jaxexp_mlflow.runtime import routes

    if synthetic:
        raise RefreshError(
            f"{model_uri} has no stored reference, which a bridged refresh checks against (the "
            "old blob cannot run here to make probe outputs). Refresh it with a jax that reads "
            f"it (e.g. jax {routes.BRIDGE_JAX}), or log it with an input example first."
        )
    try:
        new, _ = env_routes.reexport_in(
            routes.BRIDGE_JAX, data, nr_devices=int(description.nr_devices)
        )
    except Exception as err:
        raise RefreshError(
            f"jax {routes.BRIDGE_JAX} (the bridge) could not re-export {model_uri}: {err}"
        ) from err
    source = f"{model_uri} (re-exported by jax {routes.BRIDGE_JAX})"
    return new, source, blob.describe(new, source=source), routes.BRIDGE_JAX


def _route(route: str | None, bridge: bool, meta: dict, description: Any, options: dict) -> str:
    """The route a refresh reads the source through (see :func:`refresh`)."""
    from jaxexp_mlflow.flavors.save_route import recorded_route_here

    if bridge:
        return routes.BRIDGE
    if route is None:
        other = bool(options.get("allow_other_platform", False))
        recorded = recorded_route_here(meta, description, allow_other_platform=other)
        return recorded.name if recorded is not None else routes.DIRECT
    if route not in (routes.DIRECT, routes.EXPIRED_FLAG, routes.BRIDGE, routes.REMESH):
        raise RefreshError(
            f"route={route!r}: expected one of {routes.DIRECT}, {routes.EXPIRED_FLAG}, "
            f"{routes.BRIDGE}, {routes.REMESH} (a refresh re-exports the blob here, so it reads "
            "it here)."
        )
    return route


def refresh(
    model_uri: str,
    *,
    name: str = "model",
    registered_model_name: str | None = None,
    run_id: str | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    bridge: bool = False,
    route: str | None = None,
    **options: Any,
) -> Any:
    """Re-export the jaxexp model at ``model_uri`` with the running JAX; log it as a new model.

    ``route``: ``direct``, ``expired-flag`` (JAX's flag set around the deserialization only, for
    a blob of schema < 5 under jax >= 0.11.1), ``bridge`` (as ``bridge=True``) or ``remesh`` (a
    model for more devices than are here, its meshes resized onto ``devices=M``, default the
    devices visible; proved against the stored reference within ``remesh.RTOL``/``ATOL``
    unless ``rtol``/``atol`` are given, and tagged ``jaxexp.refresh.route``); None takes the
    route the model was logged through (MLmodel ``jaxexp.route``, ``flavors.save_route``) where
    this jax still refuses it as it is, else ``direct``.

    ``bridge=True`` (the ``bridge`` route, ``runtime/routes.py``) has jax ``routes.BRIDGE_JAX``
    read the blob in a cached venv and re-export it first: for a blob this jax cannot read at all
    (old-style HLO shardings under jax >= 0.11.1). The bridged blob is checked like any blob, then
    refreshed here; it needs the model's stored reference (the old blob cannot run here to make
    probes).

    The refreshed model must reproduce the source's stored reference outputs (or, without a
    reference, the old blob's outputs on synthetic probes) (per-dtype
    tolerances, or ``rtol``/``atol``) before anything is logged; otherwise ``RefreshError``.
    It is logged under ``name`` in run ``run_id`` (default: the active run, else a new run), with
    the source's params checkpoint, signature and reference input, tagged ``jaxexp.refresh.*``
    (source URI, source jax/jaxlib versions, max error), and registered as a new version of
    ``registered_model_name`` if given. ``options`` go to device placement
    (``allow_other_platform``, ``devices``). Returns the new model's ``ModelInfo``. A remote
    source is downloaded into a temporary directory (bounded: ``download.download_model``)
    that is removed afterwards, on success or failure.
    """
    with contextlib.ExitStack() as stack:
        return _refresh(
            _source_dir(model_uri, stack),
            model_uri,
            name=name,
            registered_model_name=registered_model_name,
            run_id=run_id,
            rtol=rtol,
            atol=atol,
            bridge=bridge,
            route=route,
            **options,
        )


def _source_dir(model_uri: str, stack: contextlib.ExitStack) -> Path:
    """The source model as a local directory: a local path as it is; anything else downloaded
    with ``download.download_model`` (listings bounded, each file stopped at its listed size)
    into a temporary directory ``stack`` removes, on success or failure."""
    from urllib.parse import unquote, urlparse

    from jaxexp_mlflow.store.download import download_model

    if os.path.isdir(model_uri):
        return Path(model_uri)
    if model_uri.startswith("file:") and os.path.isdir(unquote(urlparse(model_uri).path)):
        return Path(unquote(urlparse(model_uri).path))
    tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="jaxexp-refresh-"))
    return Path(download_model(model_uri, tmp).path)


def _refresh(
    local: Path,
    model_uri: str,
    *,
    name: str,
    registered_model_name: str | None,
    run_id: str | None,
    rtol: float | None,
    atol: float | None,
    bridge: bool,
    route: str | None,
    **options: Any,
) -> Any:
    """:func:`refresh` of the source model at ``local``."""
    import jax
    import mlflow
    from mlflow.models import Model
    from mlflow.models.model import MLMODEL_FILE_NAME

    from jaxexp_mlflow.codec import blob
    from jaxexp_mlflow.flavors import jaxexp as flavor
    from jaxexp_mlflow.store import artifact
    from jaxexp_mlflow.store.section import package_version, read_section

    meta = read_section(local)
    source_model = Model.load(os.path.join(local, MLMODEL_FILE_NAME))
    data = artifact.read_blob(local, meta)
    source = str(Path(local, meta.get("exported_file", artifact.EXPORTED_FILE)))
    description = blob.describe(data, source=source)
    synthetic = bool(meta.get("reference_synthetic")) or not meta.get("reference")
    route = _route(route, bridge, meta, description, options)
    bridged_from = None
    if route == routes.BRIDGE:
        data, source, description, bridged_from = _bridge(data, description, model_uri, synthetic)
    flag = route == routes.EXPIRED_FLAG
    by_remesh = route == routes.REMESH
    if by_remesh and synthetic:
        raise RefreshError(
            f"{model_uri} has no stored reference, which a refresh by remesh is proved against "
            f"(the {meta.get('nr_devices')}-device blob cannot run here to make probe outputs). "
            "Log it with an input example on a machine with its devices first."
        )
    verdict = _judge(meta, description, model_uri, options, flag=flag, remesh=by_remesh)

    with routes.expired_flag() if flag else contextlib.nullcontext():
        exported = blob.deserialize_checked(
            data, source=source, node_types=meta.get("pytree_node_types"), description=description
        )
    if flag:  # its VJP is read lazily, at the new export's serialization: with the flag too
        exported = routes.with_scoped_vjp(exported)
    plan_opts = {k: options[k] for k in ("allow_other_platform", "devices") if k in options}
    remeshed = None
    if by_remesh:
        from jaxexp_mlflow.runtime.remesh import ATOL, RTOL, remesh_for_load

        try:
            remeshed, plan_opts = remesh_for_load(exported, plan_opts)
        except IncompatibleError as err:
            raise RefreshError(f"Cannot refresh {model_uri} by remesh: {err}") from err
        exported = remeshed.exported
        # proved against the reference stored from the N-device run: a cross-device tolerance
        rtol, atol = (RTOL if rtol is None else rtol), (ATOL if atol is None else atol)
    placement = devices.plan(exported, **plan_opts)
    try:
        new_exp = reexport(exported, placement)
    except Exception as err:
        raise RefreshError(
            f"jax {jax.__version__} could not re-export {meta.get('fun_name')!r} from "
            f"{model_uri}: {err}. Try a jax closer to the exporter's "
            f"({meta.get('jax_version') or 'unknown: a bare blob'})."
        ) from err
    new_placement = devices.plan(new_exp, **plan_opts)
    probes_used: list[Any] = []
    try:
        if meta.get("reference"):
            checks = _check(new_exp, local, meta, new_placement, rtol=rtol, atol=atol)
        else:  # no reference: the old and the new blob on synthetic probes (probes.py)
            old_model = bind_model(exported, local, meta, placement)
            new_model = bind_model(new_exp, local, meta, new_placement)
            checks, probes_used = _check_on_probes(old_model, new_model, rtol=rtol, atol=atol)
    except ArtifactError:
        raise
    except Exception as err:
        what = "its reference input" if meta.get("reference") else "synthetic probe inputs"
        raise RefreshError(
            f"The refreshed export of {model_uri} failed to run {what}: {err}"
        ) from err
    failed = [c for c in checks if not c.passed]
    if failed:
        lines = "\n".join(
            f"- out_{c.index} {c.dtype}{list(c.shape)}: max abs err {c.max_abs_err:.3g}, "
            f"max rel err {c.max_rel_err:.3g} (rtol {c.rtol}, atol {c.atol})"
            for c in failed
        )
        raise RefreshError(
            f"The refreshed export of {model_uri} does not reproduce the stored reference:\n"
            f"{lines}\nNothing was logged. If the differences are acceptable numerical drift, "
            "pass looser rtol=/atol=."
        )

    example = None  # a synthetic reference is made again by save_model, marked as such
    if not synthetic:
        inputs, _ = artifact.read_reference(local, meta)
        n_params = int(meta.get("n_param_leaves") or 0)
        args, kwargs = jax.tree.unflatten(exported.in_tree, [None] * n_params + list(inputs))
        if kwargs:
            raise RefreshError(
                f"{model_uri} takes keyword arguments {sorted(kwargs)}, which a logged input "
                "example cannot carry; refresh supports positional inputs only."
            )
        example = tuple(args[1:] if meta.get("params") else args)
    tags = {
        TAG_PREFIX + "source_uri": model_uri,
        TAG_PREFIX + "source_jax_version": str(meta.get("jax_version") or "unknown (bare blob)"),
        TAG_PREFIX + "source_jaxlib_version": str(meta.get("jaxlib_version") or "unknown"),
        TAG_PREFIX + "source_sha256": str(meta.get("exported_sha256")),
        TAG_PREFIX + "jax_version": jax.__version__,
        TAG_PREFIX + "jaxlib_version": str(package_version("jaxlib")),
        TAG_PREFIX + "verdict": verdict.status,
        TAG_PREFIX + "max_abs_err": f"{max((c.max_abs_err for c in checks), default=0.0):.3g}",
        TAG_PREFIX + "proof": _proof(meta, probes_used),
        TAG_PREFIX + "synthetic_probes": str(synthetic).lower(),
    }
    if bridged_from:
        tags[TAG_PREFIX + "route"] = f"bridge (jax {bridged_from})"
    elif flag:
        tags[TAG_PREFIX + "route"] = f"{routes.EXPIRED_FLAG} (jax {jax.__version__})"
    elif remeshed is not None:
        tags[TAG_PREFIX + "route"] = f"{routes.REMESH}: {remeshed.change}"
        tags[TAG_PREFIX + "tolerance"] = f"cross-device: rtol {rtol:g}, atol {atol:g}"
    if getattr(source_model, "model_id", None):
        tags[TAG_PREFIX + "source_model_id"] = source_model.model_id
    metadata = dict(source_model.metadata or {})
    metadata["jaxexp_refreshed_from"] = model_uri

    def log() -> Any:
        return flavor.log_model(
            new_exp,
            name=name,
            params=str(artifact.params_dir(local, meta)) if meta.get("params") else None,
            vjp_order=int(meta.get("vjp_order") or 0),
            signature=source_model.signature,
            input_example=example,
            metadata=metadata,
            tags=tags,
            registered_model_name=registered_model_name,
        )

    if run_id is not None:
        active = mlflow.active_run()
        if active is not None and active.info.run_id == run_id:
            info = log()
        else:
            with mlflow.start_run(run_id=run_id, nested=active is not None):
                info = log()
    elif mlflow.active_run() is not None:
        info = log()
    else:
        with mlflow.start_run(run_name=f"refresh {meta.get('fun_name') or name}"):
            info = log()
    if registered_model_name and getattr(info, "registered_model_version", None):
        client = mlflow.MlflowClient()
        for key in ("source_uri", "source_jax_version"):
            client.set_model_version_tag(
                registered_model_name,
                str(info.registered_model_version),
                TAG_PREFIX + key,
                tags[TAG_PREFIX + key],
            )
    return info
