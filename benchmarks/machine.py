"""What a results file says about where it was measured: commit, machine, versions."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The distributions a results file names, by the key the page prints.
DISTRIBUTIONS = {"jax": "jax", "jaxlib": "jaxlib", "mlflow": "mlflow", "orbax": "orbax-checkpoint"}


def git_commit(repo: Path = REPO) -> tuple[str, bool]:
    """The short hash of ``HEAD`` and whether the tree has changes beside it.

    Returns:
        ``("nogit", False)`` outside a git checkout.
    """
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "nogit", False
    return head, bool(status)


def _proc_field(path: str, key: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == key:
                    return value.strip()
    except OSError:
        return None
    return None


def describe_machine() -> dict:
    """CPU model (``/proc/cpuinfo``), cores, memory (``/proc/meminfo``) and platform."""
    mem = _proc_field("/proc/meminfo", "MemTotal")  # "131072000 kB"
    memory_gib = round(int(mem.split()[0]) / 1024**2, 1) if mem else None
    return {
        "cpu": _proc_field("/proc/cpuinfo", "model name") or platform.processor() or None,
        "cores": os.cpu_count(),
        "memory_gib": memory_gib,
        "platform": platform.platform(),
        "accelerator": None,
    }


def versions() -> dict:
    """Python's version and those of the distributions the page names (None where missing)."""
    out: dict = {"python": platform.python_version()}
    for key, dist in DISTRIBUTIONS.items():
        try:
            out[key] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[key] = None
    return out


def has_accelerator() -> bool:
    """Whether an NVIDIA GPU is visible (its device node or ``nvidia-smi``)."""
    if Path("/dev/nvidia0").exists():
        return True
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
    except OSError:
        return False
