"""Load a resolved target into a callable ``JaxExpModel`` (imports jax: not for ``inspect``)."""

from __future__ import annotations

from typing import Any

from jaxexp_mlflow.cli._common import step
from jaxexp_mlflow.cli.uri import Target


def load_judged(
    target: Target,
    *,
    allow_incompatible: bool = False,
    allow_other_platform: bool = False,
    backend: str = "jax",
    route: str | None = None,
    **options: Any,
) -> Any:
    """:func:`load`; after ``--allow-incompatible``, a JAX load that fails as the verdict said
    it would is that verdict's ``Failure`` (exit 1, reasons and what to do), not an input error."""
    try:
        return load(
            target,
            allow_incompatible=allow_incompatible,
            allow_other_platform=allow_other_platform,
            backend=backend,
            route=route,
            **options,
        )
    except Exception as err:
        if allow_incompatible and backend == "jax":  # tried anyway: jax refused, as judged?
            from jaxexp_mlflow.cli.check import forced_load_failure

            failure = forced_load_failure(target, err, allow_other_platform=allow_other_platform)
            if failure is not None:
                raise failure from err
        raise


def load(
    target: Target,
    *,
    allow_incompatible: bool = False,
    isolate: bool = False,
    backend: str = "jax",
    route: str | None = None,
    **options: Any,
) -> Any:
    """The model (params bound) or, for a bare blob, the export alone (no params).

    ``isolate`` has JAX deserialize the blob in a capped child process first (see
    ``runtime.isolate``); ``options`` go to the device placement (``allow_other_platform``...).
    ``backend="iree"`` loads an ``IreeModel`` without importing JAX. ``route`` (``direct``,
    ``expired-flag`` or ``bridge``; ``runtime/routes.py``) is taken as asked; the model's
    ``route`` attribute says which ran."""
    if backend == "iree":
        return _load_iree(target, allow_incompatible=allow_incompatible, **options)
    from jaxexp_mlflow.runtime import routes

    if route == routes.BRIDGE:
        return _load_bridged(target, allow_incompatible=allow_incompatible, **options)
    routes.check_name(route)
    if target.kind == "blob":
        from jaxexp_mlflow.cli.check import blob_meta
        from jaxexp_mlflow.codec.blob import deserialize_checked
        from jaxexp_mlflow.runtime import devices
        from jaxexp_mlflow.runtime.isolate import probe
        from jaxexp_mlflow.runtime.model import JaxExpModel

        with step("Checking and deserializing the blob"):
            source = str(target.blob_path)
            data = blob_bytes(target)
            desc = checked_description(target)
            _, scope = routes.judge(
                blob_meta(desc),
                desc,
                route,
                allow_other_platform=bool(options.get("allow_other_platform")),
                allow_incompatible=allow_incompatible,
                uri=target.uri,
            )
            with scope():
                if isolate:  # JAX's deserializer, in a capped child first
                    probe(data, source=source)
                exported = deserialize_checked(data, source=source, description=desc)
            if route == routes.EXPIRED_FLAG:
                exported = routes.with_scoped_vjp(exported)
            remeshed = None
            if route == routes.REMESH:
                from jaxexp_mlflow.runtime.remesh import remesh_for_load

                remeshed, options = remesh_for_load(exported, options)
                exported = remeshed.exported
            placement = devices.plan(exported, **options)
        model = JaxExpModel(placement.exported, None, {}, placement=placement)
        model.route = route or routes.DIRECT
        model.remeshed = None if remeshed is None else remeshed.change
        return model
    from jaxexp_mlflow.runtime.loader import load_directory

    # jaxexp is the loader: nothing from the model's code/ goes on sys.path (docs/security.md)
    label = "Loading the model (checks, deserialize"
    label += ", restore params)" if target.flavor.get("params") else ")"
    with step(label):
        return load_directory(
            target.path,
            target.flavor,
            allow_incompatible=allow_incompatible,
            isolate=isolate,
            route=route,
            model_files=target.model_files,  # MLmodel as resolve read it; the blob if read already
            **options,
        )


def blob_bytes(target: Target) -> bytes:
    """The target's serialized blob, read bounded and confined (model dir or bare file), once
    per command (``Target.blob_data``); a model's checked against its ``exported_sha256``."""
    from jaxexp_mlflow.codec import files

    if target.kind != "blob":
        return target.model_files.blob
    data = target.blob_data
    if len(data) > files.MAX_BLOB_BYTES:  # refused as a load refuses it
        files.read_file(
            target.blob_path, what="serialized function", max_bytes=files.MAX_BLOB_BYTES
        )
    return data


def checked_description(target: Target) -> Any:
    """The jax-free parse of :func:`blob_bytes`, once per command; ``ArtifactError`` for a
    malformed blob (``codec.blob.describe``)."""
    from jaxexp_mlflow.codec.blob import describe

    data = blob_bytes(target)
    if "description" in target.__dict__ and target.blob_data is data:
        desc = target.description
    else:
        desc = describe(data, source=str(target.blob_path))
        target.check_section(desc)
        if target.blob_data is data:
            target.description = desc
    if target.kind != "blob":
        target.model_files.with_blob(data, desc)
    return desc


def plan_routes(target: Target, *, allow_other_platform: bool = False) -> tuple[list[Any], Any]:
    """The routes that work here for ``target`` (``runtime.routes.plan``), in order, and the
    compatibility verdict they were planned from."""
    from jaxexp_mlflow.cli.check import blob_meta
    from jaxexp_mlflow.runtime import compat, routes

    desc = checked_description(target)
    meta = blob_meta(desc) if target.kind == "blob" else target.flavor
    verdict = compat.assess(meta, description=desc, allow_other_platform=allow_other_platform)
    return routes.plan(verdict, meta, desc, uri=target.uri), verdict


def pick_route(target: Target, route: str | None, **options: Any) -> Any:
    """The :class:`~jaxexp_mlflow.runtime.routes.Route` to take: the one named by ``route``
    (refused naming the working ones if it does not work here), the first that works for
    ``auto``; for no ``--route``, the route the model was logged through where it still is
    needed (:func:`recorded_route`), else None (the plain load, refused naming the routes)."""
    from jaxexp_mlflow.cli._common import Failure
    from jaxexp_mlflow.runtime import routes

    if route is None:
        return recorded_route(target, **options)
    available, verdict = plan_routes(
        target, allow_other_platform=bool(options.get("allow_other_platform"))
    )
    chosen = available[0] if route == "auto" and available else routes.find(available, route)
    if chosen is None:
        raise Failure(
            f"--route {route}: "
            + (
                "no route works"
                if route == "auto"
                else "that route does not work here "
                f"({routes.why_not(route, verdict, checked_description(target))})"
            )
            + f" for {target.uri}.\n{routes.describe(available)}"
        )
    return chosen


def recorded_route(target: Target, **options: Any) -> Any:
    """The route the model's MLmodel records (``jaxexp.route``: a blob this JAX refused when
    it was logged) where it still is needed and works here: taken without ``--route`` for
    ``expired-flag`` and ``bridge`` (``flavors.save_route.TAKEN_WHEN_RECORDED``); else None."""
    if target.kind == "blob" or not isinstance(target.flavor.get("route"), dict):
        return None
    from jaxexp_mlflow.flavors.save_route import recorded_route_here

    desc = checked_description(target)
    return recorded_route_here(
        target.flavor, desc, allow_other_platform=bool(options.get("allow_other_platform"))
    )


def _load_bridged(target: Target, *, allow_incompatible: bool, **options: Any) -> Any:
    """The bridge route: the blob re-exported by jax ``routes.BRIDGE_JAX`` in a cached venv,
    checked like any blob, loaded here (params, if any, bound from the model's checkpoint)."""
    from jaxexp_mlflow.archive import env_routes
    from jaxexp_mlflow.cli.check import blob_meta
    from jaxexp_mlflow.codec.blob import describe, deserialize_checked
    from jaxexp_mlflow.runtime import compat, devices, routes
    from jaxexp_mlflow.runtime.model import JaxExpModel
    from jaxexp_mlflow.runtime.routes import enforce

    data = blob_bytes(target)
    desc = checked_description(target)
    with step(f"Re-exporting the blob with jax {routes.BRIDGE_JAX} (bridge venv)"):
        new, _ = env_routes.reexport_in(routes.BRIDGE_JAX, data, nr_devices=int(desc.nr_devices))
    source = f"{target.blob_path} (re-exported by jax {routes.BRIDGE_JAX})"
    new_desc = describe(new, source=source)
    meta = blob_meta(new_desc)
    verdict = compat.assess(
        meta, description=new_desc, allow_other_platform=bool(options.get("allow_other_platform"))
    )
    enforce(verdict, allow_incompatible=allow_incompatible)
    node_types = None if target.kind == "blob" else target.flavor.get("pytree_node_types")
    with step("Loading the re-exported blob here"):
        exported = deserialize_checked(
            new, source=source, node_types=node_types, description=new_desc
        )
        placement = devices.plan(exported, **options)
        if target.kind == "blob":
            model = JaxExpModel(placement.exported, None, {}, placement=placement)
        else:
            from jaxexp_mlflow.runtime.loader import bind_model

            model = bind_model(
                placement.exported,
                target.path,
                target.flavor,
                placement,
                model_files=target.model_files,
            )
    model.route = routes.BRIDGE
    model.bridged_blob = new
    return model


def _load_iree(target: Target, *, allow_incompatible: bool, **options: Any) -> Any:
    from jaxexp_mlflow.iree import loader

    if target.kind == "blob":
        with step("Checking the blob, compiling it with IREE"):
            data = blob_bytes(target)
            return loader.build(
                data,
                {},
                source=str(target.blob_path),
                allow_incompatible=allow_incompatible,
                allow_other_platform=bool(options.get("allow_other_platform")),
            )
    label = "Loading the model on IREE (checks, params, compile or cache)"
    with step(label):
        return loader.load_directory(
            target.path, target.flavor, allow_incompatible=allow_incompatible, **options
        )


ROUTE_CHOICES = (
    "auto",
    "direct",
    "expired-flag",
    "bridge",
    "recorded-env",
    "iree",
    "remesh",
    "virtual-devices",
)


def route_option(fn: Any) -> Any:
    """``--route``: take a route (``runtime/routes.py``) explicitly, never silently."""
    import click

    fn = click.option(
        "--devices",
        type=click.IntRange(min=1),
        default=None,
        help="--route remesh: the device count to re-mesh onto (default: the devices visible).",
    )(fn)
    return click.option(
        "--route",
        type=click.Choice(ROUTE_CHOICES),
        default=None,
        help="Take this route to run a model this JAX refuses (see `jaxexp check`): "
        "expired-flag (JAX's flag around the deserialization), bridge (re-export with jax "
        "0.10.2 in a cached venv, run here), recorded-env (the writer's jax in a cached venv), "
        "iree, remesh (a model for more devices than are here, its meshes resized), "
        "virtual-devices (the blob as it is on simulated CPU devices in a child process); auto "
        "takes the first that works. The output says which ran.",
    )(fn)


def route_line(chosen: Any, model: Any = None) -> str:
    """``Route     expired-flag (jax 0.12.0.1)``: which route ran, for the text output (with
    what the remesh route changed, from the ``model`` it loaded)."""
    who = f" (jax {chosen.jax_version})" if chosen.jax_version else ""
    change = getattr(model, "remeshed", None)
    return f"Route     {chosen.name}{who}" + (f": {change}" if change else "")


def exported_for_specs(data: bytes) -> Any:
    """An ``Exported`` of ``data`` for its input structure only (never called here): read as
    is, else with JAX's expired-versions flag in scope; a Failure if this jax cannot read it."""
    from jaxexp_mlflow.cli._common import Failure
    from jaxexp_mlflow.codec.blob import deserialize_checked
    from jaxexp_mlflow.runtime import routes

    try:
        return deserialize_checked(data)
    except Exception:  # noqa: BLE001 - try with the flag, then give up
        pass
    try:
        with routes.expired_flag():
            return deserialize_checked(data)
    except Exception as err:  # noqa: BLE001
        raise Failure(
            "this jax cannot read the blob's input structure, which the recorded-env route "
            f"needs to read the inputs: {err}; take --route bridge"
        ) from err


def run_recorded_env(target: Target, chosen: Any, leaves: list[Any]) -> list[Any]:
    """The recorded-env route: the blob run by jax ``chosen.jax_version`` in a cached venv on
    the flat input ``leaves``; a model with params is refused (its params need the model's own
    recorded environment: `jaxexp verify --env-manager uv`). The virtual-devices route: the
    blob run unchanged by this Python's jax on its ``nr_devices`` simulated CPU devices."""
    from jaxexp_mlflow.archive import env_routes
    from jaxexp_mlflow.cli._common import Failure

    if target.kind != "blob" and target.flavor.get("params"):
        raise Failure(
            f"--route {chosen.name} runs bare blobs; {target.uri} has params, which need the "
            f"model's recorded requirements: run `jaxexp verify {target.uri} --env-manager uv`"
        )
    data = blob_bytes(target)
    desc = checked_description(target)
    if chosen.name == "virtual-devices":
        n = int(desc.nr_devices)
        with step(f"Running it unchanged on {n} simulated CPU devices (child process)"):
            outs, _ = env_routes.run_virtual(data, leaves, nr_devices=n)
        return outs
    with step(f"Running it with jax {chosen.jax_version} (recorded-env venv)"):
        outs, _ = env_routes.run_in(
            chosen.jax_version, data, leaves, nr_devices=int(desc.nr_devices)
        )
    return outs
