"""The ``jaxexp`` MLflow flavor: ``jax.export`` functions with Orbax parameters.

Follows MLflow's built-in flavors (``mlflow.sklearn`` and friends): ``save_model``,
``log_model``, ``load_model``, ``_load_pyfunc``, ``get_default_pip_requirements`` and
``get_default_conda_env``. Available as ``mlflow.jaxexp`` once this package is installed.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from mlflow import pyfunc
from mlflow.models import Model, ModelInputExample, ModelSignature
from mlflow.models.model import ModelInfo
from mlflow.utils.file_utils import write_to

from jaxexp_mlflow.flavors.staged import StagedFlavor
from jaxexp_mlflow.internals import mlflow_private
from jaxexp_mlflow.mlflow_plugin import install_mlflow_module
from jaxexp_mlflow.runtime.backend import _check_backend
from jaxexp_mlflow.serving.model_config import PYFUNC_CONFIG_KEYS
from jaxexp_mlflow.store.section import FLAVOR_NAME

install_mlflow_module()


def get_default_pip_requirements(*, include_package: bool = False) -> list[str]:
    """Packages a fresh environment needs to load a jaxexp model (pinned to the versions here).

    A model carries no Python: ``jaxexp-mlflow`` is its loader, required at least in the version
    that wrote it (``jaxexp-mlflow>=X.Y.Z``), so a fix or a newer JAX's support reaches every
    archived model. With ``include_package=True`` the model carries its own copy in ``code/``
    (for air-gapped archives, for ``mlflow.pyfunc``'s loader only) and the requirement is left out.
    """
    # flatbuffers: jax.export's serialize/deserialize import it, and jax does not declare it
    reqs = [
        mlflow_private.pinned_requirement(name)
        for name in ("jax", "jaxlib", "flatbuffers", "orbax-checkpoint", "numpy", "mlflow")
    ]
    if not include_package:
        reqs.append(f"{PACKAGE_REQUIREMENT}>={_package_version()}")
    return reqs


#: The distribution name under which a model's requirements name its loader.
PACKAGE_REQUIREMENT = "jaxexp-mlflow"


def _package_version() -> str:
    from jaxexp_mlflow import __version__

    return __version__


def _package_dir() -> str:
    return str(Path(__file__).resolve().parents[1])


def get_default_conda_env() -> dict[str, Any]:
    """The default conda environment for jaxexp models (pip requirements inside)."""
    return mlflow_private.mlflow_conda_env(additional_pip_deps=get_default_pip_requirements())


def save_model(
    exported: Any,
    path: str | os.PathLike,
    *,
    params: Any = None,
    vjp_order: int = 0,
    signature: ModelSignature | None = None,
    input_example: ModelInputExample | None = None,
    pip_requirements: list[str] | str | None = None,
    extra_pip_requirements: list[str] | str | None = None,
    metadata: dict[str, Any] | None = None,
    mlflow_model: Model | None = None,
    conda_env: Any = None,
    code_paths: list[str] | None = None,
    batch_polymorphic: bool = True,
    platforms: list[str] | tuple[str, ...] | None = None,
    input_names: list[str] | None = None,
    output_names: list[str] | None = None,
    serving_config: dict[str, Any] | None = None,
    include_package: bool = False,
    classifier: Any = None,
    polymorphic_shapes: Any = None,
    **kwargs: Any,
) -> None:
    """Save a JAX model to ``path`` as an MLflow model with the ``jaxexp`` and pyfunc flavors.

    The save is atomic and checked (docs/saving.md): the model is built in a temporary sibling
    of ``path``, read back the way ``load_model`` reads it and run on ``input_example``, and
    only then renamed to ``path``. A model carries no Python: its requirements name
    ``jaxexp-mlflow>=`` this version, its loader.

    Args:
        exported: A ``jax.export.Exported``, the bytes of a serialized one (stored unchanged),
            or a jitted function ``fn(params, *inputs)``, exported here against ``params`` and
            ``input_example``.
        path: The model directory to create; absent or empty.
        params: The JAX parameters (a pytree of arrays, a Flax or Equinox module, or the path
            of an Orbax checkpoint), stored as an Orbax checkpoint and bound at load time.
        vjp_order: Serialize derivatives up to this order.
        signature: An MLflow signature, which must agree with the export (inferred when None;
            ``False`` stores none).
        input_example: The positional inputs after the params (a tuple for several); stored
            with its outputs as the model's reference result.
        pip_requirements: Replace the default requirements (MLflow's convention).
        extra_pip_requirements: Add to the default requirements.
        metadata: Free-form metadata stored in MLmodel.
        mlflow_model: The ``mlflow.models.Model`` to add the flavor to.
        conda_env: A conda environment (dict or path) instead of the requirements.
        code_paths: Local files or directories copied into the model's ``code/``.
        batch_polymorphic: Make the leading dimension of every input symbolic when exporting
            a function (docs/saving.md).
        platforms: Lower a function for these ``jax.export`` platforms (``"cpu"``, ``"cuda"``,
            ``"rocm"``, ``"tpu"``).
        input_names: Names of the input leaves in the signature.
        output_names: Names of the output leaves in the signature.
        serving_config: Pyfunc defaults stored with the model (``buckets``, ``max_batch``,
            ``precompile``, ``allow_nan``, ``max_request_bytes``; docs/serving/pyfunc-rest.md).
        include_package: Copy this package into the model's ``code/`` for air-gapped archives
            (used by MLflow's pyfunc loader only) instead of requiring it.
        classifier: ``True`` or the list of labels: pyfunc returns labels of the logits.
        polymorphic_shapes: ``jax.export``'s shapes specification for the inputs, such as
            ``("n, ...", "e")``.
        **kwargs: ``compression`` of the params, and ``route`` for bytes this JAX refuses
            (``"expired-flag"``, ``"bridge"``, ``"recorded-env"`` or ``"auto"``;
            ``flavors/save_route.py``).

    Raises:
        UnsupportedModelError: An option of ``load_model`` or an export that cannot be saved.
        IncompatibleError: Bytes this JAX refuses, without a route that works.
        SaveConflictError: Another save published a model at ``path`` first.
    """
    from jaxexp_mlflow.store import atomic

    load_options = {"allow_incompatible", "allow_other_platform", "data_parallel", "devices"}
    if load_only := sorted(set(kwargs) & load_options):
        from jaxexp_mlflow.errors import UnsupportedModelError

        raise UnsupportedModelError(
            f"save_model got {load_only}, which are options of load_model, not of saving. To "
            "save for platforms this machine lacks, pass platforms=(...): a function is then "
            "also lowered for this host to compute its reference result (docs/hardware.md); "
            "pass the load option to load_model(...) where the model runs."
        )
    if "_jax_params" in kwargs:  # from log_model: Model.log keeps ``params`` for MLflow's own
        params = kwargs.pop("_jax_params")
    kwargs.pop("validate_serving_input", None)  # Model.log's own option, passed along to us
    mlflow_private.validate_env_arguments(conda_env, pip_requirements, extra_pip_requirements)
    # log_model's staging directory is uploaded then deleted: no fsync (docs/remote.md)
    durable = bool(kwargs.pop("durable", True))
    dir_ready = kwargs.pop("_dir_ready", None)  # log_model: upload code/, params/ once written
    with atomic.atomic_directory(os.fspath(path), durable=durable) as tmp:
        _save_into(
            str(tmp),
            os.fspath(path),
            exported,
            params=params,
            vjp_order=vjp_order,
            signature=signature,
            input_example=input_example,
            pip_requirements=pip_requirements,
            extra_pip_requirements=extra_pip_requirements,
            metadata=metadata,
            mlflow_model=Model() if mlflow_model is None else mlflow_model,
            conda_env=conda_env,
            code_paths=[_package_dir(), *(code_paths or [])] if include_package else code_paths,
            include_package=include_package,
            batch_polymorphic=batch_polymorphic,
            platforms=platforms,
            input_names=input_names,
            output_names=output_names,
            serving_config=serving_config,
            classifier=classifier,
            durable=durable,
            dir_ready=dir_ready,
            polymorphic_shapes=polymorphic_shapes,
            **kwargs,
        )


def _save_into(
    path: str,
    target: str,
    exported: Any,
    *,
    params: Any,
    vjp_order: int,
    signature: Any,
    input_example: Any,
    pip_requirements: Any,
    extra_pip_requirements: Any,
    metadata: dict[str, Any] | None,
    mlflow_model: Model,
    conda_env: Any,
    code_paths: list[str] | None,
    batch_polymorphic: bool,
    platforms: Any,
    input_names: list[str] | None,
    output_names: list[str] | None,
    serving_config: dict[str, Any] | None,
    classifier: Any,
    dir_ready: Any = None,
    include_package: bool = False,
    **kwargs: Any,
) -> None:
    """Write the whole model into the (new, empty) directory ``path``, then read it back.

    ``target`` is where the model will be published (``path`` is its temporary sibling).
    ``dir_ready(local_dir, subpath)`` is told each finished subdirectory: ``code/`` as soon as
    it is copied, ``params/`` once Orbax has written it (before the read-back checks it).
    """
    from jaxexp_mlflow.flavors import saving
    from jaxexp_mlflow.flavors.readback import one_batch_axis, read_back_and_record, write_mlmodel
    from jaxexp_mlflow.serving import classifier as classifier_mod
    from jaxexp_mlflow.serving import signature as sig

    code_dir_subpath = mlflow_private.copy_code_paths(code_paths, path)
    if dir_ready is not None and code_dir_subpath:
        dir_ready(os.path.join(path, code_dir_subpath), code_dir_subpath)

    written = saving.write_model_files(
        exported,
        path,
        params=params,
        vjp_order=vjp_order,
        input_example=input_example,
        batch_polymorphic=batch_polymorphic,
        platforms=platforms,
        **kwargs,
    )
    section, exp = written.section, written.exported
    if dir_ready is not None and isinstance(section.params, str):  # up during the read-back
        dir_ready(os.path.join(path, section.params), section.params)
    arg_names = None
    if callable(exported) and not hasattr(exported, "in_avals"):  # a function we exported
        from jaxexp_mlflow.export import argument_names

        arg_names = argument_names(exported, has_params=params is not None)
    in_specs, out_specs = sig.leaf_specs(
        exp,
        has_params=params is not None,
        input_names=input_names,
        output_names_=output_names,
        arg_names=arg_names,
    )
    inferred = sig.model_signature(in_specs, out_specs)
    if signature is None:
        mlflow_model.signature = inferred
    elif signature is not False:
        mlflow_model.signature = sig.check_user_signature(
            signature, inferred, row_outputs=sig.row_output_schema(out_specs)
        )
        in_specs, out_specs = sig.rename(in_specs, out_specs, mlflow_model.signature)
    sig_now = mlflow_model.signature
    if sig_now is not None and sig_now.outputs is inferred.outputs:
        rows = sig.row_output_schema(out_specs)  # spark_udf's default result_type reads these
        mlflow_model.signature = ModelSignature(
            sig_now.inputs, rows or sig_now.outputs, getattr(sig_now, "params", None)
        )
    clf = classifier_mod.check(out_specs, classifier)
    if clf is not None:
        if mlflow_model.signature is not None:
            mlflow_model.signature = ModelSignature(
                mlflow_model.signature.inputs,
                classifier_mod.output_schema(clf),
                classifier_mod.params_schema(),
            )
    if mlflow_model.signature is not None:
        mlflow_model.signature = sig.served_signature(mlflow_model.signature)
    section = dataclasses.replace(
        section,
        classifier=clf,
        io=sig.specs_to_conf(in_specs, out_specs),
        exported_nbytes=os.path.getsize(os.path.join(path, section.exported_file)),
        serving=dict(serving_config) if serving_config else None,
        code=code_dir_subpath,
    )
    if input_example is not None and saving.is_abstract(input_example):
        input_example = None  # shapes only: nothing to run, no example to store
    if input_example is not None:
        example = sig.serving_example(in_specs, input_example)
        if example is not None:
            mlflow_private.save_input_example(mlflow_model, example, path)
    if metadata is not None:
        mlflow_model.metadata = metadata

    env_files = mlflow_private.env_file_names()
    pyfunc.add_to_model(
        mlflow_model,
        loader_module=__name__,
        model_config=dict.fromkeys(PYFUNC_CONFIG_KEYS),  # keys model_config may set at load
        conda_env=env_files.conda,
        python_env=env_files.python_env,
        # MLflow's pyfunc loader puts this directory on sys.path: only when the model carries
        # code (include_package=True or the user's code_paths)
        code=code_dir_subpath,
    )
    mlflow_model.add_flavor(FLAVOR_NAME, **section.to_dict())
    write_mlmodel(mlflow_model, path)
    _write_environment(
        path, conda_env, pip_requirements, extra_pip_requirements, include_package=include_package
    )
    read_back_and_record(
        path,
        target,
        exp,
        mlflow_model,
        section,
        params=written.params,
        input_example=input_example,
        host_outputs=written.host_outputs,
        batched=one_batch_axis(in_specs, out_specs),
        params_proven=written.params_proven,
        given=written.given,
    )


def _write_environment(
    path: str,
    conda_env: Any,
    pip_requirements: Any,
    extra_pip_requirements: Any,
    *,
    include_package: bool = False,
) -> None:
    """conda.yaml, requirements.txt, constraints and python_env.yaml, as MLflow's flavors do."""
    if conda_env is None:
        default_reqs = (
            get_default_pip_requirements(include_package=include_package)
            if pip_requirements is None
            else None
        )
        conda_env, pip_requirements, pip_constraints = mlflow_private.process_pip_requirements(
            default_reqs, pip_requirements, extra_pip_requirements
        )
    else:
        conda_env, pip_requirements, pip_constraints = mlflow_private.process_conda_env(conda_env)
    import yaml

    names = mlflow_private.env_file_names()
    with open(os.path.join(path, names.conda), "w") as f:
        yaml.safe_dump(conda_env, stream=f, default_flow_style=False)
    if pip_constraints:
        write_to(os.path.join(path, names.constraints), "\n".join(pip_constraints))
    write_to(os.path.join(path, names.requirements), "\n".join(pip_requirements))
    mlflow_private.write_python_env(os.path.join(path, names.python_env))


def log_model(
    exported: Any,
    name: str | None = None,
    *,
    params: Any = None,
    vjp_order: int = 0,
    signature: ModelSignature | None = None,
    input_example: ModelInputExample | None = None,
    registered_model_name: str | None = None,
    await_registration_for: int = mlflow_private.await_registration_default(),
    pip_requirements: list[str] | str | None = None,
    extra_pip_requirements: list[str] | str | None = None,
    conda_env: Any = None,
    code_paths: list[str] | None = None,
    metadata: dict[str, Any] | None = None,
    mlflow_params: dict[str, Any] | None = None,
    tags: dict[str, Any] | None = None,
    step: int = 0,
    model_id: str | None = None,
    artifact_path: str | None = None,
    **kwargs: Any,
) -> ModelInfo:
    """Log a JAX model to the current MLflow run (or ``run_id=``).

    Takes what ``save_model`` takes, plus MLflow's logging options. The JAX facts of the export
    (``jax.*``: versions, platforms, devices, avals, blob size) are added to the logged
    model's parameters, so the MLflow UI shows them. MLflow's own check of the serving input
    example is off by default (``validate_serving_input=True`` turns it on): ``save_model``
    already read the model back and ran it.

    Args:
        exported: A ``jax.export.Exported``, its serialized bytes, or a jitted function.
        name: The logged model's name.
        params: The JAX parameters bound to the function.
        vjp_order: Serialize derivatives up to this order.
        signature: An MLflow signature (inferred when None).
        input_example: The positional inputs after the params.
        registered_model_name: Register the model under this name.
        await_registration_for: Seconds to wait for the registered version to be ready.
        pip_requirements: Replace the default requirements.
        extra_pip_requirements: Add to the default requirements.
        conda_env: A conda environment instead of the requirements.
        code_paths: Local files or directories copied into the model's ``code/``.
        metadata: Free-form metadata stored in MLmodel.
        mlflow_params: MLflow's logged-model parameters (``params=`` of other flavors).
        tags: Tags of the logged model.
        step: The training step the model belongs to.
        model_id: Log into this existing logged model.
        artifact_path: Deprecated alias of ``name``.
        **kwargs: The other options of ``save_model``, and MLflow's ``run_id``.

    Returns:
        The ``ModelInfo`` of the logged model (``model_uri`` loads it).

    Raises:
        UnsupportedModelError: An option of ``load_model`` or an export that cannot be saved.
        IncompatibleError: Bytes this JAX refuses, without a route that works.
    """
    kwargs.setdefault("validate_serving_input", False)
    if artifact_path is not None:
        warnings.warn(
            "artifact_path is deprecated; use name= instead.", FutureWarning, stacklevel=2
        )
    # save_model already ran the model on input_example (the stored reference result); MLflow's
    # second run through pyfunc would load a second copy of the params: on request only.
    validate = bool(kwargs.pop("validate_serving_input", False))
    info = Model.log(
        artifact_path=artifact_path,
        name=name,
        flavor=sys.modules[__name__] if validate else StagedFlavor(save_model, __name__),
        validate_serving_input=validate,
        exported=exported,
        _jax_params=params,
        vjp_order=vjp_order,
        signature=signature,
        input_example=input_example,
        registered_model_name=registered_model_name,
        await_registration_for=await_registration_for,
        pip_requirements=pip_requirements,
        extra_pip_requirements=extra_pip_requirements,
        conda_env=conda_env,
        code_paths=code_paths,
        metadata=metadata,
        params=mlflow_params,
        tags=tags,
        step=step,
        model_id=model_id,
        **kwargs,
    )
    from jaxexp_mlflow.flavors.facts import record_on_logged_model

    record_on_logged_model(info)
    return info


def load_model(
    model_uri: str,
    dst_path: str | None = None,
    *,
    allow_incompatible: bool = False,
    backend: str = "jax",
    route: str | None = None,
    isolate: bool = False,
    allow_other_platform: bool = False,
    data_parallel: bool = False,
    devices: list[Any] | None = None,
    iree_cache: str | os.PathLike | bool | None = None,
    iree_driver: str | None = None,
) -> Any:
    """Load a jaxexp model as a callable with its params bound.

    The model is checked (checksum, format, compatibility verdict) before JAX sees it, placed
    on the platform and devices at hand, and refused with a clear error where it cannot run.
    Every file is read confined to the model directory, bounded and checked (blob sha256,
    params CRC-32C; docs/security.md). JAX's own deserializer is native code that trusts the
    StableHLO module it is given: ``isolate=True`` has it deserialize the module in a capped
    child process first, as ``jaxexp check`` and ``jaxexp verify`` always do.

    Args:
        model_uri: A local path, ``runs:/``, ``models:/`` or any artifact URI MLflow resolves.
        dst_path: Where to download a remote model; by default a private temporary directory,
            removed once the params are loaded.
        allow_incompatible: Try to load even after an "incompatible" verdict.
        backend: ``"jax"``, or ``"iree"`` to compile the StableHLO module with IREE and run it
            without importing JAX (numpy in and out, not differentiable; extra ``[iree]``).
        route: How to read a blob this JAX refuses, taken as asked and never chosen
            (``runtime/routes.py``): ``"direct"`` loads it as it is, ``"expired-flag"`` reads a
            blob jax >= 0.11.1 refuses as expired with JAX's flag set around the
            deserialization only. JAX backend only. A refusal names the routes that work here;
            ``model.route`` says which one ran.
        isolate: Deserialize the blob in a capped child process first (about a second more),
            so that a module crashing JAX's deserializer is refused. JAX backend only.
        allow_other_platform: Run on the platform at hand even if the export has no lowering
            for it.
        data_parallel: Shard the batch of a one-device export over all local devices. JAX
            backend only.
        devices: The devices to run on (default: all of the chosen platform). JAX backend only.
        iree_cache: Directory of compiled IREE modules, or False for none (default
            ``$JAXEXP_IREE_CACHE``, else ``~/.cache/jaxexp-mlflow/iree``). IREE backend only.
        iree_driver: The IREE driver to run on (default: the one for the platform at hand).
            IREE backend only.

    Returns:
        A ``JaxExpModel`` (differentiable up to the saved ``vjp_order``) for the JAX backend,
        an ``IreeModel`` for the IREE backend.

    Raises:
        ArtifactError: A file is missing, altered, truncated or over its bound.
        IncompatibleError: The model cannot run here (platform, devices, JAX version, route).
        ParamsMismatchError: The checkpoint does not match the exported function.
        UnsupportedModelError: An unknown backend, or an option of the other backend.
    """
    backend = _check_backend(backend)
    jax_only = {"isolate": isolate, "data_parallel": data_parallel, "devices": devices}
    iree_only = {"iree_cache": iree_cache, "iree_driver": iree_driver}
    if backend == "iree":
        if route is not None:
            from jaxexp_mlflow.errors import IncompatibleError

            raise IncompatibleError(
                f"route={route!r} is a route of the JAX backend; backend='iree' is a route of "
                "its own: pass one of them."
            )
        _refuse_options(jax_only, "jax", backend)
        options = {"allow_other_platform": allow_other_platform, **iree_only}
    else:
        _refuse_options(iree_only, "iree", backend)
        options = {"allow_other_platform": allow_other_platform, **jax_only}
        if route is not None:  # taken as asked, never chosen: runtime/routes.py
            from jaxexp_mlflow.runtime.routes import check_name

            options["route"] = check_name(route)
    from jaxexp_mlflow.flavors.load_path import load

    return load(model_uri, dst_path, backend, allow_incompatible, options)


def _refuse_options(given: dict[str, Any], other: str, backend: str) -> None:
    """Refuse the options of the ``other`` backend that were set (not at their defaults)."""
    if wrong := sorted(k for k, v in given.items() if v not in (None, False)):
        from jaxexp_mlflow.errors import UnsupportedModelError

        raise UnsupportedModelError(
            f"load_model got {wrong}, options of backend={other!r}, with backend={backend!r}: "
            f"expected none of them; drop them or load with backend={other!r}."
        )


def _load_pyfunc(path: str, model_config: dict[str, Any] | None = None) -> Any:
    """Load the pyfunc implementation; called by ``mlflow.pyfunc.load_model``.

    ``serving.pyfunc.load_pyfunc``: once per process per model identity, buckets compiled on
    first use (at load inside a scoring server), the compilation cache on.
    """
    from jaxexp_mlflow.serving.pyfunc import load_pyfunc

    return load_pyfunc(path, model_config)
