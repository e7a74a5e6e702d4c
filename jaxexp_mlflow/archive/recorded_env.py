"""Re-run a model's reference in the environment it was logged with.

``jaxexp verify --env-manager`` rebuilds the environment a model was logged with and runs its
stored reference input there (``_env_runner.py``), next to the stored reference and the current
environment. A model directory is untrusted input, so the environment is built from facts, not
from files the model ships:

* the requirement list is written here from what MLmodel records (``env_facts``: Python, jax,
  jaxlib, numpy, flatbuffers, orbax-checkpoint, mlflow and ``jaxexp-mlflow>=`` the version that
  wrote it), as pinned names from the user's index;
* it is installed (``env_build``: ``uv``, or ``venv`` + ``pip``) in an empty directory under the
  user's cache, so only the user's installer configuration applies (never a ``uv.toml`` the
  model ships), and cached there;
* only then does the environment's jaxexp-mlflow (or, where the index lacks it, the one running
  here, appended to ``sys.path`` from a directory holding only a link to it) load the model, in
  ``python -I`` from an empty working directory.

What the model's own requirements add (``python_env.yaml``, the ``requirements.txt`` /
``constraints.txt`` it names, or ``conda.yaml``, read as MLflow reads them) is shown, and
installed (as written) only with ``--trust-requirements``. :func:`check_requirements` still
refuses, before anything is installed, lines that would install from elsewhere or run a build
backend, so that a hostile model is named as such; no fallback reads any other file.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jaxexp_mlflow.archive.env_facts import EnvFacts, recorded_facts
from jaxexp_mlflow.errors import JaxExpError

RUNNER = Path(__file__).with_name("_env_runner.py")
ENV_MANAGERS = ("uv", "virtualenv")


class RecordedEnvError(JaxExpError):
    """The recorded environment could not be built, or the model did not run in it."""


def read_child_result(
    outputs: Path,
    proc: subprocess.CompletedProcess,
    *,
    who: str,
    where: str = "",
    advice: str = "",
) -> dict[str, Any]:
    """The ``result.json`` a child process (the runner) wrote into ``outputs``; a typed refusal
    quoting the tail of its stderr when it wrote none."""
    result_file = outputs / "result.json"
    if not result_file.is_file():
        tail = " ".join((proc.stderr or "").split())[-800:]
        raise RecordedEnvError(
            f"{who} exited with code {proc.returncode}{where} without a result: "
            f"{tail or 'no output'}. Expected result.json.{advice}"
        )
    return json.loads(result_file.read_text())


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
            f"({self.env_manager} environment from MLmodel's record)"
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
_AMBIGUOUS = (
    "a comment ending in `\\`: pip reads the next line as a requirement, other readers as "
    "part of the comment"
)
_HASH_OPTION = re.compile(r"\s+--hash(=|\s+)\S+")
#: A name ending like an archive or a wheel is a local file to pip and uv (``.tar.lzma``,
#: ``.tlz`` and ``.tar.zst`` included), never a name from the index.
_ARCHIVE = re.compile(r"\.(whl|zip|tar|t[a-z]{0,2}z|gz|bz2|xz|lz|lzma|zst|z|7z|egg|rar)$", re.I)
_OPTION_REASONS = {
    ("-e", "--editable"): "an editable install: runs the build backend of what it names",
    ("-i", "--index-url", "--extra-index-url", "--find-links", "-f", "--trusted-host", "--index"): (
        "an index option: packages from a source of the model's choosing"
    ),
    ("-r", "--requirement", "-c", "--constraint"): "another requirements file",
}


@dataclass
class InstallPlan:
    """What restoring the model's recorded environment installs: the list written from
    MLmodel's facts (``facts``), and the model's own requirements read as MLflow reads them
    (``requirements``; those beyond the facts are ``facts.added``)."""

    env_manager: str
    python: str | None = None
    requirements: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    facts: EnvFacts | None = None
    trusted: bool = False

    def describe(self) -> str:
        """The lines printed before anything is installed."""
        facts = self.facts or EnvFacts()
        head = (
            f"Installing into the recorded environment ({self.env_manager}) what MLmodel records, "
            "from your package index, in a directory holding no file of the model (nothing if "
            "the cached environment exists):"
        )
        lines = [f"  python {facts.python or '(the running version: not recorded)'}"]
        lines += [f"  {r}  ({facts.sources.get(r.split('==')[0], 'MLmodel')})" for r in facts.pins]
        if facts.loader:
            lines.append(f"  {facts.loader}  (else the jaxexp-mlflow running here)")
        if facts.added:
            where = ", ".join(self.files) or "the model's requirements"
            verdict = (
                "installed as written because --trust-requirements is set"
                if self.trusted
                else "NOT installed (pass --trust-requirements to install them as written)"
            )
            lines.append(f"The model's requirements ({where}) add {len(facts.added)}, {verdict}:")
            lines += [f"  {_short(r)}" for r in facts.added]
        return "\n".join([head, *lines])


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


#: pip's comment: ``#`` at the start of a line or after whitespace.
_COMMENT = re.compile(r"(^|\s+)#.*$")


def _logical_lines(text: str, problems: list[str] | None = None) -> list[str]:
    """pip's reading of a requirements file (``pip._internal.req.req_file.join_lines``): a line
    ending in ``\\`` is joined with the next unless it holds a comment, comments dropped. A
    comment ending in ``\\`` (read as a continuation by other readers) is added to
    ``problems``: the readings differ, so the file is refused rather than guessed."""
    out: list[str] = []
    pending: list[str] = []
    for line in text.splitlines():
        comment = _COMMENT.search(line)
        if line.endswith("\\") and not comment:
            pending.append(line[:-1])
            continue
        if comment and line.rstrip().endswith("\\") and problems is not None:
            problems.append(line)
        joined = "".join([*pending, line])
        pending = []
        joined = _COMMENT.sub("", joined).strip()
        if joined:
            out.append(joined)
    if pending:
        joined = _COMMENT.sub("", "".join(pending)).strip()
        if joined:
            out.append(joined)
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
    if _ARCHIVE.search(req.name):
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
                ambiguous: list[str] = []
                for ln in _logical_lines(text, ambiguous):
                    add(name, ln, _FOLLOW.get(name, {}))
                for ln in ambiguous:
                    refuse(name, ln, _AMBIGUOUS)
                return
        plan.requirements.append(line)
        why = _why_not_plain(line)
        if why:
            refuse(where, line, why)

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
            ambiguous = []
            for ln in _logical_lines(item, ambiguous):
                add(source, ln, _FROM_ENV)
            for ln in ambiguous:
                refuse(source, ln, _AMBIGUOUS)
    return plan


def check_requirements(
    local_path: str | Path, env_manager: str = "uv", *, trust: bool = False
) -> InstallPlan:
    """:func:`install_plan` with the facts the environment is built from (``env_facts``),
    refusing with :class:`UntrustedRequirementsError` (before anything is installed) a recorded
    version that is not a release number, and, unless ``trust``, model requirements beyond plain
    requirements from the index (which would only be installed with ``trust`` anyway)."""
    plan = install_plan(local_path, env_manager)
    plan.facts = recorded_facts(local_path, plan.requirements)
    plan.trusted = trust
    plan.python = plan.facts.python
    if plan.facts.problems:
        raise UntrustedRequirementsError(
            "The recorded environment is written from the versions MLmodel records; "
            f"{'; '.join(plan.facts.problems[:10])}. Nothing was installed. The model's MLmodel "
            "is damaged or forged; download it again from its source."
        )
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


def _check_loader_version(loader: str | None) -> None:
    """The running jaxexp-mlflow must satisfy the record's requirement on it."""
    from packaging.requirements import InvalidRequirement, Requirement

    from jaxexp_mlflow import __version__

    try:
        spec = Requirement(loader or "jaxexp-mlflow").specifier
    except InvalidRequirement:
        return
    if not spec.contains(__version__, prereleases=True):
        raise RecordedEnvError(
            f"The model requires {loader!r} and the index at hand does not provide it; the "
            f"jaxexp-mlflow running here is {__version__}. Install a jaxexp-mlflow that "
            "satisfies it (or make it available to your index) and verify again."
        )


#: jaxexp-mlflow's own dependencies where its distribution metadata cannot be read.
_LOADER_DEPS = ("click>=8.1", "google-crc32c>=1.5", "tqdm>=4.66")


def _loader_dependencies() -> list[str]:
    """What the running jaxexp-mlflow needs besides itself (its distribution's requirements
    without extras): installed in place of ``jaxexp-mlflow`` when the index lacks it."""
    import importlib.metadata

    try:
        reqs = importlib.metadata.requires("jaxexp-mlflow") or []
    except importlib.metadata.PackageNotFoundError:
        return list(_LOADER_DEPS)
    return [r for r in reqs if "extra" not in r.partition(";")[2]] or list(_LOADER_DEPS)


def _loader_dir(into: Path) -> Path:
    """A directory holding only ``jaxexp_mlflow``, a link to the package running here."""
    into.mkdir()
    (into / "jaxexp_mlflow").symlink_to(
        Path(__file__).resolve().parents[1], target_is_directory=True
    )
    return into


def _args(line: str) -> list[str]:
    """A requirement line as installer arguments (``--index-url X`` is two), as written."""
    try:
        return shlex.split(line)
    except ValueError:  # unbalanced quotes: the line as one argument
        return [line]


def _build(
    plan: InstallPlan, local: Path, out: Path, root: Path | None, quiet: bool
) -> tuple[Path, list[str], str]:
    """(the environment's interpreter, what it was built from, which jaxexp-mlflow loads).

    First with ``jaxexp-mlflow>=V`` from the index; where the index lacks it, with the running
    package's dependencies instead (the package itself comes from :func:`_loader_dir`). Both
    lists are written from MLmodel's facts; no file of the model is read for either.
    """
    from jaxexp_mlflow.archive import env_build

    facts = plan.facts or EnvFacts()
    trusted = [a for line in facts.added for a in _args(line)] if plan.trusted else []
    with_loader = facts.requirements()
    without = [*facts.requirements(with_loader=False), *_loader_dependencies()]
    kw: dict[str, Any] = {"quiet": quiet, "root": root}
    if trusted:
        kw.update(trusted_args=trusted, trusted_cwd=local)
    elif env_build.cached(plan.env_manager, facts.python, without, root) and not env_build.cached(
        plan.env_manager, facts.python, with_loader, root
    ):
        python = env_build.build(plan.env_manager, facts.python, without, **kw)
        return python, without, "here (not installable from the index)"
    try:
        if trusted:
            kw["into"] = out / "env"
        python = env_build.build(plan.env_manager, facts.python, with_loader, **kw)
        return python, with_loader, "recorded requirements"
    except env_build.EnvBuildError as first:
        _check_loader_version(facts.loader)
        if trusted:
            kw["into"] = out / "env-here"
        try:
            python = env_build.build(plan.env_manager, facts.python, without, **kw)
        except env_build.EnvBuildError as err:
            raise RecordedEnvError(
                f"Could not build the model's recorded environment with {plan.env_manager} "
                f"(python {facts.python}, {' '.join(with_loader)}): {err.message} (with "
                f"{facts.loader}: {first.message[:300]}). Expected these pins on your package "
                "index; is it reachable, and is `uv` installed (pip install uv)?"
            ) from err
        return python, without, "here (not installable from the index)"


def _child_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}


def run_recorded(
    local_path: str | Path,
    env_manager: str = "uv",
    *,
    env_root_dir: str | None = None,
    capture_output: bool = True,
    trust_requirements: bool = False,
) -> RecordedRun:
    """Build (or reuse) the model's recorded environment and run its reference input there.

    The environment is written from MLmodel's facts (:func:`check_requirements`, which raises
    :class:`UntrustedRequirementsError` before anything is installed for a forged record or,
    unless ``trust_requirements``, hostile requirement lines) and cached under
    ``env_root_dir`` (default ``env_build.cache_root()``); what the model's requirements add is
    installed only with ``trust_requirements``. :class:`RecordedEnvError` if the environment
    cannot be built (``uv`` missing, a pinned version not on the index); a model that fails to
    run inside the environment is returned with ``error`` set.
    """
    from jaxexp_mlflow.archive.reproduce import decode_outputs

    if env_manager not in ENV_MANAGERS:
        raise RecordedEnvError(
            f"--env-manager must be one of {', '.join(ENV_MANAGERS)}, got {env_manager!r}."
        )
    local = Path(local_path).resolve()
    if not (local / "MLmodel").is_file():
        raise RecordedEnvError(
            f"Could not build the model's recorded environment: expected a model directory with "
            f"an MLmodel file at {local}, found none."
        )
    plan = check_requirements(local, env_manager, trust=trust_requirements)  # before installing
    root = Path(env_root_dir) if env_root_dir else None
    with tempfile.TemporaryDirectory(prefix="jaxexp-env-") as tmp:
        out = Path(tmp)
        python, installed, loader_from = _build(plan, local, out, root, capture_output)
        run = RecordedRun(env_manager, installed)
        run.details["loader"] = loader_from
        loader = _loader_dir(out / "loader")
        outputs, cwd = out / "outputs", out / "cwd"
        outputs.mkdir()
        cwd.mkdir()
        cmd = [str(python), "-I", str(RUNNER), str(local), str(outputs), str(loader)]
        try:
            proc = subprocess.run(
                cmd, cwd=cwd, env=_child_env(), capture_output=capture_output, text=True
            )
        except OSError as err:
            raise RecordedEnvError(f"The runner failed in the recorded environment: {err}") from err
        result = read_child_result(
            outputs, proc, who="The runner", where=" in the recorded environment"
        )
        run.details = {**result, **run.details}
        run.python = result.get("python")
        run.jax_version, run.jaxlib_version = (
            result.get("jax_version"),
            result.get("jaxlib_version"),
        )
        run.error, run.seconds = result.get("error"), result.get("seconds")
        if run.error is None:
            with np.load(outputs / "outputs.npz", allow_pickle=False) as data:
                raw = [data[f"out_{i}"] for i in range(len(result["output_dtypes"]))]
            run.outputs = decode_outputs(raw, result["output_dtypes"])
    return run
