"""Regenerate ``jaxexp_mlflow/data/vhlo_ops.json`` from a checkout of openxla/stablehlo.

A StableHLO portable artifact is VHLO bytecode, and every VHLO op name carries its version
(``custom_call_v1``, ``custom_call_v2``). ``stablehlo/dialect/VhloOps.td`` declares each op with
the range of StableHLO versions it exists in::

    def VHLO_CustomCallOpV2 : VHLO_Op<"custom_call_v2", "1.18.0", "current"> {

A jaxlib whose StableHLO is older than an op's first version cannot read a module using it
(``unregistered operation 'vhlo.custom_call_v2'``): the verdict's ``stablehlo`` check
(``jaxexp_mlflow/runtime/stablehlo_ops.py``) looks the module's op names up in this table.

The .td file (and ``Version.h``, for the checkout's own version) is read as text: nothing is
built or run, not even git (the commit is read from ``.git/HEAD``). ``--stablehlo-repo`` is a
work tree (``git clone https://github.com/openxla/stablehlo``).

    python scripts/update_vhlo_ops.py --stablehlo-repo ~/src/stablehlo           # rewrite
    python scripts/update_vhlo_ops.py --stablehlo-repo ~/src/stablehlo --check   # exit 1 if stale
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "jaxexp_mlflow" / "data" / "vhlo_ops.json"
OPS_TD = "stablehlo/dialect/VhloOps.td"
VERSION_H = "stablehlo/dialect/Version.h"
MAX_FILE_BYTES = 4 << 20

_VERSION = r"\d+\.\d+\.\d+"
#: ``def <Name> : VHLO_Op<"<mnemonic>", "<min>", "<max>"`` (traits may follow on the next lines)
_OP_DEF = re.compile(
    r"\bdef\s+(\w+)\s*:\s*VHLO_Op\s*<\s*"
    rf'"([a-z][a-z0-9_.-]*)"\s*,\s*"({_VERSION})"\s*,\s*"(current|{_VERSION})"'
)
_ANY_OP_DEF = re.compile(r"\bdef\s+\w+\s*:\s*VHLO_Op\s*<")
_CURRENT = re.compile(r"getCurrentVersion\(\)\s*\{\s*return\s+Version\((\d+),\s*(\d+),\s*(\d+)\)")


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", text)


def parse_ops(td_text: str) -> dict[str, tuple[str, str]]:
    """``{mnemonic: (first version, last version or "current")}`` of every VHLO op in
    ``VhloOps.td``. Raises ValueError if an op definition does not have the expected form
    (a changed .td layout must be looked at, not skipped)."""
    text = _strip_comments(td_text)
    ops: dict[str, tuple[str, str]] = {}
    for m in _OP_DEF.finditer(text):
        _, name, first, last = m.groups()
        if name in ops:
            raise ValueError(f"VHLO op {name!r} is defined twice")
        ops[name] = (first, last)
    declared = len(_ANY_OP_DEF.findall(text))
    if declared != len(ops) or not ops:
        raise ValueError(
            f"{declared} VHLO_Op definitions in the file but {len(ops)} parsed: the .td layout "
            "changed; update the pattern in scripts/update_vhlo_ops.py"
        )
    return ops


def parse_current_version(version_h: str) -> str | None:
    """``Version::getCurrentVersion()`` of ``Version.h`` (the checkout's StableHLO version)."""
    m = _CURRENT.search(version_h)
    return ".".join(m.groups()) if m else None


def _read_text(path: Path) -> str:
    if path.stat().st_size > MAX_FILE_BYTES:
        raise ValueError(f"{path}: larger than {MAX_FILE_BYTES} bytes")
    return path.read_text("utf-8")


def head_commit(repo: Path) -> str | None:
    """The commit checked out in ``repo``, read from ``.git/HEAD`` (and the ref it names, loose
    or packed) as text, without running git; None if it cannot be told."""
    git = repo / ".git"
    try:
        if git.is_file():  # a linked work tree or submodule: "gitdir: <path>"
            line = _read_text(git).strip()
            if not line.startswith("gitdir:"):
                return None
            git = (repo / line.split(":", 1)[1].strip()).resolve()
        head = _read_text(git / "HEAD").strip()
        if not head.startswith("ref:"):
            return head if re.fullmatch(r"[0-9a-f]{40}", head) else None
        ref = head.split(":", 1)[1].strip()
        for base in (git, git / "commondir"):
            loose = base / ref
            if loose.is_file():
                value = _read_text(loose).strip()
                return value if re.fullmatch(r"[0-9a-f]{40}", value) else None
        packed = git / "packed-refs"
        if packed.is_file():
            for line in _read_text(packed).splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[1] == ref and re.fullmatch(r"[0-9a-f]{40}", parts[0]):
                    return parts[0]
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return None


def read_checkout(repo: Path) -> tuple[str, str | None, str | None]:
    """(VhloOps.td text, Version.h text or None, commit or None) of a stablehlo work tree."""
    td = repo / OPS_TD
    if not td.is_file():
        raise SystemExit(
            f"{td} not found: --stablehlo-repo must be a checkout of openxla/stablehlo"
        )
    vh = repo / VERSION_H
    return _read_text(td), _read_text(vh) if vh.is_file() else None, head_commit(repo)


def _vkey(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def build_table(td_text: str, version_h: str | None, commit: str | None) -> dict:
    ops = parse_ops(td_text)
    current = parse_current_version(version_h) if version_h else None
    ordered = dict(sorted(ops.items(), key=lambda kv: (_vkey(kv[1][0]), kv[0])))
    return {
        "source": f"openxla/stablehlo {OPS_TD}",
        "commit": commit,
        "stablehlo_version": current,
        "generated": dt.date.today().isoformat(),
        "note": "op -> the StableHLO version that introduced it (VHLO_Op<name, min, max>); "
        "ops not listed here are newer than stablehlo_version. Regenerate with "
        "scripts/update_vhlo_ops.py --stablehlo-repo PATH",
        "ops": {name: first for name, (first, _) in ordered.items()},
        "retired": {name: last for name, (_, last) in ordered.items() if last != "current"},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stablehlo-repo", type=Path, required=True, help="a stablehlo checkout")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--check", action="store_true", help="only report whether the table is stale")
    args = ap.parse_args(argv)
    table = build_table(*read_checkout(args.stablehlo_repo))
    if args.check:
        old = json.loads(args.out.read_text()) if args.out.exists() else {}
        missing = sorted(set(table["ops"]) - set(old.get("ops", {})))
        changed = sorted(
            n for n, v in table["ops"].items() if n in old.get("ops", {}) and old["ops"][n] != v
        )
        if missing or changed:
            print(f"stale: new ops {missing}, changed versions {changed}")
            return 1
        print(f"up to date ({len(table['ops'])} ops, StableHLO {table['stablehlo_version']})")
        return 0
    args.out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {args.out}: {len(table['ops'])} ops, StableHLO {table['stablehlo_version']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
