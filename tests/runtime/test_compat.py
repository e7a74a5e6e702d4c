"""The compatibility verdict: reasons, what to do, load refuses/warns."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import jax
import mlflow
import numpy as np
import pytest

import jaxexp_mlflow  # noqa: F401  (installs mlflow.jaxexp)
from jaxexp_mlflow.codec.reader import read_blob_file
from jaxexp_mlflow.errors import IncompatibleError
from jaxexp_mlflow.runtime import compat
from tests.conftest import (
    CORPUS,
    case_id,
    corpus_cases,
    corpus_refusals,
    jax_refuses_expired,
    load_case,
)

REPO = Path(__file__).resolve().parents[2]
needs_corpus = pytest.mark.skipif(not corpus_cases(), reason="corpus not available")


@pytest.fixture(scope="module")
def env() -> compat.Environment:
    return compat.Environment.current()


@pytest.fixture(scope="module")
def env_0102(env) -> compat.Environment:
    """This machine as jax/jaxlib 0.10.2 sees it (the last releases before the enforcing 0.11.1),
    for the checks of the verdict's logic that do not depend on the installed jax."""
    return env.replace(
        jax_version="0.10.2", jaxlib_version="0.10.2", enforces_window=False, reads_expired=False
    )


@pytest.fixture(scope="module")
def env_012(env) -> compat.Environment:
    """This machine as jax/jaxlib 0.12.0.1 sees it (refuses schema < 5 and HLO shardings)."""
    return env.replace(
        jax_version="0.12.0.1", jaxlib_version="0.12.0.1", enforces_window=True, reads_expired=False
    )


def _judge(case: Path, env, *, bare: bool = False, **kw) -> compat.Verdict:
    meta = json.loads((case / "meta.json").read_text())
    meta["serialization_version"] = meta["serialization_version_flatbuffer"]
    if bare:  # what MLmodel holds for a blob logged as bytes
        meta["jax_version"] = meta["jaxlib_version"] = None
    return compat.assess(meta, description=read_blob_file(case / "exported.bin"), env=env, **kw)


@needs_corpus
@pytest.mark.parametrize("bare", [False, True], ids=["versioned", "bare"])
@pytest.mark.parametrize("case", corpus_cases(), ids=case_id)
def test_corpus_verdicts(case, bare, env):
    version = case.parent.name.removeprefix("jax-")
    v = _judge(case, env, bare=bare)
    expected = set()
    if case.name == "sharded4":
        expected.add("devices")
    refusals = corpus_refusals(case)  # jax >= 0.11.1: schema < 5, or HLO shardings
    expected |= refusals
    # the exporter's jaxlib built more than 6 months before the running one: a warning (0.4.35
    # and 0.6.2 under jaxlib 0.10.2; 0.8.3 too under 0.12), left out when jax refuses the blob
    # anyway; a bare blob's date is known only from calling convention 9 (jax <= 0.6)
    built = compat.release_date(version)
    if (
        not refusals
        and (compat.release_date(env.jaxlib_version) - built).days > 183
        and (not bare or version in ("0.4.35", "0.6.2"))
    ):
        expected.add("window_backward")
    if (version, case.name) == ("0.4.35", "linalg"):
        expected.add("custom_calls")
    assert set(v.codes()) == expected, str(v)
    blocking = {"devices", "custom_calls", "expired", "hlo_sharding"}
    want = "incompatible" if expected & blocking else ("warn" if expected else "ok")
    assert v.status == want
    json.dumps(v.to_dict())  # JSON-able, for `jaxexp check --json`
    for r in v.reasons:
        assert r.code and r.message and r.action and "\n" not in str(r)


@needs_corpus
def test_reasons_say_what_to_do(env_0102):
    linalg = _judge(CORPUS / "jax-0.4.35" / "linalg", env_0102)
    (cc,) = [r for r in linalg.reasons if r.code == "custom_calls"]
    assert "blas_strsm" in cc.message and "NOT_FOUND" in cc.message
    assert "jaxlib 0.4.35" in cc.action and "export the function again" in cc.action
    (win,) = [r for r in linalg.reasons if r.code == "window_backward"]
    assert "2024-10-22" in win.message and "2026-06-17" in win.message
    assert win.severity == "warn" and "refresh" in win.action

    sharded = _judge(CORPUS / "jax-0.10.2" / "sharded4", env_0102)
    (dev,) = sharded.reasons
    assert "4 devices" in dev.message and "only 1 cpu device" in dev.message
    assert "--xla_force_host_platform_device_count=4" in dev.action


@needs_corpus
def test_bare_blob_build_date_is_bracketed_from_its_signals(env_0102):
    env = env_0102
    old = _judge(CORPUS / "jax-0.6.2" / "mlp", env, bare=True)
    # calling convention 9 is written until jax 0.7.0 (2025-07-22)
    assert old.exporter["jaxlib_version"] is None
    assert old.exporter["build_date_latest"] == "2025-07-22"
    assert "calling convention 9" in old.exporter["evidence"]
    assert old.codes() == ["window_backward"] and "on or before 2025-07-22" in str(old)
    new = _judge(CORPUS / "jax-0.10.2" / "mlp", env, bare=True)
    assert new.exporter["build_date_earliest"] >= "2026-04-04" and new.status == "ok"


@needs_corpus
def test_running_jax_that_enforces_the_window(env_012):
    case = CORPUS / "jax-0.4.35" / "mlp"
    v = _judge(case, env_012)
    assert v.status == "incompatible"
    assert v.codes() == ["expired"]  # no "refresh while it still reads it" beside a refusal
    (expired,) = v.reasons
    assert "schema 2" in expired.message and "0.12.0.1 refuses" in expired.message
    # what works: the flag (13 of the 17 corpus blobs jax 0.12 refuses run with it), or an
    # older jax: the newest within 6 months of 0.4.35, or the last one that does not enforce
    assert "JAX_EXPORT_DESERIALIZE_EXPIRED_VERSIONS=1" in expired.action
    assert "==0.6.0" in expired.action and "==0.11.0" in expired.action
    # with the flag set the blob is read: a warning to refresh it while that lasts
    v = _judge(case, env_012.replace(reads_expired=True))
    assert v.status == "warn" and set(v.codes()) == {"expired", "window_backward"}
    # 0.8.3 blobs are schema 5: read without the flag, only outside the promised window
    v = _judge(CORPUS / "jax-0.8.3" / "mlp", env_012)
    assert v.status == "warn" and v.codes() == ["window_backward"]
    # a jax before 0.11.1 reads them all
    assert _judge(case, env_012.replace(enforces_window=False)).ok


@needs_corpus
@pytest.mark.parametrize("version", ["0.4.35", "0.6.2", "0.8.3", "0.10.2"])
def test_old_style_shardings_are_refused_whatever_the_flag(env_012, version):
    case = CORPUS / f"jax-{version}" / "sharded4"
    env = env_012.replace(device_count=4, reads_expired=True)
    v = _judge(case, env)
    if version == "0.10.2":  # NamedSharding only
        assert v.ok and "hlo_sharding" not in v.codes()
        return
    (hlo,) = [r for r in v.reasons if r.code == "hlo_sharding"]
    assert v.status == "incompatible" and "devices=[" in hlo.message
    assert compat.EXPIRED_FLAG in hlo.message and "does not help" in hlo.message
    assert compat.EXPIRED_ENV not in hlo.action and "==0.11.0" in hlo.action


@needs_corpus
def test_forward_window_and_unknown_versions(env):
    case = CORPUS / "jax-0.10.2" / "mlp"
    older = env.replace(jaxlib_version="0.8.0")  # built 2025-10-15, 8 months before 0.10.2
    v = _judge(case, older)
    assert v.codes() == ["window_forward"] and v.status == "warn"
    assert "jaxlib>=0.10." in v.reasons[0].action
    meta = json.loads((case / "meta.json").read_text())
    meta["jaxlib_version"] = "0.99.0"
    v = compat.assess(meta, env=env)
    assert v.codes() == ["jaxlib_unknown"] and v.status == "warn"
    assert "update_jaxlib_releases.py" in v.reasons[0].action
    v = compat.assess(meta, env=env.replace(jaxlib_version="0.99.0"))
    assert v.codes() == ["jaxlib_unknown", "jaxlib_unknown"]
    assert compat.release_date("0.5.1.dev20250101") == dt.date(2025, 1, 1)


def test_calling_convention_schema_platform_devices(env):
    meta = {
        "platforms": ["cpu"],
        "nr_devices": 1,
        "calling_convention_version": 9,
        "jaxlib_version": "0.10.2",
    }
    assert compat.assess(meta, env=env).status == "ok"
    v = compat.assess(meta, env=env.replace(calling_convention_range=(10, 11)))
    assert v.codes() == ["calling_convention"] and "reads 10..11" in v.reasons[0].message
    v = compat.assess({**meta, "calling_convention_version": 12}, env=env)
    assert v.codes() == ["calling_convention"] and "Upgrade jax" in v.reasons[0].action

    class Desc:  # a blob written with a schema newer than the running jax knows
        schema_generation = 12
        custom_call_targets = ()
        jax_version = "0.12.0.1"

    # schema 10 moved avals into shared tables: a jax that knows up to 9 would misread it
    v = compat.assess(meta, description=Desc(), env=env.replace(max_schema=9))
    assert v.codes() == ["schema"] and v.status == "incompatible"
    assert "schema 10 moved" in v.reasons[0].message and "0.12.0.1" in v.reasons[0].action
    # schema 12 only adds the writer's version: jax 0.10.2 (schema 11) reads it (measured,
    # tests/runtime/test_stablehlo_ops.py), so a warning
    v = compat.assess(meta, description=Desc(), env=env.replace(max_schema=11))
    assert v.codes() == ["schema"] and v.status == "warn"

    tpu = {**meta, "platforms": ["tpu"]}
    v = compat.assess(tpu, env=env)
    assert v.codes() == ["platform"] and v.status == "incompatible"
    assert "['tpu']" in v.reasons[0].message and "'cpu'" in v.reasons[0].message
    assert "allow_other_platform=True" in v.reasons[0].action
    assert compat.assess(tpu, env=env, allow_other_platform=True).status == "warn"

    v = compat.assess({**meta, "nr_devices": 8}, env=env)
    assert v.codes() == ["devices"] and "8 devices" in v.reasons[0].message


def test_registered_targets_are_listed_without_compiling(env):
    targets = env.custom_call_targets
    assert targets is not None and "lapack_sgetrf_ffi" in targets
    assert "blas_strsm" not in targets  # gone from jaxlib 0.10.2
    meta = {"platforms": ["cpu"], "nr_devices": 1, "jaxlib_version": "0.10.2"}
    ok = ["lapack_sgetrf_ffi", "shape_assertion", "cusolver_getrf_ffi", "tpu_custom_call"]
    assert compat.assess({**meta, "custom_call_targets": ok}, env=env).status == "ok"
    v = compat.assess({**meta, "custom_call_targets": ["my_kernel"]}, env=env)
    assert v.codes() == ["custom_calls"] and "register_ffi_target" in v.reasons[0].action


@needs_corpus
def test_load_refuses_linalg_before_calling_and_override(tmp_path, caplog, expired_flag):
    # jax >= 0.11.1 reads this schema-2 blob only with its flag (set by the fixture there)
    case = CORPUS / "jax-0.4.35" / "linalg"
    _, inputs, _ = load_case(case)
    path = tmp_path / "linalg"
    mlflow.jaxexp.save_model((case / "exported.bin").read_bytes(), path)
    with pytest.raises(IncompatibleError, match=r"(?s)blas_strsm.*allow_incompatible=True"):
        mlflow.jaxexp.load_model(str(path))
    # the override loads it; the call then fails exactly as the verdict predicted
    model = mlflow.jaxexp.load_model(str(path), allow_incompatible=True)
    assert model.verdict.status == "incompatible"
    with pytest.raises(Exception, match="blas_strsm"):
        jax.block_until_ready(model(*inputs))

    # a "warn" verdict loads and logs each reason
    mlp = CORPUS / "jax-0.4.35" / "mlp"
    mlflow.jaxexp.save_model((mlp / "exported.bin").read_bytes(), tmp_path / "mlp")
    with caplog.at_level(logging.WARNING, logger="jaxexp_mlflow.runtime.routes"):
        model = mlflow.jaxexp.load_model(str(tmp_path / "mlp"))
    assert model.verdict.status == "warn"
    assert any("[window_backward]" in r.getMessage() for r in caplog.records)
    if expired_flag:
        assert any("[expired]" in r.getMessage() for r in caplog.records)


@needs_corpus
def test_expired_blob_saved_through_the_flag_route_and_loaded_with_the_flag(tmp_path):
    case = CORPUS / "jax-0.6.2" / "mlp"
    _, inputs, outputs = load_case(case)
    blob = (case / "exported.bin").read_bytes()
    if not jax_refuses_expired():  # jax < 0.11.1 reads it as it is, with a warning on its age
        mlflow.jaxexp.save_model(blob, tmp_path / "m")
        model = mlflow.jaxexp.load_model(str(tmp_path / "m"))
        assert model.verdict.codes() == ["window_backward"] and model.verdict.ok
        args, kwargs = jax.tree.unflatten(model.exported.in_tree, inputs)
        assert np.allclose(np.asarray(model(*args, **kwargs)), outputs[0], rtol=1e-5, atol=1e-5)
        return
    # saving it here goes through the expired-flag route (JAX's flag around the read only),
    # recorded in MLmodel (the route it loads through; never log what cannot load) ...
    from jaxexp_mlflow.codec.mlmodel import read_mlmodel

    mlflow.jaxexp.save_model(blob, tmp_path / "routed")
    routed = read_mlmodel(tmp_path / "routed")["flavors"]["jaxexp"]["route"]
    assert routed["name"] == "expired-flag"
    # ... and goes through with the flag; loading it without the flag is refused before JAX
    jax.config.update(compat.EXPIRED_FLAG, True)
    try:
        mlflow.jaxexp.save_model(blob, tmp_path / "m")
        # the isolation child reads it alike (the flag set in Python reaches it)
        isolated = mlflow.jaxexp.load_model(str(tmp_path / "m"), isolate=True)
        assert isolated.verdict.codes()[0] == "expired" and isolated.verdict.status == "warn"
    finally:
        jax.config.update(compat.EXPIRED_FLAG, False)
    with pytest.raises(IncompatibleError, match=r"(?s)\[expired\].*EXPIRED_VERSIONS=1"):
        mlflow.jaxexp.load_model(str(tmp_path / "m"))
    # the advice works: in a process with the variable set, it loads and reproduces
    code = (
        "import sys, jax, numpy as np, mlflow, jaxexp_mlflow\n"
        "from tests.conftest import load_case\n"
        "from pathlib import Path\n"
        "_, x, y = load_case(Path(sys.argv[2]))\n"
        "m = mlflow.jaxexp.load_model(sys.argv[1])\n"
        "print(m.verdict.codes())\n"
        "args, kwargs = jax.tree.unflatten(m.exported.in_tree, x)\n"
        "out = m(*args, **kwargs)\n"
        "assert np.allclose(np.asarray(out), y[0], rtol=1e-5, atol=1e-5)\n"
    )
    env = {**os.environ, compat.EXPIRED_ENV: "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "m"), str(case)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "'expired'" in proc.stdout


def test_release_table_script_and_shipped_table():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import update_jaxlib_releases as script
    finally:
        sys.path.pop(0)
    doc = {
        "info": {"version": "9.1"},
        "releases": {
            "9.0": [
                {"upload_time_iso_8601": "2030-01-02T23:59:00.000Z", "yanked": False},
                {"upload_time_iso_8601": "2030-01-01T10:00:00.000Z", "yanked": False},
            ],
            "9.1": [{"upload_time_iso_8601": "2030-02-01T00:00:00Z", "yanked": True}],
            "0.0.1": [],
        },
    }
    table = script.build_table(doc)
    assert table["releases"] == {
        "9.0": {"date": "2030-01-01"},
        "9.1": {"date": "2030-02-01", "yanked": True},
    }
    shipped = compat.release_table()
    assert shipped["releases"]["0.4.35"]["date"] == "2024-10-22"
    assert compat.release_date("0.10.2") == dt.date(2026, 6, 17)
    assert compat.newest_release_before(dt.date(2025, 4, 22)) == "0.6.0"


def test_compat_and_devices_import_without_jax_or_mlflow():
    code = (
        "import sys\n"
        "import jaxexp_mlflow.runtime.compat, jaxexp_mlflow.runtime.devices\n"
        "print(sorted(m for m in ('jax', 'jaxlib', 'mlflow', 'orbax') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@needs_corpus
def test_kernel_signatures_read_from_the_module(env):
    old = read_blob_file(CORPUS / "jax-0.4.35" / "linalg" / "exported.bin")
    assert ("blas_strsm", 10, 1) in old.custom_calls  # the pre-FFI kernel: 10 operands
    new = read_blob_file(CORPUS / "jax-0.6.2" / "linalg" / "exported.bin")
    assert ("lapack_strsm_ffi", 2, 1) in new.custom_calls
    assert "kernel_abi" not in _judge(CORPUS / "jax-0.6.2" / "linalg", env).codes()
    # the same call with 3 operands (as JAX's module written 2024-12-02 makes it) is refused
    meta = {
        "platforms": ["cpu"],
        "nr_devices": 1,
        "jaxlib_version": "0.10.2",
        "calling_convention_version": 9,
    }

    class Desc:
        custom_call_targets = ("lapack_strsm_ffi",)
        custom_calls = (("lapack_strsm_ffi", 3, 1),)

    v = compat.assess(meta, description=Desc(), env=env)
    assert v.codes() == ["kernel_abi"] and v.status == "incompatible"
    # judged as the jax 0.7.2 that still ran it: fine
    assert compat.assess(meta, description=Desc(), env=env.replace(jax_version="0.7.2")).ok
    # calls unreadable: dates alone only warn (JAX's dates are when its tests were rewritten)
    dated = {**meta, "jaxlib_version": "0.6.2", "custom_call_targets": ["lapack_strsm_ffi"]}
    v = compat.assess(dated, env=env)
    assert "kernel_abi" in v.codes() and v.status == "warn"


def test_batch_polymorphic_lapack_call_is_judged_by_its_kernel_operands(tmp_path):
    """Under a symbolic batch JAX's FFI lowering appends one shape operand per result to a
    kernel call (``indices_of_shape_operands``): ``lapack_strsm_ffi`` is then called with 3
    operands, which is also the count of its retired 2024 signature. It must not be refused."""
    import jax.numpy as jnp

    def solve(params, b):
        return jnp.linalg.solve(params["a"], b)

    a = np.eye(4, dtype=np.float32) * 2.0 + 0.1
    b = np.arange(12, dtype=np.float32).reshape(3, 4, 1)
    params = {"a": np.broadcast_to(a, (3, 4, 4)).copy()}
    mlflow.jaxexp.save_model(
        jax.jit(solve), tmp_path / "m", params=params, input_example=b, batch_polymorphic=False
    )
    # the polymorphic export: params and input share the leading symbolic dimension
    bdim = jax.export.symbolic_shape("b")[0]
    exp = jax.export.export(jax.jit(solve))(
        {"a": jax.ShapeDtypeStruct((bdim, 4, 4), jnp.float32)},
        jax.ShapeDtypeStruct((bdim, 4, 1), jnp.float32),
    )
    blob = exp.serialize()
    desc = compat_reader_blob(blob)
    calls = {t: (o, r) for t, o, r in (desc.custom_calls or ())}
    assert calls.get("lapack_strsm_ffi") == (3, 1), calls  # 2 real operands + 1 shape operand
    v = compat.assess({}, description=desc)
    assert v.ok and "kernel_abi" not in v.codes(), str(v)
    mlflow.jaxexp.save_model(blob, tmp_path / "poly")
    model = mlflow.jaxexp.load_model(str(tmp_path / "poly"))
    np.testing.assert_allclose(
        np.asarray(model(params, b)), np.linalg.solve(params["a"], b), rtol=1e-5, atol=1e-5
    )


def compat_reader_blob(blob: bytes):
    from jaxexp_mlflow.codec.reader import read_blob

    return read_blob(blob)
