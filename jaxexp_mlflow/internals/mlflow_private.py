"""Every private MLflow name jaxexp-mlflow touches, each behind a function with a public fallback.

MLflow does not promise anything about names that start with an underscore, and it does remove
them: 3.18.0 dropped ``ModelsArtifactRepository._add_registered_model_meta_file``, which
``download.download_model`` calls after each ``models:/`` download from a remote store; called
unguarded, it would fail every such ``load_model`` with ``AttributeError``. This module is the
only place in the package that uses such a name. Each function
below uses the private name when the installed MLflow has it (same behaviour as MLflow's own
flavors) and otherwise takes a fallback built on public API, or a small reimplementation, so
that a release removing the name costs speed or a nicety, never correctness. Where a public API
does the same job the private name is not used at all (:data:`REPLACED_BY_PUBLIC`).

:data:`PRIVATE_NAMES` lists them (``"module:qualified.name"`` -> where it lives, why we use it,
the fallback); ``tests/internals/test_mlflow_private.py`` checks each against the installed MLflow
and runs each fallback against the private path; docs/internals.md has the table. :func:`missing`
names those the installed MLflow lacks; :func:`fallbacks_taken` those a fallback has run for.

What replaced ``_add_registered_model_meta_file`` (read in MLflow 3.18.0's source):
``ModelsArtifactRepository.download_artifacts`` in 3.17.2 wrote a YAML file
``registered_model_meta`` (``model_name``, ``model_version``) into a downloaded model directory;
3.18.0 removed the method, the ``REGISTERED_MODEL_META_FILE_NAME`` constant and that step
together: its download just returns ``self.repo.download_artifacts(...)``. Nothing in
MLflow 3.17.2 or 3.18.0 reads the file (only the removed method wrote it), and jaxexp does not
either. So :func:`add_registered_model_meta` writes it when the installed MLflow still has the
method (downloads stay identical to MLflow's own there) and otherwise does nothing, which is
exactly what MLflow 3.18's own download does.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import posixpath
import shutil
import tempfile
import threading
import urllib.parse
from pathlib import Path
from typing import Any, NamedTuple

from jaxexp_mlflow.internals.mlflow_fallbacks import (
    deduplicate,
    installed_version,
    is_mlflow_requirement,
    jsonable,
    mlflow_pin,
    parse_pip_requirements,
    python_version,
    strip_local,
)

_logger = logging.getLogger(__name__)


class PrivateName(NamedTuple):
    """One private MLflow name: where it lives in MLflow, why we use it, what replaces it."""

    where: str  # the jaxexp_mlflow module(s) that need it (through this module)
    why: str
    fallback: str


_ENV = "mlflow.utils.environment"
_MODEL_UTILS = "mlflow.utils.model_utils"
_HTTP_REPO = "mlflow.store.artifact.http_artifact_repo:HttpArtifactRepository"

#: ``"module:qualified.name"`` -> :class:`PrivateName`, for every private MLflow name the package
#: uses (all through this module). Iterated by tests/internals/test_mlflow_private.py.
PRIVATE_NAMES: dict[str, PrivateName] = {
    # --- artifact transfer (store/upload.py, store/download.py) ---
    "mlflow.store.artifact.artifact_repo:ArtifactRepository._download_file": PrivateName(
        "download.py (_Tree._download)",
        "download one file of a listed model straight to its final path, on our own pool "
        "(MLflow's retries, auth, S3 multipart), without the per-file directory check of "
        "download_artifacts",
        "public repo.download_artifacts(path, tmp) into a sibling temp dir, then os.replace "
        "(one more listing request per file)",
    ),
    "mlflow.store.artifact.models_artifact_repo:ModelsArtifactRepository."
    "_add_registered_model_meta_file": PrivateName(
        "download.py (download_model)",
        "write registered_model_meta into a models:/ download, as MLflow <= 3.17 does",
        "nothing: MLflow 3.18 removed the file with the method, and no MLflow reads it",
    ),
    f"{_HTTP_REPO}._host_creds": PrivateName(
        "upload.py (EarlyUpload._put)",
        "auth of the PUT that sends a params chunk file from memory to `mlflow server`",
        "public mlflow.utils.credentials.get_default_host_creds(repo.artifact_uri) (what the "
        "property returns); if that is gone too, no upload from memory (files from disk)",
    ),
    "mlflow.tracking.artifact_utils:_get_root_uri_and_artifact_path": PrivateName(
        "download.py (resolve_repository)",
        "split a model URI into the repository root and the path in it, as MLflow's download",
        "reimplemented with public ModelsArtifactRepository.is_models_uri/split_models_uri "
        "and urllib",
    ),
    # --- the flavor (flavors/jaxexp.py), the CLI (cli/loading.py) ---
    "mlflow.tracking._model_registry:DEFAULT_AWAIT_MAX_SLEEP_SECONDS": PrivateName(
        "flavors/jaxexp.py (log_model default)",
        "log_model's await_registration_for default, as MLflow's flavors",
        "300 (its value since MLflow 1.x)",
    ),
    "mlflow.utils.requirements_utils:_get_pinned_requirement": PrivateName(
        "flavors/jaxexp.py (get_default_pip_requirements)",
        "pin jax, jaxlib, ... to the installed versions",
        "importlib.metadata version (mlflow.__version__ for mlflow), local label stripped",
    ),
    f"{_ENV}:_mlflow_conda_env": PrivateName(
        "flavors/jaxexp.py (get_default_conda_env)",
        "the conda.yaml MLflow's flavors write",
        "reimplemented: name mlflow-env, conda-forge, python=X.Y.Z, pip<=installed, pip deps",
    ),
    f"{_ENV}:_process_pip_requirements": PrivateName(
        "flavors/jaxexp.py (_write_environment)",
        "pip_requirements / extra_pip_requirements -> requirements, constraints, conda env",
        "reimplemented: parse (-r/-c files), pin mlflow, merge duplicates (no pip dry-run "
        "check, no locking, no mismatch warning)",
    ),
    f"{_ENV}:_process_conda_env": PrivateName(
        "flavors/jaxexp.py (_write_environment)",
        "conda_env= -> requirements, constraints, conda env",
        "reimplemented: pip deps of the env parsed, mlflow pinned, -c constraints.txt",
    ),
    f"{_ENV}:_validate_env_arguments": PrivateName(
        "flavors/jaxexp.py (save_model)",
        "refuse more than one of conda_env, pip_requirements, extra_pip_requirements",
        "reimplemented (same ValueError)",
    ),
    f"{_ENV}:_PythonEnv": PrivateName(
        "flavors/jaxexp.py (_write_environment)",
        "python_env.yaml (python, pip/setuptools/wheel, -r requirements.txt)",
        "reimplemented: the same YAML",
    ),
    f"{_ENV}:_CONDA_ENV_FILE_NAME": PrivateName(
        "flavors/jaxexp.py", "file name MLflow's flavors use", '"conda.yaml"'
    ),
    f"{_ENV}:_REQUIREMENTS_FILE_NAME": PrivateName(
        "flavors/jaxexp.py", "file name MLflow's flavors use", '"requirements.txt"'
    ),
    f"{_ENV}:_CONSTRAINTS_FILE_NAME": PrivateName(
        "flavors/jaxexp.py", "file name MLflow's flavors use", '"constraints.txt"'
    ),
    f"{_ENV}:_PYTHON_ENV_FILE_NAME": PrivateName(
        "flavors/jaxexp.py", "file name MLflow's flavors use", '"python_env.yaml"'
    ),
    f"{_MODEL_UTILS}:_validate_and_copy_code_paths": PrivateName(
        "flavors/jaxexp.py (save_model)",
        "copy code_paths (and this package) into the model's code/",
        "reimplemented: the same copy (files, trees without __pycache__)",
    ),
    "mlflow.models.utils:_save_example": PrivateName(
        "flavors/jaxexp.py (save_model)",
        "input_example.json, serving_input_example.json and the MLmodel saved_input_example_info",
        "reimplemented for {name: ndarray} (what the flavor passes): the same two files",
    ),
}

#: Private names the package does not touch, replaced outright by public API or its own code.
REPLACED_BY_PUBLIC: dict[str, str] = {
    "mlflow.tracking.artifact_utils:_download_artifact_from_uri": (
        "mlflow.artifacts.download_artifacts(artifact_uri=..., dst_path=...), which calls it "
        "(download.py, refresh.py)"
    ),
    "mlflow.utils.model_utils:_get_flavor_configuration": (
        "the package's own bounded MLmodel reader: codec.mlmodel.read_mlmodel, then "
        "store.section.flavor_section (validated)"
    ),
    f"{_MODEL_UTILS}:_add_code_from_conf_to_system_path": (
        "nothing: no jaxexp path puts a model's code/ on sys.path (docs/security.md)"
    ),
    f"{_HTTP_REPO}._is_multipart_upload_enabled": (
        "nothing: params go up as files through log_artifact"
    ),
    "mlflow.utils.mime_type_utils:_guess_mime_type": (
        "nothing: params go up as files through log_artifact"
    ),
    "mlflow.models.signature:ModelSignature._is_signature_from_type_hint": (
        "nothing: the stored signature declares no inputs (serving/signature.served_signature), "
        "MLflow's public way to hand a model its input unchanged at every door"
    ),
}

_taken: set[str] = set()
_lock = threading.Lock()


def lookup(name: str) -> Any | None:
    """The object ``name`` (``"module:qualified.name"``) in the installed MLflow, or None."""
    module, _, qual = name.partition(":")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError:
        return None
    for part in qual.split("."):
        # on the class itself: a property (``_host_creds``) is looked up, not called
        obj = getattr(obj, part, _ABSENT)
        if obj is _ABSENT:
            return None
    return obj


_ABSENT = object()


def present(name: str) -> bool:
    """Whether the installed MLflow still has the private name ``name``."""
    module, _, qual = name.partition(":")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError:
        return False
    for part in qual.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def missing() -> list[str]:
    """The names of :data:`PRIVATE_NAMES` the installed MLflow no longer has."""
    return [name for name in PRIVATE_NAMES if not present(name)]


def fallbacks_taken() -> set[str]:
    """The names whose fallback has run in this process."""
    with _lock:
        return set(_taken)


def _fallback(name: str) -> None:
    """Record (and log once, at debug level) that ``name`` was missing and its fallback ran."""
    with _lock:
        first = name not in _taken
        _taken.add(name)
    if first:
        import mlflow

        _logger.debug(
            "MLflow %s has no %s: using the fallback (%s).",
            mlflow.__version__,
            name,
            PRIVATE_NAMES[name].fallback,
        )


def _private(name: str) -> Any | None:
    """The module-level private object ``name``, or None (fallback recorded)."""
    obj = lookup(name)
    if obj is None:
        _fallback(name)
    return obj


def _member(obj: Any, name: str) -> Any | None:
    """``obj``'s private member ``name`` (its last component; a bound method, a property's
    value), or None (fallback recorded)."""
    found = getattr(obj, name.partition(":")[2].rpartition(".")[2], None)
    if found is None:
        _fallback(name)
    return found


# ============================================================================================
# artifact transfer


def download_file(repo: Any, remote_path: str, local_path: str | os.PathLike) -> None:
    """Download the file ``remote_path`` of artifact repository ``repo`` to ``local_path``
    (its parent exists): ``repo._download_file``, else the public ``download_artifacts``."""
    name = "mlflow.store.artifact.artifact_repo:ArtifactRepository._download_file"
    fn = _member(repo, name)
    if fn is not None:
        fn(remote_path, str(local_path))
        return
    local = Path(local_path)
    tmp = tempfile.mkdtemp(prefix=".jaxexp-dl-", dir=local.parent)
    try:
        got = repo.download_artifacts(remote_path, dst_path=tmp)
        os.replace(got, local)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def download_file_at_most(
    repo: Any, remote_path: str, local_path: str | os.PathLike, max_bytes: int
) -> None:
    """:func:`download_file`, reading at most ``max_bytes`` from ``mlflow server``: where
    ``HttpArtifactRepository._download_file`` is there, the GET it sends (public
    ``http_request``: auth, retries) is sent here and its body cut after ``max_bytes``; any
    other repository, or without that method, :func:`download_file` (the caller checks the
    size afterwards)."""
    from mlflow.store.artifact.http_artifact_repo import HttpArtifactRepository

    name = "mlflow.store.artifact.artifact_repo:ArtifactRepository._download_file"
    creds = host_creds(repo) if isinstance(repo, HttpArtifactRepository) else None
    if creds is None or _member(repo, name) is None:
        download_file(repo, remote_path, local_path)
        return
    from mlflow.utils.rest_utils import augmented_raise_for_status, http_request

    resp = http_request(creds, posixpath.join("/", remote_path), "GET", stream=True)
    try:
        augmented_raise_for_status(resp)
        left = max_bytes
        with open(local_path, "wb") as f:
            for chunk in resp.iter_content(chunk_size=1 << 20):
                f.write(chunk[:left])
                left -= min(len(chunk), left)
                if left == 0:
                    break
    finally:
        resp.close()


def add_registered_model_meta(outer: Any, model_dir: str | os.PathLike) -> bool:
    """What MLflow's ``models:/`` download does to a downloaded model directory: write
    ``registered_model_meta`` where the installed MLflow still does (<= 3.17); nothing where it
    does not (3.18 dropped it; nothing reads it). Returns whether the file was written."""
    name = (
        "mlflow.store.artifact.models_artifact_repo:ModelsArtifactRepository."
        "_add_registered_model_meta_file"
    )
    fn = _member(outer, name)
    if fn is None:
        return False
    fn(str(model_dir))
    return True


def host_creds(repo: Any) -> Any | None:
    """The ``MlflowHostCreds`` an ``HttpArtifactRepository`` sends its requests with, or None
    when they cannot be had (then do not upload from memory)."""
    creds = _member(repo, f"{_HTTP_REPO}._host_creds")
    if creds is not None:
        return creds
    try:
        from mlflow.utils.credentials import get_default_host_creds
    except ImportError:
        return None
    return get_default_host_creds(repo.artifact_uri)


def root_uri_and_artifact_path(artifact_uri: str) -> tuple[str, str]:
    """``(root URI, path inside it)`` of a non-local artifact URI, as MLflow's download splits
    it (``models:/name/1/sub`` -> ``models:/name/1``, ``sub``; else dirname, basename)."""
    fn = _private("mlflow.tracking.artifact_utils:_get_root_uri_and_artifact_path")
    if fn is not None:
        return fn(artifact_uri)
    from mlflow.store.artifact.models_artifact_repo import ModelsArtifactRepository

    if os.path.exists(artifact_uri) and os.name != "nt":
        return os.path.dirname(artifact_uri), os.path.basename(artifact_uri)
    if ModelsArtifactRepository.is_models_uri(artifact_uri):
        return ModelsArtifactRepository.split_models_uri(artifact_uri)
    parsed = urllib.parse.urlparse(str(artifact_uri))
    prefix = ""
    if parsed.scheme and not parsed.path.startswith("/"):
        prefix = parsed.scheme + ":"
        parsed = parsed._replace(scheme="")
    artifact_path = posixpath.basename(parsed.path)
    parsed = parsed._replace(path=posixpath.dirname(parsed.path))
    return prefix + urllib.parse.urlunparse(parsed), artifact_path


# ============================================================================================
# saving, logging, loading a model


def await_registration_default() -> int:
    """MLflow's default ``await_registration_for`` (seconds)."""
    value = _private("mlflow.tracking._model_registry:DEFAULT_AWAIT_MAX_SLEEP_SECONDS")
    return 300 if value is None else int(value)


class EnvFiles(NamedTuple):
    """The environment file names MLflow's flavors write into a model directory."""

    conda: str
    requirements: str
    constraints: str
    python_env: str


def env_file_names() -> EnvFiles:
    """conda.yaml, requirements.txt, constraints.txt, python_env.yaml (MLflow's own names)."""
    names = []
    for attr, default in (
        ("_CONDA_ENV_FILE_NAME", "conda.yaml"),
        ("_REQUIREMENTS_FILE_NAME", "requirements.txt"),
        ("_CONSTRAINTS_FILE_NAME", "constraints.txt"),
        ("_PYTHON_ENV_FILE_NAME", "python_env.yaml"),
    ):
        value = _private(f"{_ENV}:{attr}")
        names.append(default if value is None else value)
    return EnvFiles(*names)


def pinned_requirement(package: str) -> str:
    """``package==<installed version>`` (local version label dropped), as MLflow pins."""
    fn = _private("mlflow.utils.requirements_utils:_get_pinned_requirement")
    if fn is not None:
        return fn(package)
    from packaging.requirements import Requirement

    req = Requirement(package)
    version = installed_version(req.name)
    if version is None:
        raise ModuleNotFoundError(f"{req.name} is not installed: cannot pin it")
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    return f"{req.name}{extras}=={strip_local(version)}"


def mlflow_conda_env(
    additional_pip_deps: list[str] | None = None, install_mlflow: bool = True
) -> dict[str, Any]:
    """The conda environment MLflow's flavors write (``conda.yaml``), with these pip deps."""
    fn = _private(f"{_ENV}:_mlflow_conda_env")
    if fn is not None:
        return fn(additional_pip_deps=additional_pip_deps, install_mlflow=install_mlflow)
    pip_deps = list(additional_pip_deps or [])
    if install_mlflow and not any(map(is_mlflow_requirement, pip_deps)):
        import mlflow

        pip_deps.insert(0, f"mlflow=={mlflow.__version__}")
    conda_deps: list[Any] = []
    if pip_deps:
        pip_version = installed_version("pip")
        conda_deps.append(f"pip<={pip_version}" if pip_version else "pip")
    return {
        "name": "mlflow-env",
        "channels": ["conda-forge"],
        "dependencies": [f"python={python_version()}", *conda_deps, {"pip": pip_deps}],
    }


def validate_env_arguments(conda_env: Any, pip_requirements: Any, extra: Any) -> None:
    """ValueError when more than one of the three is given (MLflow's rule)."""
    fn = _private(f"{_ENV}:_validate_env_arguments")
    if fn is not None:
        fn(conda_env, pip_requirements, extra)
        return
    if sum(arg is not None for arg in (conda_env, pip_requirements, extra)) > 1:
        raise ValueError(
            "Only one of `conda_env`, `pip_requirements`, and "
            "`extra_pip_requirements` can be specified"
        )


def process_pip_requirements(
    default: list[str] | None, pip_requirements: Any = None, extra: Any = None
) -> tuple[dict[str, Any], list[str], list[str]]:
    """``(conda env, pip requirements, pip constraints)`` for ``save_model``'s arguments, as
    MLflow's flavors compute them."""
    fn = _private(f"{_ENV}:_process_pip_requirements")
    if fn is not None:
        return fn(default, pip_requirements, extra)
    constraints: list[str] = []
    if pip_requirements is not None:
        reqs, constraints = parse_pip_requirements(pip_requirements)
    elif extra is not None:
        extra_reqs, constraints = parse_pip_requirements(extra)
        reqs = list(default or []) + extra_reqs
    else:
        reqs = list(default or [])
    if not any(map(is_mlflow_requirement, reqs)):
        reqs.insert(0, mlflow_pin())
    reqs = deduplicate(reqs)
    if constraints:
        reqs.append(f"-c {env_file_names().constraints}")
    return mlflow_conda_env(reqs, install_mlflow=False), reqs, constraints


def process_conda_env(conda_env: Any) -> tuple[dict[str, Any], list[str], list[str]]:
    """``(conda env, pip requirements, pip constraints)`` for a ``conda_env=`` (dict or path)."""
    fn = _private(f"{_ENV}:_process_conda_env")
    if fn is not None:
        return fn(conda_env)
    import yaml

    if isinstance(conda_env, str):
        with open(conda_env) as f:
            conda_env = yaml.safe_load(f)
    elif not isinstance(conda_env, dict):
        raise TypeError(
            "Expected a string path to a conda env yaml file or a `dict` representing a conda "
            f"env, but got `{type(conda_env).__name__}`"
        )
    deps = conda_env.get("dependencies", [])
    pip = next((d["pip"] for d in deps if isinstance(d, dict) and "pip" in d), [])
    reqs, constraints = parse_pip_requirements(pip)
    if not any(map(is_mlflow_requirement, reqs)):
        reqs.insert(0, mlflow_pin())
    if constraints:
        reqs.append(f"-c {env_file_names().constraints}")
    new_deps = [{"pip": reqs} if isinstance(d, dict) and "pip" in d else d for d in deps]
    if not any(isinstance(d, dict) and "pip" in d for d in deps):
        new_deps.append({"pip": reqs})
    return {**conda_env, "dependencies": new_deps}, reqs, constraints


def write_python_env(path: str | os.PathLike) -> None:
    """Write ``python_env.yaml`` for this interpreter to ``path``, as MLflow's flavors do."""
    cls = _private(f"{_ENV}:_PythonEnv")
    if cls is not None:
        cls.current().to_yaml(str(path))
        return
    import yaml

    build = []
    for package in ("pip", "setuptools", "wheel"):
        version = installed_version(package)
        build.append(f"{package}=={version}" if version else package)
    data = {
        "python": python_version(),
        "build_dependencies": build,
        "dependencies": [f"-r {env_file_names().requirements}"],
    }
    with open(path, "w") as f:
        yaml.safe_dump(data, f, sort_keys=False, default_flow_style=False)


def copy_code_paths(code_paths: list[str] | None, path: str) -> str | None:
    """Copy ``code_paths`` into ``path``/code; returns ``"code"`` (None without code paths)."""
    fn = _private(f"{_MODEL_UTILS}:_validate_and_copy_code_paths")
    if fn is not None:
        return fn(code_paths, path)
    if code_paths is None:
        return None
    if not isinstance(code_paths, list):
        raise TypeError(f"Argument code_paths should be a list, not {type(code_paths)}")
    for src in code_paths:
        dst = os.path.join(path, "code", os.path.basename(os.path.abspath(src)))
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copy(src, dst)
        else:
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    return "code"


def save_input_example(mlflow_model: Any, example: Any, path: str | os.PathLike) -> None:
    """Save ``example`` (``{input name: ndarray}``) as the model's MLflow input example
    (``input_example.json``, ``serving_input_example.json``, ``saved_input_example_info``)."""
    fn = _private("mlflow.models.utils:_save_example")
    if fn is not None:
        fn(mlflow_model, example, str(path))
        return
    import numpy as np

    if isinstance(example, dict) and all(isinstance(v, np.ndarray) for v in example.values()):
        data: Any = {k: jsonable(v) for k, v in example.items()}
    elif isinstance(example, np.ndarray):
        data = jsonable(example)
    else:  # only what the flavor passes is reimplemented: no example (a nicety) otherwise
        return
    with open(os.path.join(path, "input_example.json"), "w") as f:
        f.write(json.dumps(data))
    with open(os.path.join(path, "serving_input_example.json"), "w") as f:
        f.write(json.dumps({"inputs": data}, indent=2))
    mlflow_model.saved_input_example_info = {
        "artifact_path": "input_example.json",
        "type": "ndarray",
        "serving_input_path": "serving_input_example.json",
    }
