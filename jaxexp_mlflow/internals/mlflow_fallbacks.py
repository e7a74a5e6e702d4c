"""The public-API pieces ``mlflow_private``'s fallbacks are built from: no private name here.

Installed versions and pins, pip requirement files parsed and deduplicated the way
MLflow does, and input examples made JSON-able. ``mlflow_private`` calls them where
the installed MLflow lacks the private function it would otherwise use.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def installed_version(package: str) -> str | None:
    """The installed version of a distribution (mlflow: its ``__version__``), or None."""
    import importlib.metadata

    if package == "mlflow":
        import mlflow

        return mlflow.__version__
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        try:
            return importlib.import_module(package.replace("-", "_")).__version__
        except (ImportError, AttributeError):
            return None


def strip_local(version: str) -> str:
    """``1.2.3+local`` -> ``1.2.3``: a pin without the local part (unparsable: as it is)."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).public
    except InvalidVersion:
        return version


def python_version() -> str:
    """The running Python as ``major.minor.micro``."""
    return ".".join(str(v) for v in sys.version_info[:3])


def is_mlflow_requirement(line: str) -> bool:
    """Whether a requirement line names MLflow (mlflow, mlflow-skinny, a git URL of it)."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        return Requirement(line).name.lower() in ("mlflow", "mlflow-skinny", "mlflow-tracing")
    except InvalidRequirement:
        spec = line.split(" -", 1)[0]
        try:
            return Requirement(spec).name.lower() == "mlflow"
        except InvalidRequirement:
            squashed = line.replace(" ", "").lower()
            return "/mlflow" in squashed or "mlflow@git" in squashed


def mlflow_pin() -> str:
    """``mlflow==<installed>`` (a dev build pins the release before it)."""
    import mlflow
    from packaging.version import Version

    version = Version(mlflow.__version__)
    if not version.is_devrelease:
        return f"mlflow=={mlflow.__version__}"
    return f"mlflow=={version.major}.{version.minor}.{version.micro - 1}"


def parse_lines(lines: list[str], base_dir: str, constraint: bool) -> list[tuple[str, bool]]:
    """pip requirement lines -> ``(requirement, is_constraint)``; ``-r``/``-c`` files read."""
    out: list[tuple[str, bool]] = []
    joined: list[str] = []
    pending = ""
    for raw in lines:
        line = raw.strip()
        line = line[: line.find(" #")].rstrip() if " #" in line else line
        if line.endswith("\\"):
            pending += line[:-1]
            continue
        joined.append(pending + line)
        pending = ""
    if pending:
        joined.append(pending)
    for line in joined:
        if not line or line.startswith("#"):
            continue
        flag, _, rest = line.partition(" ")
        if flag in ("-r", "--requirement", "-c", "--constraint"):
            path = os.path.join(base_dir, rest.strip())
            with open(path) as f:
                sub = f.read().splitlines()
            is_c = flag in ("-c", "--constraint")
            out += parse_lines(sub, os.path.dirname(path), is_c)
        else:
            out.append((line, constraint))
    return out


def parse_pip_requirements(reqs: Any) -> tuple[list[str], list[str]]:
    """A requirements file path or lines -> (requirements, constraints), as MLflow parses them."""
    if reqs is None:
        return [], []
    if isinstance(reqs, str):
        with open(reqs) as f:
            parsed = parse_lines(f.read().splitlines(), os.path.dirname(reqs), False)
    else:
        reqs = list(reqs)
        if not all(isinstance(r, str) for r in reqs):
            raise TypeError(
                "`pip_requirements` must be either a string path to a pip requirements file on "
                f"the local filesystem or an iterable of pip requirement strings, got {reqs!r}"
            )
        parsed = parse_lines(reqs, os.getcwd(), False)
    return [r for r, c in parsed if not c], [r for r, c in parsed if c]


def deduplicate(requirements: list[str]) -> list[str]:
    """One line per (package, marker): specifiers and extras merged, first position kept."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.specifiers import SpecifierSet

    merged: dict[Any, Any] = {}
    for line in requirements:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            merged.setdefault(line, line)
            continue
        key = (req.name, str(req.marker) if req.marker else "")
        old = merged.get(key)
        if old is not None:
            if old.specifier and req.specifier and old.specifier != req.specifier:
                req.specifier = SpecifierSet(f"{old.specifier},{req.specifier}")
            elif old.specifier and not req.specifier:
                req.specifier = old.specifier
            if old.extras:
                req.extras = set(old.extras) | set(req.extras)
        merged[key] = req
    return [str(r) for r in merged.values()]


def jsonable(arr: Any) -> Any:
    """An array as nested lists, NaN as None (MLflow's ``_handle_ndarray_input``)."""
    import numpy as np

    arr = np.asarray(arr)
    if np.issubdtype(arr.dtype, np.number):
        arr = np.where(np.isnan(arr), None, arr)
    return arr.tolist()
