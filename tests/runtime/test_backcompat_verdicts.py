"""The verdict against JAX's own archive: every back-compat module JAX ships (installed wheel and
older cached wheels) as a bare blob, judged by ``compat.assess`` and compared with what this jax
really does with it (``tests/data/backcompat_truth/jax-<version>.json``, measured in child
processes).

The default test compares against the checked-in ground truth of the installed jax. For a jax
release with no checked-in truth (the CI stage that installs the newest release the day it is
out), it measures the truth first (a few minutes), so that a release that changes what JAX runs
turns the test red rather than being skipped. The ``slow`` test measures it again for a jax
that has a file (``scripts/backcompat_truth.py`` rewrites the file).
"""

from __future__ import annotations

import collections
import subprocess
from pathlib import Path

import jax
import pytest

from jaxexp_mlflow.cli.check import blob_meta
from jaxexp_mlflow.codec.reader import read_blob
from jaxexp_mlflow.runtime import compat
from tests import backcompat


@pytest.fixture(scope="module")
def truth() -> dict:
    """The installed jax's ground truth: checked in, or measured now for a new release."""
    found = backcompat.load_truth()
    if found is not None:
        return found
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    try:
        import backcompat_truth
    finally:
        sys.path.pop(0)
    return backcompat_truth.build(fetch=True)


def judge_all(mods: list[backcompat.Module], env: compat.Environment) -> dict[str, compat.Verdict]:
    """The verdict on each module, judged as ``jaxexp check`` judges a bare blob."""
    out = {}
    for m in mods:
        desc = read_blob(backcompat.blob(m))
        out[m.key] = compat.assess(blob_meta(desc), description=desc, env=env)
    return out


def disagreements(verdicts: dict[str, compat.Verdict], truth: dict) -> dict[str, list[str]]:
    """False "runs", false refusals, and non-cpu modules not refused for their platform."""
    wrong: dict[str, list[str]] = collections.defaultdict(list)
    for key, v in verdicts.items():
        row = truth[key]
        if row["platform"] != "cpu":
            if v.ok or "platform" not in v.codes():
                wrong["non-cpu not refused for platform"].append(key)
        elif v.ok and row["truth"] != "runs":
            wrong["false runs"].append(f"{key}: {row['error']}")
        elif not v.ok and row["truth"] == "runs":
            wrong["false refusals"].append(f"{key}: {v}")
    return dict(wrong)


@pytest.fixture(scope="module")
def env() -> compat.Environment:
    return compat.Environment.current()


@pytest.fixture(scope="module")
def mods() -> list[backcompat.Module]:
    found = backcompat.modules()
    assert len(found) >= 100, "the installed jax wheel ships JAX's back-compat modules"
    return found


def test_verdict_agrees_with_jax_on_its_archive(mods, env, truth):
    known = [m for m in mods if m.key in truth["modules"]]
    # the installed wheel's modules are always there; older wheels only once fetched
    assert sum(m.source == f"jax-{jax.__version__}" for m in known) >= 100
    verdicts = judge_all(known, env)
    assert disagreements(verdicts, truth["modules"]) == {}
    cpu = [k for k in verdicts if truth["modules"][k]["platform"] == "cpu"]
    assert sum(verdicts[k].ok for k in cpu) == sum(
        truth["modules"][k]["truth"] == "runs" for k in cpu
    )
    # older calling conventions that this jax still runs: a warning that says so
    for k in cpu:
        if truth["modules"][k]["calling_convention"] < 9:
            assert verdicts[k].status == "warn" and "calling_convention" in verdicts[k].codes()


def test_changed_kernel_signature_is_refused_with_its_history(mods, env, truth):
    try:  # jax 0.8.0's data still has trsm as written 2024-12-02 (a 2.5 MB wheel from PyPI)
        backcompat.fetch_wheels(("0.8.0",))
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
        pytest.skip(f"cannot fetch the jax 0.8.0 wheel: {err}")
    mods = backcompat.modules()
    old = [m for m in mods if m.entry == "data_2024_12_02[f32]" and "trsm" in m.file]
    assert old, "jax 0.8.0's back-compat data holds lapack_strsm_ffi written 2024-12-02"
    (v,) = judge_all(old, env).values()
    assert v.status == "incompatible" and v.codes() == ["kernel_abi"], str(v)
    text = str(v)
    assert "lapack_strsm_ffi with 3 operand(s)" in text and "2 operand(s)" in text
    assert "last run by jax 0.8.0" in text and "jax/jaxlib 0.8.0" in text
    assert truth["modules"][old[0].key]["error"].endswith("expected 2 but got 3")


def test_kernel_table_and_its_script(tmp_path):
    table = compat.kernel_abi_table()
    change = [c for c in table["changes"] if c["target"] == "lapack_strsm_ffi"]
    assert change == [
        {
            "target": "lapack_strsm_ffi",
            "written": "2025-10-20",
            "jax_from": "0.8.1",
            "what": "operands 3 -> 2",
            "old_last_tested_in": "0.8.0",
        }
    ]
    assert compat.calling_convention_enforced("0.10.2") is False
    sigs = compat.kernel_signatures("lapack_strsm_ffi", "0.10.2")
    assert [(s["operands"], s["runs"]) for s in sigs] == [(3, False), (2, True)]
    assert [s["runs"] for s in compat.kernel_signatures("lapack_strsm_ffi", "0.7.2")] == [
        True,
        False,
    ]
    # the script reads JAX's files as syntax: one file with a nested entry
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "update_kernel_abi", Path(__file__).parents[2] / "scripts" / "update_kernel_abi.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    source = (
        "import datetime\ndata_2030_01_02 = {}\ndata_2030_01_02['f32'] = dict(\n"
        "  platform='cpu', serialized_date=datetime.date(2030, 1, 2),\n"
        "  xla_call_module_version=10, mlir_module_text=r'''\n"
        "    %0:2 = stablehlo.custom_call @k_ffi(%arg0, %1, %2) {api_version = 4 : i32}\n"
        "    stablehlo.custom_call @sink(%0#0)\n'''\n)\n"
    )
    (entry,) = script.entries_of(source).items()
    assert entry[0] == "data_2030_01_02[f32]"
    assert entry[1]["date"] == "2030-01-02" and entry[1]["calling_convention"] == 10
    assert entry[1]["signatures"] == {"k_ffi": {(3, 2)}, "sink": {(1, 0)}}


@pytest.mark.slow
def test_ground_truth_is_current(tmp_path):
    truth = backcompat.load_truth()
    assert truth is not None, "no checked-in truth for this jax: run scripts/backcompat_truth.py"
    """Measure again what this jax does with every module; the checked-in file must agree."""
    backcompat.fetch_wheels()
    mods = backcompat.modules()
    measured = backcompat.ground_truth(mods, tmp_path)
    changed = {
        k: (truth["modules"].get(k, {}).get("truth"), r["truth"])
        for k, r in measured.items()
        if truth["modules"].get(k, {}).get("truth") != r["truth"]
    }
    assert truth["jax_version"] == jax.__version__ and changed == {}, (
        "regenerate tests/data/backcompat_truth/ with scripts/backcompat_truth.py"
    )
