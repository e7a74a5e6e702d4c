"""JAX's own archived modules as jaxexp blobs, and their ground truth on this machine.

JAX keeps modules serialized by older jax versions for its back-compatibility tests in
``jax/_src/internal_test_util/export_back_compat_test_data/`` (shipped in the jax wheel; older
wheels carry older modules). :func:`modules` reads them (JAX's own test data, executed as JAX's
tests do), :func:`blob` wraps one into an ``Exported`` exactly as JAX's harness
(``export_back_compat_test_util.CompatTestBase.run_serialized``) does and serializes it, and
:func:`ground_truth` runs blobs in a child process to see what the running jax really does.
``tests/data/backcompat_truth/jax-<version>.json`` caches that ground truth, one file per jax
release measured (regenerate with ``scripts/backcompat_truth.py`` under that jax).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
#: One ground-truth file per jax release measured: ``jax-<version>.json``.
TRUTH_DIR = REPO / "tests" / "data" / "backcompat_truth"
DATA_SUBDIR = "jax/_src/internal_test_util/export_back_compat_test_data"
#: Older jax wheels whose test data adds modules the installed one dropped (pure-Python wheels,
#: a few MB each; see scripts/backcompat_truth.py --fetch).
OLDER_WHEELS = ("0.6.2", "0.8.0")  # the first wheel shipping the data is 0.6.2
WHEEL_CACHE = Path(
    os.environ.get("JAXEXP_WHEEL_CACHE", Path.home() / ".cache" / "jaxexp-mlflow" / "jax-wheels")
)
_MAIN_ARG = re.compile(r"%arg\d+: tensor<([^>]*)>")


@dataclass(frozen=True)
class Module:
    """One archived module: where it comes from and JAX's CompatTestData fields."""

    source: str  # "jax-0.10.2"
    file: str  # "cpu_lu_lapack_getrf.py"
    entry: str  # "data_2024_05_31[f32]"
    data: dict

    @property
    def key(self) -> str:
        """Stable identity: file, entry and a digest of the module bytes."""
        digest = hashlib.sha256(self.data["mlir_module_serialized"]).hexdigest()[:10]
        return f"{self.file}:{self.entry}#{digest}"

    @property
    def platform(self) -> str:
        return str(self.data["platform"])


def installed_data_dir() -> Path:
    """The test-data directory of the installed jax wheel."""
    import jax

    return Path(jax.__file__).parent.parent / DATA_SUBDIR


def wheel_data_dir(version: str, cache: Path = WHEEL_CACHE) -> Path | None:
    """The test-data directory extracted from a cached jax wheel (None if not fetched)."""
    out = cache / f"jax-{version}"
    if (out / DATA_SUBDIR).is_dir():
        return out / DATA_SUBDIR
    wheels = sorted(cache.glob(f"jax-{version}-*.whl"))
    if not wheels:
        return None
    with zipfile.ZipFile(wheels[0]) as zf:
        for name in zf.namelist():
            if name.startswith(DATA_SUBDIR) and name.endswith(".py"):
                zf.extract(name, out)
    return out / DATA_SUBDIR


def fetch_wheels(versions: tuple[str, ...] = OLDER_WHEELS, cache: Path = WHEEL_CACHE) -> None:
    """``pip download`` the older jax wheels (no dependencies) into ``cache``."""
    cache.mkdir(parents=True, exist_ok=True)
    for v in versions:
        if not list(cache.glob(f"jax-{v}-*.whl")):
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(cache)]
                + [f"jax=={v}"],
                check=True,
                timeout=300,
            )


def _entries(nest: Any, name: str) -> Iterator[tuple[str, dict]]:
    if isinstance(nest, dict) and "testdata_version" in nest:
        yield name, nest
    elif isinstance(nest, dict):
        for k, v in nest.items():
            yield from _entries(v, f"{name}[{k}]")
    elif isinstance(nest, list):
        for i, v in enumerate(nest):
            yield from _entries(v, f"{name}[{i}]")


def modules_in(data_dir: Path, source: str) -> list[Module]:
    """Every ``data_*`` module of one test-data directory (JAX's files, run as its tests do)."""
    found = []
    for path in sorted(data_dir.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        namespace: dict[str, Any] = {"__name__": f"backcompat_{path.stem}"}
        exec(compile(path.read_text(), str(path), "exec"), namespace)  # noqa: S102 (JAX's data)
        rel = str(path.relative_to(data_dir))
        for var, value in namespace.items():
            if var.startswith("data_"):
                for entry, data in _entries(value, var):
                    found.append(Module(source, rel, entry, data))
    return found


def modules(include_older: bool = True) -> list[Module]:
    """Modules of the installed wheel, then those only older cached wheels have (deduplicated)."""
    import jax

    found = modules_in(installed_data_dir(), f"jax-{jax.__version__}")
    if include_older:
        for v in OLDER_WHEELS:
            d = wheel_data_dir(v)
            if d is not None:
                found += modules_in(d, f"jax-{v}")
    unique: dict[str, Module] = {}
    for m in found:
        unique.setdefault(m.key, m)
    return list(unique.values())


def _arg_specs(data: dict) -> list[str] | None:
    """Shape specs for symbolic dimensions (``?`` in ``main``'s arguments), else None."""
    text = data["mlir_module_text"]
    start = text.find("func.func public @main(")
    if start < 0:
        return None
    line = text[start : text.find("\n", start)]
    shapes = _MAIN_ARG.findall(line.split(") -> ")[0])
    if "?" not in "".join(shapes) or len(shapes) != len(data["inputs"]):
        return None
    specs = []
    for i, shape in enumerate(shapes):
        dims = shape.split("x")[:-1]  # the last part is the element type
        specs.append(", ".join(f"d{i}_{j}" if d == "?" else d for j, d in enumerate(dims)))
    return specs


def exported_of(data: dict) -> Any:
    """An ``Exported`` around the module, built as JAX's ``run_serialized`` harness does."""
    import jax
    from jax import export, tree_util

    from jaxexp_mlflow.internals import jax_private

    inputs = tuple(np.asarray(x) for x in data["inputs"])
    specs = _arg_specs(data)
    args_specs = export.symbolic_args_specs(inputs, specs) if specs else inputs

    def aval(a: Any) -> Any:
        return jax.core.ShapedArray(a.shape, a.dtype)

    in_avals, in_tree = tree_util.tree_flatten((tree_util.tree_map(aval, args_specs), {}))
    out_avals, out_tree = tree_util.tree_flatten(
        tree_util.tree_map(aval, tuple(np.asarray(x) for x in data["expected_outputs"]))
    )
    fields: dict[str, Any] = dict(
        fun_name="run_serialized",
        in_tree=in_tree,
        in_avals=tuple(in_avals),
        out_tree=out_tree,
        out_avals=tuple(out_avals),
        in_shardings_hlo=(None,) * len(in_avals),
        out_shardings_hlo=(None,) * len(out_avals),
        platforms=(data["platform"],),
        ordered_effects=(),
        unordered_effects=(),
        disabled_safety_checks=(),
        mlir_module_serialized=data["mlir_module_serialized"],
        calling_convention_version=data["xla_call_module_version"],
        nr_devices=data.get("nr_devices", 1),
        module_kept_var_idx=tuple(range(len(in_avals))),
        uses_global_constants=any(
            not all(jax_private.is_constant_dim(d) for d in a.shape) for a in in_avals
        ),
        _get_vjp=None,
    )
    return jax_private.make_exported(**fields)


def blob(module: Module) -> bytes:
    """The module as a serialized ``Exported`` (what a bare jaxexp blob holds)."""
    return exported_of(module.data).serialize()


_CHILD = r"""
import json, sys
import numpy as np
import jax
from jax import export
for line in sys.stdin:
    job = json.loads(line)
    data = np.load(job["npz"], allow_pickle=False)
    inputs = [data[f"in_{i}"] for i in range(job["n_in"])]
    want = [data[f"out_{i}"] for i in range(job["n_out"])]
    out = {"key": job["key"]}
    try:
        exp = export.deserialize(bytearray(open(job["blob"], "rb").read()))
        got = jax.tree.leaves(jax.block_until_ready(jax.jit(exp.call)(*inputs)))
        out["truth"] = "runs"
        out["matches"] = len(got) == len(want) and all(
            np.asarray(g).shape == w.shape and np.allclose(np.asarray(g), w, rtol=1e-3, atol=1e-3,
                                                          equal_nan=True)
            for g, w in zip(got, want))
    except Exception as e:
        out["truth"] = "fails"
        out["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
    print(json.dumps(out), flush=True)
"""


def ground_truth(mods: list[Module], workdir: Path) -> dict[str, dict[str, Any]]:
    """Run each module's blob in a child process: ``{key: {"truth": "runs"|"fails", ...}}``.

    One child runs many modules; if one crashes the child, it is recorded as failing
    (``crash``) and a new child continues with the next.
    """
    jobs = []
    for i, m in enumerate(mods):
        bpath, npz = workdir / f"m{i}.bin", workdir / f"m{i}.npz"
        try:
            bpath.write_bytes(blob(m))
        except Exception as e:  # noqa: BLE001 - jax cannot even wrap it: recorded as failing
            jobs.append({"key": m.key, "error": f"serialize: {type(e).__name__}: {e}"})
            continue
        arrays = {f"in_{j}": np.asarray(x) for j, x in enumerate(m.data["inputs"])}
        arrays |= {f"out_{j}": np.asarray(x) for j, x in enumerate(m.data["expected_outputs"])}
        np.savez(npz, **arrays)
        n_in, n_out = len(m.data["inputs"]), len(m.data["expected_outputs"])
        jobs.append({"key": m.key, "blob": str(bpath), "npz": str(npz), "n_in": n_in})
        jobs[-1]["n_out"] = n_out
    results: dict[str, dict[str, Any]] = {}
    for job in jobs:
        if "error" in job:
            results[job["key"]] = {"truth": "fails", "error": job["error"]}
    todo = [j for j in jobs if "error" not in j]
    # x64 on, as JAX's own back-compat tests run (half the modules take float64/complex128)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_ENABLE_X64": "1"}
    env.pop("XLA_FLAGS", None)  # one device, as the verdict under test sees
    while todo:
        payload = "".join(json.dumps(j) + "\n" for j in todo)
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD],
            input=payload,
            capture_output=True,
            text=True,
            env=env,
            timeout=1800,
        )
        for line in proc.stdout.splitlines():
            row = json.loads(line)
            results[row.pop("key")] = row
        todo = [j for j in todo if j["key"] not in results]
        if todo:  # the child died on todo[0]
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
            results[todo[0]["key"]] = {"truth": "fails", "error": f"crash: {tail}"}
            todo = todo[1:]
    return results


def truth_file(jax_version: str | None = None) -> Path:
    """Where the ground truth of ``jax_version`` (default: the installed jax) is kept."""
    if jax_version is None:
        import jax

        jax_version = jax.__version__
    return TRUTH_DIR / f"jax-{jax_version}.json"


def load_truth(jax_version: str | None = None) -> dict[str, Any] | None:
    """The checked-in ground truth of ``jax_version`` (default: the installed jax), or None."""
    path = truth_file(jax_version)
    return json.loads(path.read_text()) if path.is_file() else None


def multi_mesh_blob() -> bytes:
    """JAX's archived ``export_with_multiple_meshes`` blob (skips where the wheel lacks it)."""
    import pytest

    try:
        from jax._src.internal_test_util.export_back_compat_test_data import (
            export_with_multiple_meshes as archive,
        )
    except ImportError:
        pytest.skip("this jax wheel has no export_with_multiple_meshes test data")
    return bytes(archive.serializations[-1]["exported_serialized"])
