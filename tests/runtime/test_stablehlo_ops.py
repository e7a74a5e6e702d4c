"""The ``stablehlo`` verdict: a module using VHLO ops newer than the running jaxlib reads.

Real material: ``tests/data/blobs`` holds an MLP exported by jax 0.12.0.1 with a symbolic batch
(its shape assertions are ``vhlo.custom_call_v2``, StableHLO 1.18.0) and with concrete shapes
(no custom call), with inputs and outputs. jaxlib 0.10.2 reads StableHLO up to 1.17.0: it runs
the concrete one and fails on the polymorphic one at the first call. The verdict must say so
against any installed jax, and agree with what the installed jax really does.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxexp_mlflow.codec import reader
from jaxexp_mlflow.internals import jax_private
from jaxexp_mlflow.runtime import compat, stablehlo_ops
from tests.conftest import case_id, corpus_cases

BLOBS = Path(__file__).parents[1] / "data" / "blobs"
POLY, CONCRETE = "jax-0.12.0.1-mlp_poly", "jax-0.12.0.1-mlp"
OLD_JAXLIB = {"stablehlo_version": "1.17.0", "jax_version": "0.10.2", "jaxlib_version": "0.10.2"}


def _vkey(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split("."))


def _describe(name: str) -> reader.BlobDescription:
    return reader.read_blob_file(BLOBS / f"{name}.bin")


def _jaxlib_vhlo_ops(module: bytes) -> tuple[str, ...]:
    """The VHLO op names of a portable artifact as jaxlib's MLIR reads the bytecode (no
    conversion to StableHLO: the ops stay as written)."""
    api = jax_private.portable_artifact_api()
    assert api is not None
    make_ir_context, ir, _ = api
    names: set[str] = set()

    def walk(op) -> None:
        names.add(op.name)
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    walk(child.operation)

    with make_ir_context():
        walk(ir.Module.parse(module).operation)
    return tuple(sorted(n.removeprefix("vhlo.") for n in names if n.startswith("vhlo.")))


def _call(name: str) -> list[np.ndarray]:
    """Deserialize and call a checked-in blob on its stored inputs with the installed jax."""
    data = np.load(BLOBS / f"{name}.npz")
    exp = jax.export.deserialize(bytearray((BLOBS / f"{name}.bin").read_bytes()))
    leaves = [data[f"in_{i}"] for i in range(len(exp.in_avals))]
    args, kwargs = jax.tree.unflatten(exp.in_tree, leaves)
    return [np.asarray(o) for o in jax.tree.leaves(exp.call(*args, **kwargs))]


# -- the reader: op names and the writer's jax version ----------------------------------------


def test_reader_exposes_vhlo_ops_and_the_writers_jax_version():
    poly, concrete = _describe(POLY), _describe(CONCRETE)
    assert poly.stablehlo_producer == concrete.stablehlo_producer == "StableHLO_v1.18.0"
    assert "custom_call_v2" in poly.vhlo_ops and "custom_call_v2" not in concrete.vhlo_ops
    assert {"dot_general_v2", "tanh_v2", "func_v1", "return_v1"} <= set(concrete.vhlo_ops)
    assert poly.vhlo_ops == tuple(sorted(set(poly.vhlo_ops)))
    assert poly.jax_version == concrete.jax_version == "0.12.0.1"  # schema 12 records it
    assert poly.to_dict()["vhlo_ops"] == list(poly.vhlo_ops)


def _exports():
    b = jax.export.symbolic_shape("b")[0]

    def mlp(p, x):
        return jnp.tanh(x @ p["w"] + p["b"])

    params = {
        "w": jax.ShapeDtypeStruct((3, 2), jnp.float32),
        "b": jax.ShapeDtypeStruct((2,), jnp.float32),
    }
    yield (
        "mlp_poly",
        jax.export.export(jax.jit(mlp))(params, jax.ShapeDtypeStruct((b, 3), jnp.float32)),
    )
    yield (
        "solve",
        jax.export.export(jax.jit(jnp.linalg.solve))(
            jax.ShapeDtypeStruct((b, 3, 3), jnp.float32),
            jax.ShapeDtypeStruct((b, 3, 1), jnp.float32),
        ),
    )

    def loop(x):
        return jax.lax.fori_loop(0, 3, lambda i, c: jnp.sort(c) * 2 + jnp.cumsum(c), x)

    yield "loop", jax.export.export(jax.jit(loop))(jax.ShapeDtypeStruct((5,), jnp.float32))


@pytest.mark.parametrize(
    "name,exp", list(_exports()), ids=lambda v: v if isinstance(v, str) else ""
)
def test_vhlo_ops_agree_with_jaxlib_on_this_jaxs_exports(name, exp):
    d = reader.read_blob(exp.serialize())
    assert d.vhlo_ops == _jaxlib_vhlo_ops(exp.mlir_module_serialized)
    assert d.vhlo_ops and all(op in stablehlo_ops.op_table()["ops"] for op in d.vhlo_ops)


@pytest.mark.parametrize("case", corpus_cases(), ids=case_id)
def test_vhlo_ops_agree_with_jaxlib_on_the_corpus(case):
    blob = (case / "exported.bin").read_bytes()
    d = reader.read_blob(blob)
    assert d.vhlo_ops == _jaxlib_vhlo_ops(reader.read_module(blob))
    assert d.jax_version is None  # written before jax recorded itself (schema < 12)


def test_vhlo_ops_agree_with_jaxlib_on_the_newer_blobs_where_it_reads_them():
    reads_1_18 = _vkey(jax_private.stablehlo_version()) >= (1, 18, 0)
    for name in (POLY, CONCRETE):
        module = reader.read_module((BLOBS / f"{name}.bin").read_bytes())
        if name == POLY and not reads_1_18:  # this jaxlib's MLIR does not know the op at all
            with pytest.raises(Exception, match="vhlo.custom_call_v2"):  # noqa: PT011 MLIRError
                _jaxlib_vhlo_ops(module)
        else:
            assert _describe(name).vhlo_ops == _jaxlib_vhlo_ops(module)


def test_vhlo_ops_of_an_unreadable_module_is_none():
    assert reader.mlir_bytecode.scan_module(b"ML\xefR\x06StableHLO_v1.18.0\0").vhlo_ops is None


# -- the op table -------------------------------------------------------------------------------


def test_op_table_is_what_the_script_parses():
    table = stablehlo_ops.op_table()
    ops = table["ops"]
    assert ops["custom_call_v1"] == "0.9.0" and ops["custom_call_v2"] == "1.18.0"
    assert ops["abs_v1"] == "0.9.0" and ops["cross-replica-sum_v1"] == "0.9.0"
    assert all(_vkey(v) <= _vkey(table["stablehlo_version"]) for v in ops.values())
    import importlib.util

    path = Path(__file__).parents[2] / "scripts" / "update_vhlo_ops.py"
    spec = importlib.util.spec_from_file_location("update_vhlo_ops", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    td = (
        '// def VHLO_Commented : VHLO_Op<"gone_v1", "0.9.0", "current"> {\n'
        'def VHLO_CustomCallOpV1 : VHLO_Op<"custom_call_v1", "0.9.0", "1.17.0",\n'
        "    [Trait]> {\n"
        'def VHLO_CustomCallOpV2 : VHLO_Op<"custom_call_v2", "1.18.0", "current"> {\n'
    )
    assert script.parse_ops(td) == {
        "custom_call_v1": ("0.9.0", "1.17.0"),
        "custom_call_v2": ("1.18.0", "current"),
    }
    with pytest.raises(ValueError, match="layout changed"):
        script.parse_ops(td + 'def VHLO_X : VHLO_Op<"x_v1", "1.0", "current"> {\n')
    version_h = "static Version getCurrentVersion() { return Version(1, 20, 0); }"
    assert script.parse_current_version(version_h) == "1.20.0"
    built = script.build_table(td, version_h, "0" * 40)
    assert built["ops"] == {"custom_call_v1": "0.9.0", "custom_call_v2": "1.18.0"}
    assert built["retired"] == {"custom_call_v1": "1.17.0"}
    assert json.loads(json.dumps(built)) == built


# -- the check on its own -------------------------------------------------------------------------


class _Desc:
    def __init__(self, ops, producer="StableHLO_v1.18.0", jax_version=None):
        self.vhlo_ops, self.stablehlo_producer, self.jax_version = ops, producer, jax_version


def _run(desc, running="1.17.0", exporter=None):
    out = []
    stablehlo_ops.check(desc, running, exporter, lambda *r: out.append(r))
    return out


def test_check_refuses_a_newer_op_and_names_it():
    ((code, severity, message, action),) = _run(_Desc(("add_v1", "custom_call_v2")))
    assert (code, severity) == ("stablehlo", "incompatible")
    assert "vhlo.custom_call_v2 introduced in StableHLO 1.18.0" in message
    assert "StableHLO 1.18.0" in message and "up to 1.17.0" in message
    assert "add_v1" not in message
    assert action.startswith("Upgrade jax and jaxlib to a release whose StableHLO reads 1.18.0")
    assert "export the model again with this jax" in action
    # the exporter's jax: given, or recorded in the blob (a malformed one is not repeated)
    assert "to 0.12.0.1 or newer" in _run(_Desc(("custom_call_v2",)), exporter="0.12.0.1")[0][3]
    assert "to 0.12.0.1 or newer" in _run(_Desc(("custom_call_v2",), jax_version="0.12.0.1"))[0][3]
    assert "reads 1.18.0" in _run(_Desc(("custom_call_v2",), jax_version="0.12; rm -rf /"))[0][3]


def test_check_is_silent_when_every_op_is_known_or_the_producer_is_not_newer():
    assert _run(_Desc(("add_v1", "dot_general_v2", "tanh_v2"))) == []  # newer producer, runs
    assert _run(_Desc(("custom_call_v2",), producer="StableHLO_v1.17.0")) == []
    assert _run(_Desc(("custom_call_v2",)), running="1.18.0") == []
    assert _run(_Desc(("custom_call_v2",)), running=None) == []  # unknown jaxlib: skipped
    assert _run(_Desc(None)) == []  # unreadable module: skipped
    assert _run(_Desc(("custom_call_v2",), producer="MLIR20.0.0git")) == []  # not portable


def test_check_warns_about_ops_it_does_not_know():
    ((code, severity, message, action),) = _run(
        _Desc(("add_v1", "custom_call_v9"), producer="StableHLO_v1.30.0"), exporter="0.20.0"
    )
    assert (code, severity) == ("stablehlo", "warn")
    assert "vhlo.custom_call_v9" in message and "cannot be checked" in message
    assert "0.20.0" in action
    # a known too-new op decides: incompatible, whatever else is unknown
    both = _run(_Desc(("custom_call_v2", "custom_call_v9"), producer="StableHLO_v1.30.0"))
    assert [r[1] for r in both] == ["incompatible"]


# -- the verdict: against jaxlib 0.10.2 on any jax, and against the installed jax -----------------


def _codes(verdict, severity=None):
    return {r.code for r in verdict.reasons if severity is None or r.severity == severity}


def test_verdict_against_jaxlib_0_10_2_on_any_jax():
    env = compat.Environment.current().replace(**OLD_JAXLIB)
    poly = compat.assess({}, description=_describe(POLY), env=env)
    assert poly.status == "incompatible"
    (reason,) = [r for r in poly.reasons if r.code == "stablehlo"]
    assert reason.severity == "incompatible" and "custom_call_v2" in reason.message
    assert "Upgrade jax and jaxlib to 0.12.0.1 or newer" in reason.action  # the blob's own record
    # the recorded exporter (MLmodel) is named the same way
    meta = compat.assess({"jax_version": "0.12.0.1"}, description=_describe(POLY), env=env)
    assert "0.12.0.1 or newer" in next(r for r in meta.reasons if r.code == "stablehlo").action
    concrete = compat.assess({}, description=_describe(CONCRETE), env=env)
    assert "stablehlo" not in _codes(concrete)
    # a jaxlib that reads StableHLO 1.18.0 or later: no stablehlo reason for either
    for version in ("1.18.0", "1.22.0"):
        newer = env.replace(stablehlo_version=version)
        for name in (POLY, CONCRETE):
            assert "stablehlo" not in _codes(
                compat.assess({}, description=_describe(name), env=newer)
            )


def test_environment_records_the_stablehlo_version():
    env = compat.Environment.current()
    assert env.stablehlo_version == jax_private.stablehlo_version()
    assert env.stablehlo_version is not None and env.to_dict()["stablehlo_version"]


@pytest.mark.parametrize("name", [POLY, CONCRETE])
def test_verdict_agrees_with_the_installed_jax(name):
    verdict = compat.assess({}, description=_describe(name))
    refused = "stablehlo" in _codes(verdict, "incompatible")
    running = jax_private.stablehlo_version()
    expected = np.load(BLOBS / f"{name}.npz")["out_0"]
    if refused:
        assert name == POLY and _vkey(running) < (1, 18, 0)
        assert verdict.status == "incompatible"
        with pytest.raises(Exception, match="Failed to deserialize StableHLO"):  # noqa: PT011
            _call(name)
        return
    # not refused for its ops: it runs and reproduces the outputs of jax 0.12.0.1
    assert name == CONCRETE or _vkey(running) >= (1, 18, 0)
    (out,) = _call(name)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
    # nothing refuses it (on jax 0.10.2 schema 12 > 11 only warns: schema 12 adds the
    # writer's jax version, which jax 0.10.2 ignores), and it did run: no false refusal
    assert _codes(verdict, "incompatible") == set() and verdict.ok
