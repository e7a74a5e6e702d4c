"""The requirement list of a model's recorded environment, written from what MLmodel records.

``jaxexp verify --env-manager`` rebuilds the environment a model was logged with. It does not
install the model's ``requirements.txt``: it writes the list itself from the versions MLmodel
records (a model directory is untrusted input, and a requirements file, a ``uv.toml`` or a build
backend it names would otherwise run code of the model's choosing):

* Python: ``flavors.python_function.python_version``;
* ``jax``, ``jaxlib``: the ``jaxexp`` section's ``jax_version`` / ``jaxlib_version``;
* ``orbax-checkpoint``: ``params_format.orbax_version``; ``mlflow``: ``mlflow_version``;
* ``jaxexp-mlflow>=jaxexp_mlflow_version`` (the loader rule of ``get_default_pip_requirements``:
  a fix reaches every archived model);
* ``numpy`` and ``flatbuffers`` (MLmodel does not record them), and any of the above MLmodel
  lacks: a ``name==version`` pin of exactly that name in the model's requirements, else the
  name unpinned.

Every version must be a plain release number (``0.10.2``, ``2.0.0rc1``); anything else is
refused (:attr:`EnvFacts.problems`), never passed to an installer. What the model's requirements
add beyond these names is :attr:`EnvFacts.added`: shown, and installed only when the user trusts
the model. This module reads nothing but MLmodel (through the bounded reader) and the requirement
lines handed to it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: A release number as the index spells it: digits and dots, an optional pre/post/dev part.
_RELEASE = re.compile(r"\d{1,6}(\.\d{1,6}){0,3}((a|b|rc)\d{1,6})?(\.post\d{1,6})?(\.dev\d{1,6})?")
_PYTHON = re.compile(r"3\.\d{1,3}(\.\d{1,3})?")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
#: The packages of the environment, in install order; their versions come from MLmodel (or a
#: ``name==version`` pin of the model's requirements for those it does not record).
PACKAGES = ("jax", "jaxlib", "numpy", "flatbuffers", "orbax-checkpoint", "mlflow")
LOADER = "jaxexp-mlflow"
#: python_env.yaml's build dependencies: the environment's own tooling, not added packages.
_BUILD_TOOLS = ("pip", "setuptools", "wheel")


def canonical(name: str) -> str:
    """PEP 503 name: ``Orbax_Checkpoint`` -> ``orbax-checkpoint``."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class EnvFacts:
    """What the recorded environment installs, and where each version came from."""

    python: str | None = None
    pins: list[str] = field(default_factory=list)
    loader: str | None = None
    sources: dict[str, str] = field(default_factory=dict)
    added: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def requirements(self, *, with_loader: bool = True) -> list[str]:
        """The pins to install (``jaxexp-mlflow>=V`` last, unless ``with_loader`` is false)."""
        return [*self.pins, *([self.loader] if with_loader and self.loader else [])]


def _get(mapping: Any, *keys: str) -> Any:
    for key in keys:
        mapping = mapping.get(key) if isinstance(mapping, dict) else None
    return mapping


def _model_pins(lines: list[str]) -> dict[str, str]:
    """``{canonical name: version}`` of the model's plain ``name==version`` lines (comments and
    markers make a line not plain; such a line is not used for a version)."""
    pins: dict[str, str] = {}
    for line in lines:
        name, sep, version = line.strip().partition("==")
        name, version = name.strip(), version.strip()
        if sep and _NAME.fullmatch(name) and _RELEASE.fullmatch(version):
            pins.setdefault(canonical(name), version)
    return pins


def _requirement_name(line: str) -> str | None:
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        return canonical(Requirement(line).name)
    except InvalidRequirement:
        return None


def recorded_facts(local_path: str | Path, model_lines: list[str]) -> EnvFacts:
    """The recorded environment of the model at ``local_path``: MLmodel's versions, completed
    by plain pins from ``model_lines`` (its requirement lines, as ``recorded_env.install_plan``
    reads them); every other line of ``model_lines`` is listed in ``added``."""
    from jaxexp_mlflow.codec.mlmodel import read_mlmodel

    mlmodel = read_mlmodel(local_path)
    section = _get(mlmodel, "flavors", "jaxexp")
    facts = EnvFacts()
    recorded = {
        "jax": ("flavors.jaxexp.jax_version", _get(section, "jax_version")),
        "jaxlib": ("flavors.jaxexp.jaxlib_version", _get(section, "jaxlib_version")),
        "orbax-checkpoint": (
            "flavors.jaxexp.params_format.orbax_version",
            _get(section, "params_format", "orbax_version"),
        ),
        "mlflow": ("mlflow_version", _get(mlmodel, "mlflow_version")),
    }
    model_pins = _model_pins(model_lines)

    def checked(where: str, value: Any, pattern: re.Pattern) -> str | None:
        if value is None:
            return None
        text = str(value)
        if isinstance(value, bool) or not pattern.fullmatch(text):
            facts.problems.append(
                f"MLmodel {where}: `{text[:80]}` (expected a release number such as 0.10.2; "
                "anything else would be handed to the installer as written)"
            )
            return None
        return text

    python = _get(mlmodel, "flavors", "python_function", "python_version")
    facts.python = checked("flavors.python_function.python_version", python, _PYTHON)
    if facts.python:
        facts.sources["python"] = "MLmodel"
    for name in PACKAGES:
        where, value = recorded.get(name, (None, None))
        version = checked(where, value, _RELEASE) if where else None
        source = "MLmodel" if version else None
        if version is None and name in model_pins:
            version, source = model_pins[name], "requirements.txt pin"
        facts.pins.append(f"{name}=={version}" if version else name)
        facts.sources[name] = source or "unpinned (not recorded)"
    loader_version = checked(
        "flavors.jaxexp.jaxexp_mlflow_version", _get(section, "jaxexp_mlflow_version"), _RELEASE
    )
    facts.loader = f"{LOADER}>={loader_version}" if loader_version else LOADER
    known = {*PACKAGES, LOADER, *_BUILD_TOOLS}
    for line in model_lines:
        name = _requirement_name(line)
        if name not in known:
            facts.added.append(line)
    return facts
