"""Regenerate ``jaxexp_mlflow/data/kernel_abi.json`` from the history of JAX's back-compat data.

JAX keeps, for every custom-call kernel it promises to keep stable, modules serialized on a given
date (``data_YYYY_MM_DD`` in ``jax/_src/internal_test_util/export_back_compat_test_data/*.py``);
a new ``data_`` entry is added when the kernel changes, and an old one is dropped when JAX stops
running it. Walking the jax releases, this script records, per kernel (custom-call target), each
calling signature JAX has tested (operand count, result count, the date the module was written,
the jax releases that shipped it) and, per release, which signatures that release still runs. It
also records, per release, the calling-convention range JAX states and whether its deserializer
or ``Exported.call`` enforces that range.

The compatibility verdict (``jaxexp_mlflow.runtime.compat``) refuses a module whose kernel call
has a signature the running jax no longer tests while a newer one exists (it fails at execution
with "Wrong number of arguments"), and uses the calling-convention facts to warn rather than
refuse where JAX still runs an older convention. The files are read as Python *syntax* (``ast``),
never executed.

Two sources give "file F at release V"; everything else is shared:

* a jax git clone (``--jax-repo``): ``git show jax-vV:F`` for every release tag >= 0.4.30;
* jax wheels (``--from-wheels [DIR]``): the file out of the ``jax==V`` wheel, fetched with
  ``pip download --no-deps`` into DIR (default ``$JAXEXP_WHEEL_CACHE`` or
  ``~/.cache/jaxexp-mlflow/jax-wheels``, the cache ``tests/backcompat.py`` uses). The releases
  are those ``pip index versions jax`` lists (no pre-releases) plus the existing table's, from
  0.4.30 on. Wheels ship the test data only from 0.6.2 on, so this mode *merges*: it re-reads
  every release from 0.6.2 on from its wheel and keeps the existing table's facts for older
  releases (and for a release whose wheel pip no longer serves). No clone needed.

    git clone https://github.com/jax-ml/jax /tmp/jax
    python scripts/update_kernel_abi.py --jax-repo /tmp/jax           # rewrite the table
    python scripts/update_kernel_abi.py --jax-repo /tmp/jax --check   # exit 1 if it is stale
    python scripts/update_kernel_abi.py --from-wheels                 # same, from jax wheels
    python scripts/update_kernel_abi.py --from-wheels --check
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any, Protocol

DATA_DIR = "jax/_src/internal_test_util/export_back_compat_test_data"
EXPORT_PY = "jax/_src/export/_export.py"
SERIALIZATION_PY = "jax/_src/export/serialization.py"
OUT = Path(__file__).resolve().parents[1] / "jaxexp_mlflow" / "data" / "kernel_abi.json"
OLDEST = (0, 4, 30)
FIRST_WHEEL_WITH_DATA = (0, 6, 2)  # older jax wheels do not ship DATA_DIR
WHEEL_CACHE = Path(
    os.environ.get("JAXEXP_WHEEL_CACHE", Path.home() / ".cache" / "jaxexp-mlflow" / "jax-wheels")
)

# `%r:2 = stablehlo.custom_call @target(%a, %b)` (pretty form) and the generic form
# `%r = "stablehlo.custom_call"(%a) {..., call_target_name = "target", ...}`.
_PRETTY = re.compile(
    r"(?:%[\w#.]+(?::(\d+))?\s*=\s*)?(?:stablehlo|mhlo)\.custom_call\s+@([\w.$-]+)\(([^)]*)\)"
)
_GENERIC = re.compile(
    r"(?:%[\w#.]+(?::(\d+))?\s*=\s*)?\"(?:stablehlo|mhlo)\.custom_call\"\(([^)]*)\)"
    r"[^\n]*?call_target_name\s*=\s*\"([^\"]+)\""
)


def vkey(version: str) -> tuple[int, ...]:
    return tuple(map(int, version.split(".")))


def git(repo: Path, *args: str) -> str:
    """Output of a git command in ``repo``."""
    return subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True
    ).stdout


class Releases(Protocol):
    """Where the jax sources of each release come from."""

    description: str

    def versions(self) -> list[str]:
        """The releases to cover (>= OLDEST, no pre-releases), oldest first."""
        ...

    def readable(self, version: str) -> bool:
        """Whether :meth:`read` can give this release's files (else keep the old table's)."""
        ...

    def listdir(self, version: str, directory: str) -> list[str]:
        """Paths of the files under ``directory`` at ``version``."""
        ...

    def read(self, version: str, path: str) -> str:
        """The text of file ``path`` at release ``version``."""
        ...


class GitReleases:
    """Release tags of a jax git clone."""

    def __init__(self, repo: Path, oldest: tuple[int, ...] = OLDEST) -> None:
        self.repo, self.oldest = repo, oldest
        self.description = "jax-ml/jax git history of " + DATA_DIR

    def versions(self) -> list[str]:
        out = []
        for tag in git(self.repo, "tag", "--list", "jax-v*").split():
            m = re.fullmatch(r"jax-v(\d+(?:\.\d+)+)", tag)
            if m and vkey(m.group(1)) >= self.oldest:
                out.append(m.group(1))
        return sorted(out, key=vkey)

    def readable(self, version: str) -> bool:
        return True

    def listdir(self, version: str, directory: str) -> list[str]:
        return git(self.repo, "ls-tree", "-r", "--name-only", f"jax-v{version}", directory).split()

    def read(self, version: str, path: str) -> str:
        return git(self.repo, "show", f"jax-v{version}:{path}")


class WheelReleases:
    """jax wheels from PyPI (``pip download --no-deps``), cached in ``cache``."""

    def __init__(
        self, cache: Path, known: list[str] | None = None, oldest: tuple[int, ...] = OLDEST
    ) -> None:
        self.cache, self.known, self.oldest = cache, known or [], oldest
        self.description = (
            f"jax wheels (PyPI) of {DATA_DIR}; releases before "
            f"{'.'.join(map(str, FIRST_WHEEL_WITH_DATA))} from the previous table (jax git history)"
        )
        self._zips: dict[str, zipfile.ZipFile | None] = {}

    def versions(self) -> list[str]:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "index", "versions", "jax"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        m = re.search(r"^Available versions:\s*(.*)$", out, re.M)
        if not m:
            raise RuntimeError(f"unexpected `pip index versions jax` output:\n{out}")
        listed = {v.strip() for v in m.group(1).split(",")}
        found = {v for v in listed | set(self.known) if re.fullmatch(r"\d+(?:\.\d+)+", v)}
        return sorted((v for v in found if vkey(v) >= self.oldest), key=vkey)

    def _zip(self, version: str) -> zipfile.ZipFile | None:
        if version not in self._zips:
            self._zips[version] = None
            if vkey(version) >= FIRST_WHEEL_WITH_DATA:
                wheels = sorted(self.cache.glob(f"jax-{version}-*.whl"))
                if not wheels:
                    self.cache.mkdir(parents=True, exist_ok=True)
                    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps"]
                    subprocess.run([*cmd, "-d", str(self.cache), f"jax=={version}"], check=False)
                    wheels = sorted(self.cache.glob(f"jax-{version}-*.whl"))
                if wheels:
                    self._zips[version] = zipfile.ZipFile(wheels[0])
        return self._zips[version]

    def readable(self, version: str) -> bool:
        zf = self._zip(version)
        return zf is not None and any(n.startswith(DATA_DIR + "/") for n in zf.namelist())

    def listdir(self, version: str, directory: str) -> list[str]:
        zf = self._zip(version)
        return [n for n in zf.namelist() if n.startswith(directory + "/")] if zf else []

    def read(self, version: str, path: str) -> str:
        zf = self._zip(version)
        if zf is None:
            raise FileNotFoundError(f"no jax {version} wheel in {self.cache}")
        return zf.read(path).decode()


def signatures(mlir_text: str) -> dict[str, set[tuple[int, int]]]:
    """``{target: {(operands, results)}}`` of the custom calls in a module's MLIR text."""
    found: dict[str, set[tuple[int, int]]] = {}
    for line in mlir_text.splitlines():
        for m in _PRETTY.finditer(line):
            n_res = _results(line, m.start(), m.group(1))
            found.setdefault(m.group(2), set()).add((_count(m.group(3)), n_res))
        for m in _GENERIC.finditer(line):
            n_res = _results(line, m.start(), m.group(1))
            found.setdefault(m.group(3), set()).add((_count(m.group(2)), n_res))
    return found


def _count(operands: str) -> int:
    return len(re.findall(r"%[\w#.]+", operands))


def _results(line: str, start: int, multi: str | None) -> int:
    if multi:
        return int(multi)
    return 1 if "=" in line[start : line.find("custom_call", start)] else 0


def _literal(node: ast.AST) -> Any:
    """The value of a literal node, ``datetime.date(y, m, d)`` as a date, else ``None``."""
    if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "date":
        return dt.date(*(int(ast.literal_eval(a)) for a in node.args))
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def entries_of(source: str) -> dict[str, dict[str, Any]]:
    """``{"data_YYYY_MM_DD[key]": facts}`` of one test-data file, read as syntax only."""
    out: dict[str, dict[str, Any]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target, value = node.targets[0], node.value
        if isinstance(target, ast.Name):
            name = target.id
        elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
            name = f"{target.value.id}[{_literal(target.slice)!s}]"
        else:
            continue
        if not name.startswith("data_"):
            continue
        if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "dict":
            fields = {k.arg: k.value for k in value.keywords if k.arg}
        elif isinstance(value, ast.Dict):
            fields = {_literal(k): v for k, v in zip(value.keys, value.values, strict=True) if k}
        else:
            continue
        if "mlir_module_text" not in fields:
            continue
        date = _literal(fields.get("serialized_date"))
        out[name] = {
            "platform": _literal(fields.get("platform")),
            "date": date.isoformat() if isinstance(date, dt.date) else None,
            "calling_convention": _literal(fields.get("xla_call_module_version")),
            "signatures": signatures(_literal(fields["mlir_module_text"]) or ""),
        }
    return out


def calling_convention_facts(source: Releases, version: str) -> dict[str, Any]:
    """Stated range, and whether deserialization/``Exported.call`` checks it, at ``version``."""
    export_src = source.read(version, EXPORT_PY)
    ser_src = source.read(version, SERIALIZATION_PY)
    lo = re.search(r"^minimum_supported_calling_convention_version\s*=\s*(\d+)", export_src, re.M)
    hi = re.search(r"^maximum_supported_calling_convention_version\s*=\s*(\d+)", export_src, re.M)
    read_path = _function(ser_src, "_deserialize_exported") + _function(
        export_src, "_call_exported_lowering"
    )
    enforced = "minimum_supported_calling_convention_version" in read_path
    return {
        "min": int(lo.group(1)) if lo else None,
        "max": int(hi.group(1)) if hi else None,
        "enforced_on_read": enforced,
    }


def _function(source: str, name: str) -> str:
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(source, node) or ""
    return ""


def build_table(source: Releases, prior: dict[str, Any] | None = None) -> dict[str, Any]:
    """The table: per target its tested signatures, per release what it runs; and the changes.

    Releases ``source`` cannot read are taken from ``prior`` (the existing table), if it has them.
    """
    versions = source.versions()
    kept = [v for v in versions if not source.readable(v)]
    prior_releases = (prior or {}).get("releases", [])
    lost = [v for v in kept if v not in prior_releases]
    if lost:
        print(f"warning: no source for jax {lost}; left out of the table", file=sys.stderr)
    versions = [v for v in versions if v not in lost]
    kept = [v for v in kept if v not in lost]
    parsed: dict[str, dict[str, dict[str, Any]]] = {}  # sha256 of the file -> entries
    seen: dict[tuple[str, str], dict[str, Any]] = {}  # (file, entry) -> facts + releases
    conventions = {}
    for version in versions:
        if version in kept:
            conventions[version] = prior["calling_conventions"][version]  # type: ignore[index]
            continue
        conventions[version] = calling_convention_facts(source, version)
        for path in source.listdir(version, DATA_DIR):
            if not path.endswith(".py") or path.endswith("__init__.py"):
                continue
            text = source.read(version, path)
            digest = hashlib.sha256(text.encode()).hexdigest()
            if digest not in parsed:
                parsed[digest] = entries_of(text)
            rel = path[len(DATA_DIR) + 1 :]
            for name, facts in parsed[digest].items():
                row = seen.setdefault((rel, name), {**facts, "releases": []})
                row["releases"].append(version)
    rows = [
        ((row["date"] or "", rel, name), row, [f"{rel}:{name}"], row["releases"], row["signatures"])
        for (rel, name), row in seen.items()
    ]
    if kept:  # the prior table's signatures, as far as the kept releases ran them
        old = prior["releases"]  # type: ignore[index]
        for target, entries in prior["targets"].items():  # type: ignore[index]
            for e in entries:
                ran = [v for v in kept if _in_ranges(v, e["releases"], old)]
                if ran:
                    facts = {"date": e["written"], "platform": e["platform"]}
                    sigs = {target: {(e["operands"], e["results"])}}
                    rows.append(((e["written"] or "", "", ""), facts, e["modules"], ran, sigs))
    targets: dict[str, list[dict[str, Any]]] = {}
    for _, row, modules, releases, signatures_ in sorted(rows, key=lambda r: r[0]):
        for target, sigs in signatures_.items():
            for n_ops, n_res in sorted(sigs):
                entries = targets.setdefault(target, [])
                same = [r for r in entries if (r["operands"], r["results"]) == (n_ops, n_res)]
                if same:
                    entry = same[0]
                else:
                    entry = {
                        "operands": n_ops,
                        "results": n_res,
                        "written": row["date"],
                        "platform": row["platform"],
                        "modules": [],
                        "releases": [],
                    }
                    entries.append(entry)
                entry["written"] = min(filter(None, [entry["written"], row["date"]]), default=None)
                entry["modules"].extend(modules)
                entry["releases"] = sorted(
                    set(entry["releases"]) | set(releases), key=versions.index
                )
    for entries in targets.values():
        entries.sort(key=lambda r: (r["written"] or "", r["operands"], r["results"]))
        for r in entries:
            r["jax_from"], r["jax_until"] = r["releases"][0], r["releases"][-1]
            r["modules"] = sorted(set(r["modules"]))
            r["releases"] = _ranges(r["releases"], versions)
    changes = []
    for target, entries in sorted(targets.items()):
        for before, after in zip(entries, entries[1:], strict=False):
            what = []
            if before["operands"] != after["operands"]:
                what.append(f"operands {before['operands']} -> {after['operands']}")
            if before["results"] != after["results"]:
                what.append(f"results {before['results']} -> {after['results']}")
            changes.append(
                {
                    "target": target,
                    "written": after["written"],
                    "jax_from": after["jax_from"],
                    "what": ", ".join(what),
                    "old_last_tested_in": before["jax_until"],
                }
            )
    return {
        "source": source.description,
        "generated": dt.date.today().isoformat(),
        "releases": versions,
        "note": "per target: each (operands, results) signature JAX tested, the date its first "
        "module was written and the releases that shipped such a module; regenerate with "
        "scripts/update_kernel_abi.py",
        "calling_conventions": conventions,
        "targets": dict(sorted(targets.items())),
        "changes": changes,
    }


def _in_ranges(version: str, ranges: list[list[str]], versions: list[str]) -> bool:
    """Whether ``version`` falls in one of the ``[first, last]`` runs (order of ``versions``)."""
    i = versions.index(version)
    return any(versions.index(a) <= i <= versions.index(b) for a, b in ranges)


def _ranges(releases: list[str], versions: list[str]) -> list[list[str]]:
    """Consecutive runs of releases as ``[first, last]`` pairs (compact, order of ``versions``)."""
    idx = sorted(versions.index(r) for r in releases)
    runs: list[list[int]] = []
    for i in idx:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return [[versions[a], versions[b]] for a, b in runs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--jax-repo", type=Path, help="a git clone of jax-ml/jax")
    where.add_argument(
        "--from-wheels",
        type=Path,
        nargs="?",
        const=WHEEL_CACHE,
        metavar="DIR",
        help=f"read jax wheels cached in DIR (fetched with pip if absent; default {WHEEL_CACHE})",
    )
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--check", action="store_true", help="only report whether the table is stale")
    args = ap.parse_args(argv)
    old = json.loads(args.out.read_text()) if args.out.exists() else None
    source: Releases
    if args.jax_repo is not None:
        source = GitReleases(args.jax_repo)
    else:
        source = WheelReleases(args.from_wheels, (old or {}).get("releases"))
    if args.check:
        missing = sorted(set(source.versions()) - set((old or {}).get("releases", [])), key=vkey)
        print(f"{len(missing)} release(s) missing from {args.out}: {missing}")
        return 1 if missing else 0
    table = build_table(source, old if args.from_wheels is not None else None)
    args.out.write_text(json.dumps(table, indent=1) + "\n")
    print(
        f"wrote {len(table['targets'])} kernels, {len(table['changes'])} signature changes over "
        f"{len(table['releases'])} jax releases to {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
