"""The package's old module paths, kept importable as deprecated aliases.

Modules moved to the rooms named by the data path (issue 40): ``import jaxexp_mlflow.spark``
still works, warns with :class:`DeprecationWarning` and gives the module at its new path (the
same object, so its attributes and ``sys.modules`` agree). Installed by the package's
``__init__``; nothing is imported until an old path is asked for.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import traceback
import warnings
from types import ModuleType

#: old dotted path -> new dotted path
MOVED = {
    "jaxexp_mlflow.artifact": "jaxexp_mlflow.store.artifact",
    "jaxexp_mlflow.flavors.section": "jaxexp_mlflow.store.section",
    "jaxexp_mlflow.flavors.atomic": "jaxexp_mlflow.store.atomic",
    "jaxexp_mlflow.transfer": "jaxexp_mlflow.store.transfer",
    "jaxexp_mlflow.pytrees": "jaxexp_mlflow.codec.pytrees",
    "jaxexp_mlflow.probes": "jaxexp_mlflow.runtime.probes",
    "jaxexp_mlflow.flavors.pyfunc": "jaxexp_mlflow.serving.pyfunc",
    "jaxexp_mlflow.flavors.inputs": "jaxexp_mlflow.serving.inputs",
    "jaxexp_mlflow.flavors.signature": "jaxexp_mlflow.serving.signature",
    "jaxexp_mlflow.flavors.classifier": "jaxexp_mlflow.serving.classifier",
    "jaxexp_mlflow.flavors.server": "jaxexp_mlflow.serving.server",
    "jaxexp_mlflow.flavors.serving_guard": "jaxexp_mlflow.serving.serving_guard",
    "jaxexp_mlflow.spark": "jaxexp_mlflow.serving.spark",
    "jaxexp_mlflow.mlserver_runtime": "jaxexp_mlflow.serving.mlserver_runtime",
    "jaxexp_mlflow.jax_envs": "jaxexp_mlflow.archive.jax_envs",
    "jaxexp_mlflow.env_routes": "jaxexp_mlflow.archive.env_routes",
    "jaxexp_mlflow._env_runner": "jaxexp_mlflow.archive._env_runner",
    "jaxexp_mlflow.recorded_env": "jaxexp_mlflow.archive.recorded_env",
    "jaxexp_mlflow.reexport": "jaxexp_mlflow.flavors.refresh",
    "jaxexp_mlflow.reproduce": "jaxexp_mlflow.archive.reproduce",
    "jaxexp_mlflow.env_facts": "jaxexp_mlflow.archive.env_facts",
    "jaxexp_mlflow.env_build": "jaxexp_mlflow.archive.env_build",
}


_IMPORTLIB = os.path.dirname(importlib.__file__)


def _stacklevel() -> int:
    """The warning's stacklevel: the first frame outside this module and the import system, so
    that the warning names the line that imported the old path (and is shown there)."""
    level = 1  # create_module, which warns
    for frame in traceback.extract_stack()[-3::-1]:  # its callers, innermost first
        name = frame.filename
        if "importlib" in name and "_bootstrap" in name:
            continue  # frames ``warnings`` skips when it counts the levels
        level += 1
        if name != __file__ and not name.startswith(_IMPORTLIB):
            return level
    return 2


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads the module at its new path in its place."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        """A spec for an old path; None for every other name."""
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        """The module at the new path (imported if need be), after the warning."""
        new = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}: import it from there; the old path will go in a "
            "future release",
            DeprecationWarning,
            stacklevel=_stacklevel(),
        )
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module was imported at its new path."""


_FINDER = _Alias()


def install() -> None:
    """Put the alias finder first on ``sys.meta_path`` (once): an old path is never looked for
    elsewhere (an editable install of another checkout could otherwise answer it)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
