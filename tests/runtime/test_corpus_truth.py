"""The verdict against what the installed jax really does with every shared-corpus blob.

Each of the 32 blobs (``../shared/corpus``: jax 0.4.35, 0.6.2, 0.8.3 and 0.10.2) is deserialized
and called on its stored inputs in a child process with 4 CPU devices (the session's:
``tests.conftest.device_child``), once as jax starts and once with
``jax_export_deserialize_expired_versions`` set as it starts; ``jaxexp check``'s verdict on the same
blob, in the same environment, must agree: no false "runs" (a blob judged ok that jax refuses or
that fails when called) and no false refusals (a blob judged incompatible that runs and
reproduces its stored outputs). Nothing here is hard-coded per jax version: the truth is measured.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from jaxexp_mlflow.codec.reader import read_blob_file
from jaxexp_mlflow.runtime import compat
from tests.conftest import case_id, corpus_cases, device_child

REPO = Path(__file__).resolve().parents[2]

_CHILD = r"""
import json, sys
import numpy as np
import jax
from jax import export
sys.path.insert(0, sys.argv[1])
from tests.conftest import load_case
from jaxexp_mlflow.runtime import compat
from pathlib import Path

out = {"env": compat.Environment.current().to_dict(), "cases": {}}
for case in sys.argv[2:]:
    case = Path(case)
    meta, inputs, outputs = load_case(case)
    row = {}
    try:
        exp = export.deserialize(bytearray((case / "exported.bin").read_bytes()))
        if exp.nr_devices > 1:  # inputs placed on a mesh of the exported devices
            from jaxexp_mlflow.runtime import devices
            placement = devices.plan(exp)
            inputs = [x if s is None else jax.device_put(x, s)
                      for x, s in zip(inputs, placement.in_shardings)]
        args, kwargs = jax.tree.unflatten(exp.in_tree, inputs)
        got = jax.tree.leaves(jax.block_until_ready(jax.jit(exp.call)(*args, **kwargs)))
        row["truth"] = "runs"
        row["matches"] = len(got) == len(outputs) and all(
            np.asarray(g).shape == w.shape
            and np.allclose(np.asarray(g).astype(np.float64), w.astype(np.float64),
                            rtol=2e-2, atol=2e-2, equal_nan=True)
            for g, w in zip(got, outputs))
    except Exception as e:
        row["truth"] = "fails"
        row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
    out["cases"][f"{case.parent.name}/{case.name}"] = row
print(json.dumps(out))
"""


def _measure(cases: list[Path], *, flag: bool) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop(compat.EXPIRED_ENV, None)
    if flag:  # read as jax starts: a child of its own (device_child shares none across it)
        env[compat.EXPIRED_ENV] = "1"
    proc = device_child(_CHILD, 4, str(REPO), *map(str, cases), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not corpus_cases(), reason="corpus not available")
@pytest.mark.parametrize("flag", [False, True], ids=["as-installed", "expired-flag"])
def test_verdict_agrees_with_this_jax_on_the_whole_corpus(flag):
    cases = corpus_cases()
    assert len(cases) == 32
    measured = _measure(cases, flag=flag)
    env = compat.Environment(
        **{
            k: v
            for k, v in measured["env"].items()
            if k not in ("custom_call_targets", "jaxlib_build_date")
        }
    ).replace(custom_call_targets=compat.Environment.current().custom_call_targets)
    assert env.device_count == 4 and bool(env.reads_expired) == (
        flag and env.enforces_window is True
    )
    wrong = []
    refused = 0
    for case in cases:
        meta = json.loads((case / "meta.json").read_text())
        meta["serialization_version"] = meta["serialization_version_flatbuffer"]
        verdict = compat.assess(meta, description=read_blob_file(case / "exported.bin"), env=env)
        row = measured["cases"][case_id(case)]
        runs = row["truth"] == "runs" and row["matches"]
        refused += not verdict.ok
        if verdict.ok and not runs:
            wrong.append(f"false runs: {case_id(case)}: {row}")
        elif not verdict.ok and runs:
            wrong.append(f"false refusal: {case_id(case)}: {verdict}")
        if not verdict.ok:
            # advice never suggests the flag for a blob the flag cannot open
            if "hlo_sharding" in verdict.codes():
                assert all(compat.EXPIRED_ENV not in r.action for r in verdict.reasons), verdict
            for r in verdict.reasons:
                assert r.message and r.action, verdict
    assert wrong == []
    # jax >= 0.11.1 refuses 17 of the 32 as it starts (all of 0.4.35 and 0.6.2, 0.8.3/sharded4);
    # with the flag it reads 13 of those (not 0.4.35/linalg, not the 3 HLO-sharded blobs)
    if env.enforces_window:
        assert refused == (4 if flag else 17)
    else:
        assert refused == 1  # 0.4.35/linalg: its LAPACK kernel is gone from jaxlib
