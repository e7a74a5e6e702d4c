"""Run the README's ```python blocks, as pasted, in a fresh interpreter; exit with its status.

Usage: python scripts/readme_quickstart.py [README] [--installed]

The blocks are joined in order into ``readme_quickstart_run.py`` in the current directory and
run there by this interpreter (``sys.executable``), with ``MLFLOW_TRACKING_URI`` a sqlite file
in the current directory unless it is set. ``--installed``: the blocks must import
``jaxexp_mlflow`` from an installed distribution (a wheel in site-packages), not from a
checkout. Standard library only, so that a clean environment can run it
(scripts/test.sh checks the built wheel this way); ``tests/e2e/test_readme.py`` imports it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)

#: appended with ``--installed``: where the package the blocks used was imported from
INSTALLED_CHECK = """
import importlib.metadata as _md, sys as _sys
import jaxexp_mlflow as _j
assert "site-packages" in _j.__file__, _j.__file__
_dist = _md.version("jaxexp-mlflow")
assert _dist == _j.__version__, (_dist, _j.__version__)
print("jaxexp_mlflow", _j.__version__, "from", _j.__file__, file=_sys.stderr)
"""


def blocks(text: str, language: str) -> list[str]:
    """The fenced code blocks of ``text`` whose info string starts with ``language``."""
    return [m.group(2) for m in _FENCE.finditer(text) if m.group(1) == language]


def run(
    readme: Path = README, cwd: Path | None = None, *, installed: bool = False, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Run the README's python blocks in a fresh ``sys.executable`` with ``cwd`` its directory."""
    cwd = Path.cwd() if cwd is None else Path(cwd)
    code = "\n\n".join(blocks(Path(readme).read_text(encoding="utf-8"), "python"))
    if not code:
        raise SystemExit(f"{readme}: expected ```python blocks, found none")
    if installed:
        code += "\n" + INSTALLED_CHECK
    script = cwd / "readme_quickstart_run.py"
    script.write_text(code, encoding="utf-8")
    # as a new user runs it: no experiment or run chosen by the calling process
    drop = ("MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{cwd.resolve() / 'mlruns.db'}")
    return subprocess.run(
        [sys.executable, script.name],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def main(argv: list[str]) -> int:
    installed = "--installed" in argv
    paths = [a for a in argv if a != "--installed"]
    done = run(Path(paths[0]) if paths else README, installed=installed)
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr[-4000:])
    print(f"README quickstart: {'passed' if done.returncode == 0 else 'FAILED'}", file=sys.stderr)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
