"""Regenerate ``jaxexp_mlflow/data/kernel_abi.json`` from the history of JAX's back-compat data.

JAX keeps, for every custom-call kernel it promises to keep stable, modules serialized on a given
date (``data_YYYY_MM_DD`` in ``jax/_src/internal_test_util/export_back_compat_test_data/*.py``);
a new ``data_`` entry is added when the kernel changes, and an old one is dropped when JAX stops
running it. Walking the release tags of a jax git clone, this script records, per kernel
(custom-call target), each calling signature JAX has tested (operand count, result count, the
date the module was written, the jax releases that shipped it) and, per release, which
signatures that release still runs. It also records, per release, the calling-convention range
JAX states and whether its deserializer or ``Exported.call`` enforces that range.

The compatibility verdict (``jaxexp_mlflow.runtime.compat``) refuses a module whose kernel call
has a signature the running jax no longer tests while a newer one exists (it fails at execution
with "Wrong number of arguments"), and uses the calling-convention facts to warn rather than
refuse where JAX still runs an older convention. The files are read as Python *syntax* (``ast``),
never executed.

    git clone https://github.com/jax-ml/jax /tmp/jax
    python scripts/update_kernel_abi.py --jax-repo /tmp/jax           # rewrite the table
    python scripts/update_kernel_abi.py --jax-repo /tmp/jax --check   # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

DATA_DIR = "jax/_src/internal_test_util/export_back_compat_test_data"
EXPORT_PY = "jax/_src/export/_export.py"
SERIALIZATION_PY = "jax/_src/export/serialization.py"
OUT = Path(__file__).resolve().parents[1] / "jaxexp_mlflow" / "data" / "kernel_abi.json"
OLDEST = (0, 4, 30)

# `%r:2 = stablehlo.custom_call @target(%a, %b)` (pretty form) and the generic form
# `%r = "stablehlo.custom_call"(%a) {..., call_target_name = "target", ...}`.
_PRETTY = re.compile(
    r"(?:%[\w#.]+(?::(\d+))?\s*=\s*)?(?:stablehlo|mhlo)\.custom_call\s+@([\w.$-]+)\(([^)]*)\)"
)
_GENERIC = re.compile(
    r"(?:%[\w#.]+(?::(\d+))?\s*=\s*)?\"(?:stablehlo|mhlo)\.custom_call\"\(([^)]*)\)"
    r"[^\n]*?call_target_name\s*=\s*\"([^\"]+)\""
)


def git(repo: Path, *args: str) -> str:
    """Output of a git command in ``repo``."""
    return subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True
    ).stdout


def release_tags(repo: Path, oldest: tuple[int, ...] = OLDEST) -> list[tuple[str, str]]:
    """``[(version, tag)]`` of jax releases (``jax-vX.Y.Z``, no release candidates), oldest
    first."""
    out = []
    for tag in git(repo, "tag", "--list", "jax-v*").split():
        m = re.fullmatch(r"jax-v(\d+(?:\.\d+)+)", tag)
        if m and tuple(map(int, m.group(1).split("."))) >= oldest:
            out.append((m.group(1), tag))
    return sorted(out, key=lambda vt: tuple(map(int, vt[0].split("."))))


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


def calling_convention_facts(repo: Path, tag: str) -> dict[str, Any]:
    """Stated range, and whether deserialization/``Exported.call`` checks it, at ``tag``."""
    export_src = git(repo, "show", f"{tag}:{EXPORT_PY}")
    ser_src = git(repo, "show", f"{tag}:{SERIALIZATION_PY}")
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


def build_table(repo: Path, oldest: tuple[int, ...] = OLDEST) -> dict[str, Any]:
    """The table: per target its tested signatures, per release what it runs; and the changes."""
    tags = release_tags(repo, oldest)
    parsed: dict[str, dict[str, dict[str, Any]]] = {}  # git blob sha -> entries
    seen: dict[tuple[str, str], dict[str, Any]] = {}  # (file, entry) -> facts + releases
    conventions = {}
    for version, tag in tags:
        conventions[version] = calling_convention_facts(repo, tag)
        for line in git(repo, "ls-tree", "-r", tag, DATA_DIR).splitlines():
            meta, path = line.split("\t", 1)
            sha = meta.split()[2]
            if not path.endswith(".py") or path.endswith("__init__.py"):
                continue
            if sha not in parsed:
                parsed[sha] = entries_of(git(repo, "cat-file", "blob", sha))
            rel = path[len(DATA_DIR) + 1 :]
            for name, facts in parsed[sha].items():
                row = seen.setdefault((rel, name), {**facts, "releases": []})
                row["releases"].append(version)
    versions = [v for v, _ in tags]
    targets: dict[str, list[dict[str, Any]]] = {}
    for (rel, name), row in sorted(seen.items(), key=lambda kv: (kv[1]["date"] or "", kv[0])):
        for target, sigs in row["signatures"].items():
            for n_ops, n_res in sorted(sigs):
                rows = targets.setdefault(target, [])
                same = [r for r in rows if (r["operands"], r["results"]) == (n_ops, n_res)]
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
                    rows.append(entry)
                entry["written"] = min(filter(None, [entry["written"], row["date"]]), default=None)
                entry["modules"].append(f"{rel}:{name}")
                entry["releases"] = sorted(
                    set(entry["releases"]) | set(row["releases"]), key=versions.index
                )
    for rows in targets.values():
        rows.sort(key=lambda r: (r["written"] or "", r["operands"], r["results"]))
        for r in rows:
            r["jax_from"], r["jax_until"] = r["releases"][0], r["releases"][-1]
            r["modules"] = sorted(set(r["modules"]))
            r["releases"] = _ranges(r["releases"], versions)
    changes = []
    for target, rows in sorted(targets.items()):
        for before, after in zip(rows, rows[1:], strict=False):
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
        "source": "jax-ml/jax git history of " + DATA_DIR,
        "generated": dt.date.today().isoformat(),
        "releases": versions,
        "note": "per target: each (operands, results) signature JAX tested, the date its first "
        "module was written and the releases that shipped such a module; regenerate with "
        "scripts/update_kernel_abi.py",
        "calling_conventions": conventions,
        "targets": dict(sorted(targets.items())),
        "changes": changes,
    }


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
    ap.add_argument("--jax-repo", type=Path, required=True, help="a git clone of jax-ml/jax")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--check", action="store_true", help="only report whether the table is stale")
    args = ap.parse_args(argv)
    table = build_table(args.jax_repo)
    if args.check:
        old = json.loads(args.out.read_text()) if args.out.exists() else {"releases": []}
        missing = sorted(set(table["releases"]) - set(old["releases"]))
        print(f"{len(missing)} release(s) missing from {args.out}: {missing}")
        return 1 if missing else 0
    args.out.write_text(json.dumps(table, indent=1) + "\n")
    print(
        f"wrote {len(table['targets'])} kernels, {len(table['changes'])} signature changes over "
        f"{len(table['releases'])} jax releases to {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
