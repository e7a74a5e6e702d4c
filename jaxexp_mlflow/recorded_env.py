"""Re-run a model's reference in the environment it was logged with.

MLflow records the exact requirements of a logged model (``requirements.txt``,
``python_env.yaml``: the exporter's jax and jaxlib among them). :func:`run_recorded` restores that
environment with MLflow's own machinery, as ``mlflow models predict --env-manager`` does
(``PyFuncBackend.prepare_env``: ``uv`` or ``virtualenv``, cached under MLflow's environment root
and reused), and runs the stored reference input there (``_env_runner.py``). ``jaxexp verify
--env-manager`` puts that run, the stored reference and the current environment side by side.

The loader there is jaxexp-mlflow, never Python from the model directory (not even the copy an
``include_package=True`` model carries in ``code/``): the one the model's requirements install
(``jaxexp-mlflow>=X.Y.Z``), or, when the environment cannot be built with it (the package is not
on the index at hand, an air-gapped machine) or the requirements do not name it (models saved
before it was required), the jaxexp-mlflow running here: the environment is then built from the
requirements without that line, and the runner finds this package at the end of its
``sys.path`` (a directory holding only a link to it), so that what the environment installed
wins and nothing else of this installation leaks in.

Restoring an environment installs what the model's requirements name, and a model directory is
untrusted input: :func:`check_requirements` reads them as MLflow will (``python_env.yaml``, the
``requirements.txt``/``constraints.txt`` it names, or ``conda.yaml``) and, unless trusted,
refuses anything but plain ``name[extras] (op version)`` requirements from the index before
anything is installed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jaxexp_mlflow.errors import JaxExpError

RUNNER = Path(__file__).with_name("_env_runner.py")
ENV_MANAGERS = ("uv", "virtualenv")


class RecordedEnvError(JaxExpError):
    """The recorded environment could not be built, or the model did not run in it."""


class UntrustedRequirementsError(RecordedEnvError):
    """The model's requirements install more than plain packages from the index (local paths,
    URLs, VCS, editable installs, installer options, a uv.lock) or name a Python that is not a
    version; refused before anything is installed unless trusted."""


@dataclass
class RecordedRun:
    """What the model gave in its recorded environment."""

    env_manager: str
    requirements: list[str]
    python: str | None = None
    jax_version: str | None = None
    jaxlib_version: str | None = None
    outputs: list[np.ndarray] | None = None
    error: str | None = None
    seconds: float | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """``jax 0.6.2 / jaxlib 0.6.2, python 3.11.7 (uv)``."""
        return (
            f"jax {self.jax_version} / jaxlib {self.jaxlib_version}, python {self.python} "
            f"({self.env_manager} environment from the model's requirements)"
        )


def requirements(local_path: str | Path) -> list[str]:
    """The model's recorded pip requirements (``requirements.txt``), comments dropped."""
    from jaxexp_mlflow.codec import files

    if not os.path.lexists(Path(local_path, "requirements.txt")):
        return []
    text = files.read_bytes(
        local_path, "requirements.txt", what="requirements.txt", max_bytes=1 << 20
    ).decode("utf-8", "replace")
    lines = (ln.split("#")[0].strip() for ln in text.splitlines())
    return [ln for ln in lines if ln]


# -- what restoring the environment installs ----------------------------------------------------

#: MLflow's own file names: ``python_env.yaml`` lists ``-r requirements.txt``, which may list
#: ``-c constraints.txt`` (``mlflow.utils.environment``). No other file is followed.
_REQUIREMENTS_FILE, _CONSTRAINTS_FILE = "requirements.txt", "constraints.txt"
_PYTHON_VERSION = re.compile(r"\d+(\.\d+){0,2}")
_CONDA_BUILD_DEP = re.compile(
    r"^(?P<package>python|pip|setuptools|wheel)(?P<operator><|>|<=|>=|=|==|!=)?(?P<version>[\d.]+)?$"
)
#: The file references followed (option -> file), from the env file and from requirements.txt;
#: any other is refused as "another requirements file".
_FROM_ENV = {"-r": _REQUIREMENTS_FILE, "--requirement": _REQUIREMENTS_FILE}
_FOLLOW = {_REQUIREMENTS_FILE: {"-c": _CONSTRAINTS_FILE, "--constraint": _CONSTRAINTS_FILE}}
_HASH_OPTION = re.compile(r"\s+--hash(=|\s+)\S+")
_ARCHIVE = (".whl", ".zip", ".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz", ".tar.xz", ".txz")
_OPTION_REASONS = {
    ("-e", "--editable"): "an editable install: runs the build backend of what it names",
    ("-i", "--index-url", "--extra-index-url", "--find-links", "-f", "--trusted-host", "--index"): (
        "an index option: packages from a source of the model's choosing"
    ),
    ("-r", "--requirement", "-c", "--constraint"): "another requirements file",
}


@dataclass
class InstallPlan:
    """What restoring the model's recorded environment installs, read as MLflow reads it."""

    env_manager: str
    python: str | None = None
    requirements: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """The lines printed before anything is installed."""
        head = (
            f"Installing into the recorded environment ({self.env_manager}) what the model's "
            f"requirements name ({', '.join(self.files) or 'no requirement files'}; nothing if "
            "MLflow's cached environment for them exists):"
        )
        lines = [f"  python {self.python or '(the running version)'}"]
        lines += [f"  {r}" for r in self.requirements]
        if self.refused:
            lines.append(
                f"  ({len(self.refused)} of them beyond plain requirements from the index, "
                "installed because --trust-requirements is set)"
            )
        return "\n".join([head, *lines])


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _logical_lines(text: str) -> list[str]:
    """pip's reading of a requirements file: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\r?\n", "", text)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        if line:
            out.append(line)
    return out


def _why_not_plain(line: str) -> str | None:
    """None for a plain ``name[extras] (op version) (; marker)`` requirement from the index,
    else what the line would make the installer do."""
    from packaging.requirements import InvalidRequirement, Requirement

    if line.startswith("-"):
        option = re.split(r"[\s=]", line, maxsplit=1)[0]
        for names, why in _OPTION_REASONS.items():
            if option in names:
                return why
        return "an installer option"
    if "://" in line or re.match(r"(git|hg|svn|bzr)\+", line):
        return "a URL or VCS source"
    if line.startswith((".", "/", "~")) or "/" in line.split(";")[0] or "\\" in line:
        return "a local path"
    try:
        req = Requirement(_HASH_OPTION.sub("", line))
    except InvalidRequirement:
        return "not a requirement (expected `name[extras] (op version)`)"
    if req.url:
        return "a direct reference (URL, VCS or local path)"
    if req.name.lower().endswith(_ARCHIVE):
        return "a local archive"
    return None


def _read_text(root: Path, rel: str, what: str) -> str | None:
    from jaxexp_mlflow.codec import files

    path = files.resolve_inside(root, rel, what=what)
    if not os.path.lexists(path):
        return None
    raw = files.read_bytes(root, rel, what=what, max_bytes=1 << 20)
    return raw.decode("utf-8", "replace")


def _read_yaml(root: Path, rel: str, what: str) -> Any:
    from jaxexp_mlflow.codec.mlmodel import load_yaml

    text = _read_text(root, rel, what)
    return None if text is None else load_yaml(text, source=rel)


def _env_files(root: Path) -> tuple[str, str]:
    """(python env file, conda file) as MLflow picks them: the pyfunc flavor's ``env``."""
    from jaxexp_mlflow.codec.mlmodel import read_mlmodel

    python_env, conda = "python_env.yaml", "conda.yaml"
    if not os.path.lexists(root / "MLmodel"):
        return python_env, conda
    pyfunc = ((read_mlmodel(root).get("flavors") or {}).get("python_function")) or {}
    env = pyfunc.get("env") if isinstance(pyfunc, dict) else None
    if isinstance(env, dict):
        python_env = env.get("virtualenv") or python_env
        conda = env.get("conda") or conda
    elif isinstance(env, str):
        conda = env
    return python_env, conda


def install_plan(local_path: str | Path, env_manager: str = "uv") -> InstallPlan:
    """What MLflow will install to restore the model's environment, and which of it is more
    than a plain requirement from the index (``refused``). Mirrors
    what MLflow's virtualenv restoration reads (its python_env.yaml, then the files that names)."""
    root = Path(local_path)
    plan = InstallPlan(env_manager)

    def refuse(where: str, line: str, why: str) -> None:
        plan.refused.append(f"{where}: `{_short(line)}` ({why})")

    def add(where: str, line: str, follow: dict[str, str]) -> None:
        """One requirement line of ``where``; a reference to MLflow's own file (``follow``:
        ``-r requirements.txt`` in the env file, ``-c constraints.txt`` in that) is followed
        and each of its lines checked."""
        option, _, rest = re.sub(r"^(-\w|--[\w-]+)=", r"\1 ", line).partition(" ")
        name = follow.get(option)
        if name is not None and rest.strip() == name:
            text = _read_text(root, name, f"{name} (named in {where})")
            if text is not None:
                plan.files.append(name)
                for ln in _logical_lines(text):
                    add(name, ln, _FOLLOW.get(name, {}))
                return
        plan.requirements.append(line)
        why = _why_not_plain(line)
        if why:
            refuse(where, line, why)

    if env_manager == "uv" and os.path.lexists(root / "uv.lock"):
        plan.files.append("uv.lock")
        plan.requirements.append("(uv sync of the model's uv.lock and pyproject.toml)")
        refuse(
            "uv.lock",
            "uv sync",
            "the lock's sources, indexes and build backends are the "
            "model's choice; jaxexp does not check them",
        )
        return plan
    python_env_file, conda_file = _env_files(root)
    python_env = _read_yaml(root, python_env_file, f"python env file {python_env_file!r}")
    if python_env is not None:
        plan.files.append(python_env_file)
        env = python_env if isinstance(python_env, dict) else {}
        python, build, deps = (
            env.get("python"),
            env.get("build_dependencies"),
            env.get("dependencies"),
        )
        source = python_env_file
    else:
        conda = _read_yaml(root, conda_file, f"conda file {conda_file!r}") or {}
        if conda:
            plan.files.append(conda_file)
        python, build, deps = None, [], None
        for dep in (conda.get("dependencies") if isinstance(conda, dict) else None) or []:
            match = _CONDA_BUILD_DEP.match(dep) if isinstance(dep, str) else None
            if match and match["package"] == "python":
                python = match["version"]
            elif match:
                op = "==" if match["operator"] == "=" else (match["operator"] or "")
                build.append(match["package"] + op + (match["version"] or ""))
            elif isinstance(dep, dict) and "pip" in dep:
                deps = dep["pip"]
        if os.path.lexists(root / _REQUIREMENTS_FILE):
            deps = [f"-r {_REQUIREMENTS_FILE}"]
        source = conda_file
    if python is not None:
        plan.python = str(python)
        if not isinstance(python, str | int | float) or not _PYTHON_VERSION.fullmatch(plan.python):
            refuse(
                source,
                f"python: {plan.python}",
                "expected a version such as 3.11.7; "
                "anything else names an interpreter of the model's choosing to run",
            )
    for group in (build, deps):
        if group is None:
            continue
        if not isinstance(group, list):
            refuse(source, str(group), "expected a list of requirements")
            continue
        for item in group:
            if not isinstance(item, str):
                refuse(source, repr(item), "expected a requirement string")
                continue
            for ln in _logical_lines(item):
                add(source, ln, _FROM_ENV)
    return plan


def check_requirements(
    local_path: str | Path, env_manager: str = "uv", *, trust: bool = False
) -> InstallPlan:
    """:func:`install_plan`, refusing with :class:`UntrustedRequirementsError` (before anything
    is installed) a plan with more than plain requirements from the index unless ``trust``."""
    plan = install_plan(local_path, env_manager)
    if plan.refused and not trust:
        shown = "; ".join(plan.refused[:10]) + (
            f"; and {len(plan.refused) - 10} more" if len(plan.refused) > 10 else ""
        )
        raise UntrustedRequirementsError(
            f"`--env-manager {env_manager}` installs what the model's requirements name; expected "
            "plain `name[extras] (op version)` requirements from your package index (environment "
            f"markers allowed) and a Python version, found {len(plan.refused)} entr"
            f"{'y' if len(plan.refused) == 1 else 'ies'} that install from elsewhere or run code "
            f"of the model's choosing: {shown}. Nothing was installed. Read these files in the "
            "model directory; if you trust this model to run code on this machine, pass "
            "--trust-requirements (run_recorded(..., trust_requirements=True))."
        )
    return plan


_LOADER = re.compile(r"^\s*jaxexp[-_.]mlflow(?![\w.-])", re.IGNORECASE)
#: The model's environment files, copied (without the loader's line) for a fallback build.
_ENV_FILES = ("MLmodel", "python_env.yaml", "requirements.txt", "constraints.txt", "conda.yaml")


def _names_loader(line: str) -> bool:
    """Whether a requirement line (or a ``conda.yaml`` pip entry) names jaxexp-mlflow."""
    return bool(_LOADER.match(line.strip().removeprefix("- ").strip()))


def _check_loader_version(reqs: list[str]) -> None:
    """The running jaxexp-mlflow must satisfy the model's own requirement on it."""
    from packaging.requirements import InvalidRequirement, Requirement

    from jaxexp_mlflow import __version__

    for line in reqs:
        if not _names_loader(line):
            continue
        try:
            spec = Requirement(line).specifier
        except InvalidRequirement:
            continue
        if not spec.contains(__version__, prereleases=True):
            raise RecordedEnvError(
                f"The model requires {line!r} and the index at hand does not provide it; the "
                f"jaxexp-mlflow running here is {__version__}. Install a jaxexp-mlflow that "
                "satisfies it (or make it available to uv) and verify again."
            )


#: jaxexp-mlflow's own dependencies where its distribution metadata cannot be read.
_LOADER_DEPS = ("click>=8.1", "google-crc32c>=1.5", "tqdm>=4.66")


def _loader_dependencies() -> list[str]:
    """What the running jaxexp-mlflow needs besides itself (its distribution's requirements
    without extras): installed in place of the ``jaxexp-mlflow`` line of a fallback build."""
    import importlib.metadata

    try:
        reqs = importlib.metadata.requires("jaxexp-mlflow") or []
    except importlib.metadata.PackageNotFoundError:
        return list(_LOADER_DEPS)
    return [r for r in reqs if "extra" not in r.partition(";")[2]] or list(_LOADER_DEPS)


def _without_loader(local: Path, into: Path) -> Path:
    """A copy of the model's environment files where the jaxexp-mlflow requirement is replaced
    by the running package's own dependencies (the package itself comes from ``_loader_dir``)."""
    into.mkdir(exist_ok=True)
    deps = _loader_dependencies()
    for name in _ENV_FILES:
        src = local / name
        if not src.is_file() or src.is_symlink():
            continue
        if name == "MLmodel":
            shutil.copyfile(src, into / name)
            continue
        from jaxexp_mlflow.codec import files

        text = files.read_bytes(local, name, what=name, max_bytes=1 << 20).decode("utf-8")
        kept: list[str] = []
        for ln in text.splitlines():
            if not _names_loader(ln.split("#")[0]):
                kept.append(ln)
            elif name != "constraints.txt":
                indent = ln[: len(ln) - len(ln.lstrip())]
                dash = "- " if ln.lstrip().startswith("- ") else ""
                kept.extend(f"{indent}{dash}{d}" for d in deps)
        (into / name).write_text("\n".join(kept) + "\n")
    return into


def _loader_dir(into: Path) -> Path:
    """A directory holding only ``jaxexp_mlflow``, a link to the package running here."""
    into.mkdir()
    (into / "jaxexp_mlflow").symlink_to(Path(__file__).resolve().parent, target_is_directory=True)
    return into


def _prepare(local: Path, env_manager: str, env_root_dir: str | None, capture: bool) -> Any:
    from mlflow.pyfunc.backend import PyFuncBackend

    backend = PyFuncBackend(
        config={}, env_manager=env_manager, install_mlflow=False, env_root_dir=env_root_dir
    )
    return backend.prepare_env(str(local), capture_output=capture)


def run_recorded(
    local_path: str | Path,
    env_manager: str = "uv",
    *,
    env_root_dir: str | None = None,
    capture_output: bool = True,
    trust_requirements: bool = False,
) -> RecordedRun:
    """Build (or reuse) the model's recorded environment and run its reference input there.

    Raises :class:`UntrustedRequirementsError` before anything is installed if the model's
    requirements are more than plain requirements from the index, unless
    ``trust_requirements`` (:func:`check_requirements`); :class:`RecordedEnvError` if the
    environment cannot be built (e.g. ``virtualenv`` without pyenv, ``uv`` missing, a pinned
    version not on the index); a model that fails to run inside the environment is returned
    with ``error`` set.
    """
    from mlflow.exceptions import MlflowException

    from jaxexp_mlflow.reproduce import decode_outputs

    if env_manager not in ENV_MANAGERS:
        raise RecordedEnvError(
            f"--env-manager must be one of {', '.join(ENV_MANAGERS)}, got {env_manager!r}."
        )
    local = Path(local_path).resolve()
    run = RecordedRun(env_manager, requirements(local))
    check_requirements(local, env_manager, trust=trust_requirements)  # before installing anything
    names_loader = any(_names_loader(r) for r in run.requirements)
    with tempfile.TemporaryDirectory(prefix="jaxexp-env-") as out:
        try:
            try:
                environment = _prepare(local, env_manager, env_root_dir, capture_output)
                run.details["loader"] = "recorded requirements" if names_loader else "here"
            except (MlflowException, Exception):  # noqa: BLE001 - MLflow raises plain Exception
                if not names_loader:
                    raise
                # jaxexp-mlflow is not on the index at hand: the one running here loads it
                _check_loader_version(run.requirements)
                shadow = _without_loader(local, Path(out, "env"))
                environment = _prepare(shadow, env_manager, env_root_dir, capture_output)
                run.details["loader"] = "here (not installable from the index)"
        except RecordedEnvError:
            raise
        except (MlflowException, Exception) as err:  # noqa: BLE001 - MLflow raises plain Exception
            raise RecordedEnvError(
                f"Could not build the model's recorded environment with {env_manager} "
                f"(requirements {run.requirements}): {' '.join(str(err).split())[:800]}. "
                + (
                    "MLflow's virtualenv manager needs pyenv to install the recorded Python; "
                    "try --env-manager uv."
                    if env_manager == "virtualenv"
                    else "Is `uv` installed (pip install uv) and the package index reachable?"
                )
            ) from err
        loader = _loader_dir(Path(out, "loader"))
        outputs = Path(out, "outputs")
        outputs.mkdir()
        cmd = " ".join(shlex.quote(str(x)) for x in ("python", RUNNER, local, outputs, loader))
        try:
            environment.execute(cmd, capture_output=capture_output)
        except Exception as err:  # noqa: BLE001 - the runner itself failed to start
            raise RecordedEnvError(f"The runner failed in the recorded environment: {err}") from err
        result = json.loads(Path(outputs, "result.json").read_text())
        run.details = {**result, **run.details}
        run.python = result.get("python")
        run.jax_version, run.jaxlib_version = (
            result.get("jax_version"),
            result.get("jaxlib_version"),
        )
        run.error, run.seconds = result.get("error"), result.get("seconds")
        if run.error is None:
            with np.load(Path(outputs, "outputs.npz"), allow_pickle=False) as data:
                raw = [data[f"out_{i}"] for i in range(len(result["output_dtypes"]))]
            run.outputs = decode_outputs(raw, result["output_dtypes"])
    return run
