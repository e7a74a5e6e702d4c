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
    **options: Any,
) -> Any:
    """The model (params bound) or, for a bare blob, the export alone (no params).

    ``isolate`` has JAX deserialize the blob in a capped child process first (see
    ``runtime.isolate``); ``options`` go to the device placement (``allow_other_platform``...).
    ``backend="iree"`` loads an ``IreeModel`` without importing JAX."""
    if backend == "iree":
        return _load_iree(target, allow_incompatible=allow_incompatible, **options)
    if target.kind == "blob":
        from jaxexp_mlflow.cli.check import blob_meta
        from jaxexp_mlflow.codec import files
        from jaxexp_mlflow.codec.blob import describe, deserialize_checked
        from jaxexp_mlflow.runtime import compat, devices
        from jaxexp_mlflow.runtime.isolate import probe
        from jaxexp_mlflow.runtime.loader import enforce
        from jaxexp_mlflow.runtime.model import JaxExpModel

        with step("Checking and deserializing the blob"):
            source = str(target.blob_path)
            data = files.read_file(
                target.blob_path, what="serialized function", max_bytes=files.MAX_BLOB_BYTES
            )
            desc = describe(data, source=source)
            verdict = compat.assess(
                blob_meta(desc),
                description=desc,
                allow_other_platform=bool(options.get("allow_other_platform")),
            )
            enforce(verdict, allow_incompatible=allow_incompatible)
            if isolate:  # JAX's deserializer, in a capped child first
                probe(data, source=source)
            exported = deserialize_checked(data, source=source, description=desc)
            placement = devices.plan(exported, **options)
        return JaxExpModel(placement.exported, None, {}, placement=placement)
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
            **options,
        )


def _load_iree(target: Target, *, allow_incompatible: bool, **options: Any) -> Any:
    from jaxexp_mlflow.iree import loader

    if target.kind == "blob":
        with step("Checking the blob, compiling it with IREE"):
            from jaxexp_mlflow.codec import files

            data = files.read_file(
                target.blob_path, what="serialized function", max_bytes=files.MAX_BLOB_BYTES
            )
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


def environment(backend: str = "jax") -> dict[str, Any]:
    """The environment running the model here (JAX's, or IREE's for ``backend="iree"``)."""
    if backend == "iree":
        from jaxexp_mlflow.iree.compiler import TARGET, versions

        v = versions()
        return {
            "jax_version": None,
            "jaxlib_version": None,
            "iree_compiler_version": v["iree-base-compiler"],
            "iree_runtime_version": v["iree-base-runtime"],
            "backend": f"iree/{TARGET}",
            "device_kind": "local-task",
            "device_count": 1,
        }
    import jax
    import jaxlib

    devices = jax.devices()
    return {
        "jax_version": jax.__version__,
        "jaxlib_version": jaxlib.__version__,
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind if devices else None,
        "device_count": len(devices),
    }


def environment_line(env: dict[str, Any]) -> str:
    """``jax 0.10.2 / jaxlib 0.10.2 on cpu (1 device: cpu)``."""
    n = env["device_count"]
    if env.get("iree_runtime_version"):
        return f"IREE {env['iree_runtime_version']} on {env['backend']} (no JAX)"
    return (
        f"jax {env['jax_version']} / jaxlib {env['jaxlib_version']} on {env['backend']} "
        f"({n} device{'s' if n != 1 else ''}: {env['device_kind']})"
    )
