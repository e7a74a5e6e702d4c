"""The ``jaxexp`` MLflow flavor: ``jax.export`` functions with Orbax parameters.

Follows MLflow's built-in flavors (``mlflow.sklearn`` and friends): ``save_model``,
``log_model``, ``load_model``, ``_load_pyfunc``, ``get_default_pip_requirements`` and
``get_default_conda_env``. Available as ``mlflow.jaxexp`` once this package is installed.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

from mlflow import pyfunc
from mlflow.models import Model, ModelInputExample, ModelSignature
from mlflow.models.model import MLMODEL_FILE_NAME, ModelInfo
from mlflow.utils.file_utils import write_to

from jaxexp_mlflow.errors import ArtifactError
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

    ``exported`` is a ``jax.export.Exported``, the bytes of a serialized one (stored unchanged),
    or a jitted function ``fn(params, *inputs)`` that is exported here against ``params`` and
    ``input_example`` (leading dimensions symbolic unless ``batch_polymorphic=False``; for
    ``platforms`` given, lowered for each; inputs whose leading sizes differ in the example get
    one symbol per size, and ``polymorphic_shapes``, ``jax.export``'s shapes specification such
    as ``("n, ...", "e")``, names them instead: docs/saving.md). ``params`` (a pytree of arrays,
    or the path of an existing Orbax checkpoint) are stored as an Orbax checkpoint and bound at
    load time.
    ``input_example`` is the positional inputs after the params (a tuple for several); it and
    the outputs computed from it are stored as the model's reference result, and saved as
    MLflow's input example (``serving_input_example.json``) when JSON can carry it.

    The MLflow signature is inferred from the export (see ``serving.signature`` for the names;
    ``input_names``/``output_names`` rename the leaves); a ``signature`` given here must agree
    with the export, ``signature=False`` stores none. ``serving_config`` is stored in the flavor
    section as the pyfunc defaults (``buckets``, ``max_batch``, ``precompile``, ``allow_nan``,
    ``max_request_bytes``; see docs/serving.md). A model carries no Python by default: its
    requirements name ``jaxexp-mlflow>=`` this version, the loader. ``include_package=True``
    copies this package into the model's ``code/`` directory instead, for air-gapped archives:
    MLflow's pyfunc loader (``mlflow.pyfunc.load_model``, ``mlflow models serve``) puts
    ``code/`` on ``sys.path`` and imports the copy; ``mlflow.jaxexp.load_model`` and the
    ``jaxexp`` CLI never do. ``classifier`` (``True`` or the list of labels) marks a logits
    classifier: pyfunc then returns labels, and probabilities with ``params={"predict_method":
    "predict_proba"}`` (``serving.classifier``).

    The save is atomic and checked (docs/saving.md): the model is built in a temporary sibling
    of ``path``, read back the way ``load_model`` reads it (and run on ``input_example``), and
    only then renamed to ``path``; on any failure nothing is left at ``path``.

    Bytes this JAX refuses (a blob of jax <= 0.7 under jax >= 0.11.1, old-style HLO shardings,
    kernels this jaxlib lacks) are saved unchanged through a route (``flavors.save_route``),
    read back through it and recorded in MLmodel (``jaxexp.route``): ``route=None`` takes
    ``direct``, else ``expired-flag`` where it applies, and names it in a logged warning;
    ``route="bridge"``/``"recorded-env"`` (cached venvs) or ``"auto"`` are taken when asked.
    Without a route that works, ``IncompatibleError`` names the routes and how to ask for them.
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
    """Log a JAX model to the current MLflow run (or ``run_id=``) and return its ``ModelInfo``.

    Takes what ``save_model`` takes. ``params`` are the JAX parameters bound to the function;
    MLflow's own logged-model parameters (``params=`` of other flavors) go in ``mlflow_params``;
    the JAX facts of the export (``jax.*``: versions, platforms, devices, avals, blob size) are
    added to them, so the MLflow UI shows them on the logged model's page.
    ``artifact_path`` is a deprecated alias of ``name``. MLflow's own check of the serving input
    example (a second load and compile) is off by default (``validate_serving_input=True`` turns
    it on): ``save_model`` already read the model back and ran it (docs/saving.md).
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
        flavor=sys.modules[__name__] if validate else _StagedFlavor,
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


class _StagedFlavor:
    """This flavor as ``Model.log`` sees it when the staging directory is only uploaded.

    The params are written without the final fsync pass (the directory is deleted after the
    upload). Everything goes up on one pool as soon as it exists (``upload.EarlyUpload``):
    the ``code/`` copy as soon as it is made, ``params/`` as soon as Orbax has written it
    (while the read-back runs), then the top-level files; with ``JAXEXP_EARLY_UPLOAD=0``,
    ``params/`` and ``code/`` go up in parallel after ``save_model`` (``upload.stage_upload``).
    ``Model.log`` then uploads what is left, ``MLmodel`` last. See docs/remote.md.
    """

    __name__ = __name__

    #: Left to ``Model.log``: MLmodel (rewritten there) last; the serving example it reads.
    LEFT_TO_MLFLOW = (MLMODEL_FILE_NAME, "serving_input_example.json")

    @staticmethod
    def save_model(*, path: str, mlflow_model: Model, **kwargs: Any) -> None:
        from jaxexp_mlflow.store import artifact
        from jaxexp_mlflow.store.upload import EarlyUpload, stage_upload

        if not mlflow_model.artifact_path:
            save_model(path=path, mlflow_model=mlflow_model, durable=False, **kwargs)
            return
        early = EarlyUpload(mlflow_model.artifact_path, artifact.PARAMS_DIR)
        params_dir = Path(path, artifact.PARAMS_DIR)
        try:
            save_model(
                path=path,
                mlflow_model=mlflow_model,
                durable=False,
                _dir_ready=early.send_tree,
                **kwargs,
            )
            tops = [
                p
                for p in Path(path).iterdir()
                if p.is_file() and p.name not in _StagedFlavor.LEFT_TO_MLFLOW
            ]
            early.send_files(tops)
            # the rest of params/ and code/ go up while the arrays still do, on the same pool
            subdirs = [artifact.PARAMS_DIR, "code"]
            for sub in subdirs:
                if Path(path, sub).is_dir():
                    early.send_tree(Path(path, sub), sub)
            skip = {sub: early.skipped(sub) for sub in subdirs}  # stage_upload: what is left
            if stage_upload(path, mlflow_model.artifact_path, subdirs, skip=skip):
                early.finish(params_dir)
                # up: out of the way, so that Model.log uploads only what is left
                sent = [Path(path, sub) for sub in subdirs if Path(path, sub).exists()]
                sent += [p for p in tops if p.name in early.submitted]
                for p in early.trash(sent):  # could not be moved aside: deleted now
                    if p.is_dir():
                        shutil.rmtree(p, ignore_errors=True)
                    else:
                        p.unlink()
        except BaseException:
            early.close()
            early.discard()  # no MLmodel will follow: take back what went up
            raise
        early.close()


def load_model(
    model_uri: str,
    dst_path: str | None = None,
    *,
    allow_incompatible: bool = False,
    backend: str = "jax",
    route: str | None = None,
    **options: Any,
) -> Any:
    """Load a jaxexp model as a callable ``JaxExpModel`` with its params bound.

    The model is checked (checksum, format, compatibility verdict) before JAX sees it, placed on
    the platform and devices at hand, and raises a clear error where it cannot run.
    ``allow_incompatible=True`` tries anyway after an "incompatible" verdict; ``options`` go to
    the device placement (see ``runtime.devices.plan``). ``backend="iree"`` compiles the
    StableHLO module with IREE and runs it without importing JAX (an ``IreeModel``: numpy in and
    out, not differentiable; ``options``: ``allow_other_platform``, ``iree_cache``).
    ``route`` is taken as asked, never chosen (``runtime/routes.py``): ``"direct"`` loads it as
    it is; ``"expired-flag"`` reads a blob jax >= 0.11.1 refuses as expired (schema < 5) with
    JAX's flag set around the deserialization only, and is refused where it does not apply; the
    other routes run outside this call (the refusal says how). Every refusal names the routes
    that work here; ``model.route`` says which one ran.

    Every file is read confined to the model directory, bounded, and checked (blob sha256,
    params CRC-32C; docs/security.md). Limit: JAX's own deserializer is native code that trusts
    the StableHLO module it is given; a damaged module with a consistent checksum can crash
    this process. ``isolate=True`` has JAX deserialize it in a capped child process first
    (about a second more), as ``jaxexp check`` and ``jaxexp verify`` always do.
    """
    from jaxexp_mlflow.store.download import download_model

    backend = _check_backend(backend)
    if route is not None:  # taken as asked, never chosen: runtime/routes.py
        from jaxexp_mlflow.errors import IncompatibleError
        from jaxexp_mlflow.runtime.routes import check_name

        if backend == "iree":
            raise IncompatibleError(
                f"route={route!r} is a route of the JAX backend; backend='iree' is a route of "
                "its own: pass one of them."
            )
        options["route"] = check_name(route)
    # jaxexp is the loader: nothing in a model's code/ is ever imported here, so into a private
    # temp dir (dst_path=None) it is not even downloaded.
    skip = ("code",) if dst_path is None else ()
    download = download_model(model_uri, dst_path, skip=skip)
    local_path = download.path
    # Our own private download (mkdtemp, 0700): params may be mapped from the page cache the
    # download filled instead of copied into new memory, their checksums taken as they landed
    # (docs/remote.md, "How a model travels").
    private = download.ours and dst_path is None
    try:
        try:
            return _load_downloaded(
                local_path, download, private, backend, allow_incompatible, options
            )
        except ArtifactError as err:
            if os.path.exists(model_uri) or os.path.lexists(os.path.join(local_path, "MLmodel")):
                raise
            held = sorted(os.listdir(local_path))[:6] if os.path.isdir(local_path) else []
            raise ArtifactError(
                f"{model_uri}: expected a model with its MLmodel in the artifact store, found "
                f"{held or 'nothing'} without one. Its upload was cut off or never finished "
                "(MLflow leaves such a logged model PENDING or FAILED): log the model again."
            ) from err
    except BaseException:
        if private and download.tmp:  # a refused load leaves nothing of its download behind
            shutil.rmtree(download.tmp, ignore_errors=True)
        raise


def _load_downloaded(
    local_path: str,
    download: Any,
    private: bool,
    backend: str | None,
    allow_incompatible: bool,
    options: dict[str, Any],
) -> Any:
    """``load_model`` once the model is on disk at ``local_path``: its MLmodel read and
    validated once (``store.model_files``), that one object handed to the loader."""
    from jaxexp_mlflow.store.model_files import read_model_files

    # validated (``code`` relative and inside the model, or null); never put on sys.path
    files = read_model_files(local_path, raw=download.mlmodel if private else None)
    if backend == "iree":
        from jaxexp_mlflow.iree.loader import load_directory as load_iree

        return load_iree(
            local_path,
            files.flavor,
            allow_incompatible=allow_incompatible,
            model_files=files,
            **options,
        )
    from jaxexp_mlflow.runtime import cache
    from jaxexp_mlflow.runtime.loader import load_directory

    cache.configure()
    model = load_directory(
        local_path,
        files.flavor,
        allow_incompatible=allow_incompatible,
        mapped=download.crc32c if private else None,
        model_files=files,
        **options,
    )
    if private:  # the params are in memory (or mapped: unlinked files live while mapped)
        from jaxexp_mlflow.store import artifact

        ckpt = artifact.params_dir(local_path, files.flavor)
        if ckpt is not None and ckpt.resolve() != Path(local_path).resolve():
            shutil.rmtree(ckpt, ignore_errors=True)
    return model


def _load_pyfunc(path: str, model_config: dict[str, Any] | None = None) -> Any:
    """Load the pyfunc implementation; called by ``mlflow.pyfunc.load_model``.

    ``serving.pyfunc.load_pyfunc``: once per process per model identity, buckets compiled on
    first use (at load inside a scoring server), the compilation cache on.
    """
    from jaxexp_mlflow.serving.pyfunc import load_pyfunc

    return load_pyfunc(path, model_config)
