"""What the published distribution declares: one version, its license, its tools kept out of it,
and a README that reads right as the index's long description."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import jaxexp_mlflow

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
HOME = "https://github.com/jaxexp-mlflow/jaxexp-mlflow"


def test_the_version_has_one_place():
    project = PYPROJECT["project"]
    assert "version" not in project and project["dynamic"] == ["version"]
    attr = PYPROJECT["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "jaxexp_mlflow.__version__"
    assert re.fullmatch(r"\d+\.\d+\.\d+", jaxexp_mlflow.__version__)
    # no other file of the package spells the version out
    spelled = [
        p.relative_to(REPO)
        for p in (REPO / "jaxexp_mlflow").rglob("*.py")
        if p.name != "__init__.py" and f'"{jaxexp_mlflow.__version__}"' in p.read_text()
    ]
    assert spelled == []


def test_license_typing_and_metadata_ship():
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "END OF TERMS AND CONDITIONS" in text
    assert (REPO / "jaxexp_mlflow" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["jaxexp_mlflow"]
    assert project["authors"] == [{"name": "jaxexp-mlflow developers"}]
    for version in ("3.11", "3.12", "3.13"):
        assert f"Programming Language :: Python :: {version}" in project["classifiers"]
    assert all(url.startswith(HOME) for url in project["urls"].values())


def test_development_tools_are_groups_not_extras():
    extras = PYPROJECT["project"]["optional-dependencies"]
    names = {re.split(r"[<>=\[ ]", req)[0] for reqs in extras.values() for req in reqs}
    assert not names & {"ruff", "uv", "build", "twine", "mkdocs-material", "mkdocstrings"}
    groups = PYPROJECT["dependency-groups"]
    flat = {
        re.split(r"[<>=\[ ]", req)[0]
        for reqs in groups.values()
        for req in reqs
        if isinstance(req, str)
    }
    assert {"ruff", "uv", "build", "twine", "mkdocs-material", "mkdocstrings"} <= flat
    assert {"include-group": "release"} in groups["test"]  # scripts/test.sh builds the wheel
    test_sh = (REPO / "scripts" / "test.sh").read_text()
    assert test_sh.count("--group test") == 2  # the main and newest stages


def test_readme_is_a_long_description():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    lines = readme.splitlines()
    assert lines[2].endswith("`bash scripts/demo.sh`") and lines[3].endswith(
        "`bash scripts/test.sh`"
    )
    assert 100 <= len(lines) <= 150
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", readme)  # no dates
    assert not re.search(r"\b[0-9a-f]{7,40}\b", readme.replace("m-...", ""))  # no commit ids
    links = re.findall(r"\]\(([^)]+)\)", readme)
    assert links and all(link.startswith("https://") for link in links), links
    for link in links:
        if link.startswith(HOME + "/blob/main/"):
            assert (REPO / link.removeprefix(HOME + "/blob/main/")).exists(), link
