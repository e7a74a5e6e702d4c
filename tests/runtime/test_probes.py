"""Models without a reference input: synthetic probes at save, verify and refresh."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import mlflow
import numpy as np
import pytest
import yaml
from click.testing import CliRunner

import jaxexp_mlflow
from jaxexp_mlflow.cli import main
from jaxexp_mlflow.flavors.refresh import _check_on_probes
from jaxexp_mlflow.runtime import compat, devices, probes
from jaxexp_mlflow.runtime.loader import bind_model
from tests.conftest import CORPUS, corpus_refusals
from tests.models import export_mlp, mlp_params


def _flavor(path) -> dict:
    return yaml.safe_load((path / "MLmodel").read_text())["flavors"]["jaxexp"]


def test_probes_instantiate_symbolic_dims_and_respect_dtypes():
    b, n = jax.export.symbolic_shape("b, n")
    avals = [
        jax.core.ShapedArray((b, 3), jnp.bfloat16),
        jax.core.ShapedArray((2 * b, n), jnp.int8),
        jax.core.ShapedArray((n,), jnp.uint32),
        jax.core.ShapedArray((b,), jnp.bool_),
        jax.core.ShapedArray((4,), jnp.complex64),
    ]
    made = [probes.make(avals, i) for i in range(3)]
    assert [p.dims for p in made] == [{"b": 2, "n": 3}, {"b": 3, "n": 5}, {"b": 5, "n": 4}]
    p = made[0]
    assert [x.shape for x in p.leaves] == [(2, 3), (4, 3), (3,), (2,), (4,)]
    assert [x.dtype for x in p.leaves] == [a.dtype for a in avals]
    assert np.all((p.leaves[1] >= -3) & (p.leaves[1] <= 3)) and np.all(p.leaves[2] <= 4)
    assert np.abs(p.leaves[4].imag).sum() > 0 and np.isfinite(p.leaves[0].astype(np.float32)).all()
    # the same model always gets the same probes
    assert all(
        np.array_equal(x, y) for x, y in zip(p.leaves, probes.make(avals, 0).leaves, strict=True)
    )
    with pytest.raises(probes.ProbeError, match="dtype"):
        probes.make([jax.core.ShapedArray((2,), np.dtype("O"))])


def test_probes_retry_sizes_that_break_shape_constraints():
    (b,) = jax.export.symbolic_shape("b")
    avals = [jax.core.ShapedArray((b,), jnp.float32)]

    def only_even(leaves):
        if leaves[0].shape[0] % 2:
            raise ValueError("b must be even")
        return leaves[0].sum()

    runs = probes.run_probes(avals, only_even)
    assert [p.dims["b"] for p, _ in runs] == [2, 4, 4]  # 3 and 5 were refused, then retried
    with pytest.raises(probes.ProbeError, match="does not run on synthetic probe 0"):
        probes.run_probes(avals, lambda leaves: 1 / 0)


def test_bare_blob_saved_with_a_synthetic_reference_that_verify_reproduces(
    tmp_path, expired_flag, without_expired_flag
):
    # a jax 0.6.2 blob (schema 2): jax >= 0.11.1 reads it only with its expired-versions flag,
    # set here by the fixture; without it, saving goes through the expired-flag route
    case = CORPUS / "jax-0.6.2" / "mlp_poly"
    path = tmp_path / "m"
    blob = (case / "exported.bin").read_bytes()
    if "expired" in corpus_refusals(case):
        with without_expired_flag():  # saved through the expired-flag route
            mlflow.jaxexp.save_model(blob, tmp_path / "routed")
        assert _flavor(tmp_path / "routed")["route"]["name"] == "expired-flag"
    mlflow.jaxexp.save_model(blob, path)
    conf = _flavor(path)
    assert conf["reference_synthetic"] == {"dims": {"b": 2}, "seed": probes.SEED}
    assert (path / "reference" / "inputs.npz").is_file()
    # the command line reads the flag from the environment (verify's isolated child too)
    env = {compat.EXPIRED_ENV: "1"} if expired_flag else None
    result = CliRunner(env=env).invoke(main, ["verify", str(path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert (
        "Reference synthetic probe (b=2; seed" in result.output and "all 1 output" in result.output
    )
    out = CliRunner(env=env).invoke(main, ["verify", str(path), "--json"], catch_exceptions=False)
    assert json.loads(out.stdout)["reference"]["synthetic"] is True
    if expired_flag:  # and without the flag, verify refuses it before running, naming the flag
        with without_expired_flag():
            refused = CliRunner().invoke(main, ["verify", str(path)], catch_exceptions=False)
        assert refused.exit_code == 1, refused.output
        assert "[expired]" in refused.output and f"{compat.EXPIRED_ENV}=1" in refused.output
    # a blob that cannot run here (4 devices on 1) is saved without a reference, as before
    sharded = tmp_path / "s"
    mlflow.jaxexp.save_model(
        (CORPUS / "jax-0.10.2" / "sharded4" / "exported.bin").read_bytes(), sharded
    )
    assert "reference" not in _flavor(sharded) and not (sharded / "reference").exists()


def test_refresh_without_any_reference_uses_probes_and_says_so(
    tmp_path, tracking_uri, expired_flag, without_expired_flag
):
    # a jax 0.6.2 blob: saved and refreshed with jax's expired-versions flag where it needs one
    path = tmp_path / "old"
    blob = (CORPUS / "jax-0.6.2" / "mlp_poly" / "exported.bin").read_bytes()
    mlflow.jaxexp.save_model(blob, path)
    # as a model saved before synthetic references existed: no reference at all
    mlmodel = yaml.safe_load((path / "MLmodel").read_text())
    for key in ("reference", "reference_synthetic"):
        mlmodel["flavors"]["jaxexp"].pop(key)
    (path / "MLmodel").write_text(yaml.safe_dump(mlmodel))
    new = jaxexp_mlflow.refresh(str(path), name="refreshed")
    tags = mlflow.get_logged_model(new.model_id).tags
    assert tags["jaxexp.refresh.synthetic_probes"] == "true"
    assert tags["jaxexp.refresh.proof"].startswith("3 synthetic probes, old vs refreshed blob")
    assert "b=2" in tags["jaxexp.refresh.proof"] and "b=5" in tags["jaxexp.refresh.proof"]
    local = mlflow.artifacts.download_artifacts(new.model_uri)
    assert _flavor(Path(local))["reference_synthetic"]["dims"] == {"b": 2}
    with without_expired_flag():  # the refreshed blob is of this jax's schema: no flag needed
        verify = CliRunner().invoke(main, ["verify", new.model_uri], catch_exceptions=False)
    assert verify.exit_code == 0, verify.output
    assert "[expired]" not in verify.output


def test_probe_comparison_catches_a_different_function(tmp_path):
    params = mlp_params()
    path = tmp_path / "m"
    mlflow.jaxexp.save_model(export_mlp(params), path, params=params)
    meta = _flavor(path)
    other = export_mlp(mlp_params(seed=1))  # same avals, another function of them
    exp = export_mlp(params)
    same, _ = _check_on_probes(
        bind_model(exp, path, meta, devices.plan(exp)),
        bind_model(exp, path, meta, devices.plan(exp)),
        rtol=None,
        atol=None,
    )
    assert len(same) == 3 and all(c.passed for c in same)
    from jaxexp_mlflow.runtime.model import JaxExpModel

    old = bind_model(exp, path, meta, devices.plan(exp))
    wrong = JaxExpModel(other, mlp_params(seed=1), meta)
    checks, used = _check_on_probes(old, wrong, rtol=None, atol=None)
    assert [p.dims["b"] for p in used] == [2, 3, 5] and not any(c.passed for c in checks)
