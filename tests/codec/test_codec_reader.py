"""The jax-free blob reader agrees with the corpus metadata and with ``jax.export.deserialize``."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxexp_mlflow.codec.reader import (
    BlobDescription,
    BlobFormatError,
    TreeNode,
    read_blob,
    read_blob_file,
)
from jaxexp_mlflow.codec.shardings import hlo_sharding_str

REPO = Path(__file__).resolve().parents[2]
CORPUS = Path(os.environ.get("JAXEXP_CORPUS", REPO.parent / "shared" / "corpus"))
from tests.conftest import corpus_refusals  # noqa: E402

BLOBS = sorted(CORPUS.glob("jax-*/*/exported.bin")) if CORPUS.is_dir() else []
# schema_generation detected for each writer (see docs/codec.md). jax 0.10.2 writes schema 11,
# but only a blob with a device mesh carries a v11-only field; the others are v10 byte for byte.
EXPECTED_GENERATION = {"0.4.35": 2, "0.6.2": 2, "0.8.3": 5, "0.10.2": 10}


def _blob_id(path: Path) -> str:
    return f"{path.parent.parent.name}/{path.parent.name}"


def _need_corpus() -> None:
    if not BLOBS:
        pytest.skip(f"no jax.export corpus at {CORPUS} (set JAXEXP_CORPUS)")


def _aval_str(a: dict) -> str:
    return f"{a['dtype']}[{','.join(a['shape'])}]"


def _none(x: str) -> str | None:
    return None if x == "None" else x


# -- corpus: exact values from meta.json ------------------------------------------------------


@pytest.mark.parametrize("path", BLOBS, ids=[_blob_id(p) for p in BLOBS])
def test_corpus_blob_matches_meta(path: Path) -> None:
    meta = json.loads((path.parent / "meta.json").read_text())
    raw = path.read_bytes()
    d = read_blob_file(path)
    assert d.fun_name == meta["fun_name"]
    assert d.platforms == tuple(meta["platforms"])
    assert d.nr_devices == meta["nr_devices"]
    assert d.in_avals == tuple(_aval_str(a) for a in meta["in_avals_struct"])
    assert d.out_avals == tuple(_aval_str(a) for a in meta["out_avals_struct"])
    assert d.in_tree_str() == meta["in_tree"]
    assert d.out_tree_str() == meta["out_tree"]
    assert d.calling_convention_version == meta["calling_convention_version_flatbuffer"]
    assert d.serialization_version == meta["serialization_version_flatbuffer"]
    assert d.module_kept_var_idx == tuple(meta["module_kept_var_idx"])
    assert d.uses_global_constants is meta["uses_global_constants"]
    assert d.vjp_order == meta["vjp_order"]
    assert d.custom_call_targets == tuple(meta["custom_call_targets"])
    assert d.ordered_effects == tuple(meta["ordered_effects"])
    assert d.unordered_effects == tuple(meta["unordered_effects"])
    assert d.disabled_safety_checks == tuple(meta["disabled_safety_checks"])
    assert d.size == meta["serialized_size_bytes"] == len(raw)
    assert d.sha256 == hashlib.sha256(raw).hexdigest()
    if "in_named_shardings" in meta:  # jax 0.10.2 blobs carry NamedShardings
        assert d.in_shardings == tuple(_none(s) for s in meta["in_named_shardings"])
        assert d.out_shardings == tuple(_none(s) for s in meta["out_named_shardings"])
    else:
        assert d.in_shardings == tuple(_none(s) for s in meta["in_shardings_hlo"])
        assert d.out_shardings == tuple(_none(s) for s in meta["out_shardings_hlo"])
    version = meta["jax_version"]
    expected_gen = EXPECTED_GENERATION[version]
    if version == "0.10.2" and meta["case"] == "sharded4":
        expected_gen = 11
    assert d.schema_generation == expected_gen
    assert d.schema_generation <= meta["serialization_version_source"]
    assert d.stablehlo_producer is not None and d.stablehlo_producer.startswith("StableHLO_v")
    assert d.module_error is None and d.unknown_fields == ()
    json.dumps(d.to_dict())  # JSON-able


def test_corpus_linalg_custom_calls_per_version() -> None:
    _need_corpus()
    got = {
        p.parent.parent.name: read_blob_file(p).custom_call_targets
        for p in BLOBS
        if p.parent.name == "linalg"
    }
    assert got["jax-0.4.35"] == ("blas_strsm", "lapack_sgetrf_ffi", "lapack_ssyevd_ffi")
    assert got["jax-0.10.2"] == ("lapack_sgetrf_ffi", "lapack_ssyevd_ffi", "lapack_strsm_ffi")


# -- agreement with jax.export.deserialize -----------------------------------------------------

_CUSTOM_CALL_RE = re.compile(r'custom_call\s*@"?([^\s("]+)|call_target_name\s*=\s*"([^"]*)"')


def _jax_custom_calls(exp) -> tuple[str, ...]:
    text = exp.mlir_module()
    return tuple(sorted({a or b for a, b in _CUSTOM_CALL_RE.findall(text)}))


def _jax_shardings(exp, side: str) -> tuple[str | None, ...]:
    from jaxexp_mlflow.internals import jax_private

    return tuple(
        None if s is None else (repr(s) if type(s).__name__ == "NamedSharding" else str(s))
        for s in jax_private.shardings(exp, side)
    )


def _assert_agrees_with_jax(d: BlobDescription, blob: bytes) -> None:
    from jax import export

    exp = export.deserialize(bytearray(blob))
    assert d.fun_name == exp.fun_name
    assert d.platforms == tuple(exp.platforms)
    assert d.nr_devices == exp.nr_devices
    assert d.in_avals == tuple(a.str_short() for a in exp.in_avals)
    assert d.out_avals == tuple(a.str_short() for a in exp.out_avals)
    assert d.in_tree_str() == str(exp.in_tree)
    assert d.out_tree_str() == str(exp.out_tree)
    assert d.in_tree.num_leaves == exp.in_tree.num_leaves
    assert d.in_shardings == _jax_shardings(exp, "in")
    assert d.out_shardings == _jax_shardings(exp, "out")
    assert d.ordered_effects == tuple(str(type(e)) for e in exp.ordered_effects)
    assert d.unordered_effects == tuple(str(type(e)) for e in exp.unordered_effects)
    assert d.disabled_safety_checks == tuple(str(c) for c in exp.disabled_safety_checks)
    assert d.calling_convention_version == exp.calling_convention_version
    assert d.module_kept_var_idx == tuple(exp.module_kept_var_idx)
    assert d.uses_global_constants == exp.uses_global_constants
    assert d.module_size == len(exp.mlir_module_serialized)
    assert d.custom_call_targets == _jax_custom_calls(exp)
    order, e = 0, exp
    while e.has_vjp():
        order, e = order + 1, e.vjp()
    assert d.vjp_order == order


@pytest.mark.parametrize("path", BLOBS, ids=[_blob_id(p) for p in BLOBS])
def test_corpus_blob_agrees_with_jax(path: Path, expired_flag: bool) -> None:
    # jax >= 0.11.1 reads schema < 5 blobs only with its flag (set by the fixture), and refuses
    # old-style (HLO) shardings whatever the flag: then the reader is checked against what the
    # writing jax recorded in meta.json, and JAX's refusal is asserted
    raw = path.read_bytes()
    d = read_blob(raw)
    if "hlo_sharding" in corpus_refusals(path.parent, expired_flag=True):
        from jax import export

        with pytest.raises(ValueError, match="backward-compatibility window"):
            export.deserialize(bytearray(raw))
        meta = json.loads((path.parent / "meta.json").read_text())
        assert len(d.in_avals) == len(meta["in_avals"])
        assert len(d.out_avals) == len(meta["out_avals"])
        assert d.nr_devices == meta["nr_devices"] == 4 and d.fun_name == meta["fun_name"]
        assert all(s is not None and not s.startswith("NamedSharding") for s in d.in_shardings)
        return
    _assert_agrees_with_jax(d, raw)


DTYPES = [
    "bool",
    "int4",
    "uint4",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "float8_e4m3b11fnuz",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e4m3",
    "float8_e3m4",
    "float8_e8m0fnu",
    "float4_e2m1fn",
    "key<fry>",
]
DIMS = [0, 1, 2, 3, "a", "b", "2*a"]
_LEAF = object()

_keys = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=4)
_trees = st.recursive(
    st.one_of(st.just(_LEAF), st.none()),
    lambda ch: st.one_of(
        st.lists(ch, max_size=3),
        st.lists(ch, max_size=3).map(tuple),
        st.dictionaries(_keys, ch, max_size=3),
    ),
    max_leaves=6,
)


def _fill(tree, draw_leaf):
    """Replace the _LEAF markers of a generated tree with ShapeDtypeStructs."""
    if tree is _LEAF:
        return draw_leaf()
    if isinstance(tree, list):
        return [_fill(t, draw_leaf) for t in tree]
    if isinstance(tree, tuple):
        return tuple(_fill(t, draw_leaf) for t in tree)
    if isinstance(tree, dict):
        return {k: _fill(v, draw_leaf) for k, v in tree.items()}
    return tree


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    args=st.lists(_trees, max_size=3),
    kwargs=st.dictionaries(st.sampled_from(["x", "y", "params", "batch"]), _trees, max_size=2),
    out_tree=_trees,
    platforms=st.lists(
        st.sampled_from(["cpu", "cuda", "tpu", "rocm"]), min_size=1, max_size=3, unique=True
    ),
    vjp_order=st.integers(0, 3),
    disabled=st.lists(st.sampled_from(["platform", "my_custom_target"]), unique=True),
)
def test_reader_agrees_with_jax_on_generated_exports(
    data, args, kwargs, out_tree, platforms, vjp_order, disabled
) -> None:
    import jax
    from jax import export

    a, b = export.symbolic_shape("a, b")
    symbols = {"a": a, "b": b, "2*a": 2 * a}

    def draw_leaf():
        dtype_name = data.draw(st.sampled_from(DTYPES), label="dtype")
        if dtype_name.startswith("key<"):
            dtype = jax.random.key(0).dtype
            differentiable_ok[0] = False
        else:
            dtype = jax.numpy.dtype(dtype_name)
        dims = data.draw(st.lists(st.sampled_from(DIMS), max_size=3), label="shape")
        return jax.ShapeDtypeStruct(tuple(symbols.get(d, d) for d in dims), dtype)

    differentiable_ok = [True]
    with jax.enable_x64(True):
        in_args = tuple(_fill(t, draw_leaf) for t in args)
        in_kwargs = {k: _fill(t, draw_leaf) for k, t in kwargs.items()}
        n_in = len(jax.tree.leaves((in_args, in_kwargs)))
        out_picks = []

        def pick():
            i = data.draw(st.integers(0, max(n_in - 1, 0)), label="out leaf")
            out_picks.append(i)
            return i

        out_struct = _fill(out_tree, pick) if n_in else jax.tree.map(lambda _: None, out_tree)

        def fun(*args, **kwargs):
            leaves = jax.tree.leaves((args, kwargs))
            return jax.tree.map(lambda i: leaves[i], out_struct)

        fun.__name__ = "generated_fun"
        checks = [
            export.DisabledSafetyCheck.platform()
            if c == "platform"
            else export.DisabledSafetyCheck.custom_call(c)
            for c in disabled
        ]
        exp = export.export(jax.jit(fun), platforms=platforms, disabled_checks=checks)(
            *in_args, **in_kwargs
        )
        order = vjp_order if differentiable_ok[0] else 0
        blob = bytes(exp.serialize(vjp_order=order))
        d = read_blob(blob)
        _assert_agrees_with_jax(d, blob)
        assert d.vjp_order == order
        assert d.fun_name == "generated_fun"
        assert d.platforms == tuple(platforms)


def test_custom_pytree_node_is_read_as_custom() -> None:
    import jax
    import jax.numpy as jnp
    from jax import export

    Point = namedtuple("Point", ["x", "y"])
    try:
        export.register_namedtuple_serialization(Point, serialized_name="tests.codec.Point")
    except ValueError:  # already registered in this process
        pass
    exp = export.export(jax.jit(lambda p: Point(p.y, p.x)))(
        Point(jax.ShapeDtypeStruct((2,), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32))
    )
    d = read_blob(bytes(exp.serialize()))
    point = d.in_tree.children[0].children[0]
    assert point.kind == "custom" and point.custom_name == "tests.codec.Point"
    assert [c.kind for c in point.children] == ["leaf", "leaf"]
    assert d.out_tree.kind == "custom" and d.out_tree.num_leaves == 2
    assert d.in_avals == ("float32[2]", "int32[]")
    assert d.schema_generation >= 3
    assert "CustomNode(tests.codec.Point" in d.in_tree_str()


# -- API details ----------------------------------------------------------------------------


def test_accepts_bytes_like_and_rejects_other_types(tmp_path: Path) -> None:
    _need_corpus()
    raw = BLOBS[0].read_bytes()
    expected = read_blob(raw)
    assert read_blob(bytearray(raw)) == expected
    assert read_blob(memoryview(raw)) == expected
    (tmp_path / "b.bin").write_bytes(raw)
    assert read_blob_file(tmp_path / "b.bin") == expected
    assert read_blob_file(str(tmp_path / "b.bin")) == expected
    with pytest.raises(TypeError):
        read_blob("not bytes")  # type: ignore[arg-type]
    with pytest.raises(BlobFormatError, match="at least 8 bytes"):
        read_blob(b"")


def test_to_dict_is_json_and_complete() -> None:
    _need_corpus()
    path = next(p for p in BLOBS if p.parent.name == "pytree_io")
    d = read_blob_file(path)
    out = json.loads(json.dumps(d.to_dict()))
    assert out["in_tree_str"] == d.in_tree_str()
    assert out["in_tree"]["kind"] == "tuple"
    assert out["in_avals"] == list(d.in_avals)
    assert out["sha256"] == d.sha256
    assert set(BlobDescription.__dataclass_fields__) <= set(out)


def test_tree_str_rendering() -> None:
    leaf, none = TreeNode("leaf"), TreeNode("none")
    t = TreeNode(
        "tuple",
        (
            TreeNode("tuple", (leaf,)),
            TreeNode("dict", (leaf, TreeNode("list", (none, leaf))), keys=("a", "b'c")),
        ),
    )
    assert t.tree_str() == "PyTreeDef(((*,), {'a': *, \"b'c\": [None, *]}))"
    assert t.num_leaves == 3


@pytest.mark.parametrize(
    "kwargs",
    [
        {"type": "REPLICATED"},
        {"type": "MAXIMAL", "tile_assignment_devices": [3]},
        {"type": "MANUAL"},
        {
            "type": "OTHER",
            "tile_assignment_dimensions": [4, 1],
            "iota_reshape_dims": [4],
            "iota_transpose_perm": [0],
        },
        {
            "type": "OTHER",
            "tile_assignment_dimensions": [2, 2],
            "iota_reshape_dims": [2, 2],
            "iota_transpose_perm": [1, 0],
        },
        {
            "type": "OTHER",
            "tile_assignment_dimensions": [2, 2],
            "tile_assignment_devices": [0, 2, 1, 3],
        },
        {
            "type": "OTHER",
            "tile_assignment_dimensions": [2, 1, 2],
            "iota_reshape_dims": [4],
            "iota_transpose_perm": [0],
            "replicate_on_last_tile_dim": True,
        },
        {
            "type": "OTHER",
            "tile_assignment_dimensions": [2, 2, 2],
            "tile_assignment_devices": list(range(8)),
            "last_tile_dims": ["MANUAL", "REPLICATED"],
        },
    ],
)
def test_hlo_sharding_text_matches_xla(kwargs: dict) -> None:
    from jaxexp_mlflow.internals.jax_private import xla_client

    xc = xla_client()
    assert xc is not None and hasattr(xc, "OpSharding"), "jaxlib's xla_client moved"

    types = xc.OpSharding.Type
    proto = xc.OpSharding()
    for k, v in kwargs.items():
        if k == "type":
            v = getattr(types, v)
        elif k == "last_tile_dims":
            v = [getattr(types, x) for x in v]
        setattr(proto, k, v)
    expected = str(xc.HloSharding.from_proto(proto))
    assert hlo_sharding_str(proto.SerializeToString()) == expected


def test_reader_imports_no_jax_numpy_mlflow_or_flatbuffers() -> None:
    _need_corpus()
    code = (
        "import sys\n"
        "from jaxexp_mlflow.codec.reader import read_blob_file\n"
        f"d = read_blob_file({str(BLOBS[0])!r})\n"
        "heavy = [m for m in ('jax', 'jaxlib', 'numpy', 'mlflow', 'flatbuffers') "
        "if m in sys.modules]\n"
        "print(d.fun_name, heavy)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.strip().endswith("[]"), out


# -- custom calls on the installed jax: targets and (target, operands, results) ---------------


def _mlir_custom_calls(exp) -> list[tuple[str, int, int]]:
    """(target, operand count, result count) of every custom call of ``exp.mlir_module()``, read
    by MLIR's own parser (jaxlib's bindings), in module order."""
    from jaxexp_mlflow.internals.jax_private import portable_artifact_api

    api = portable_artifact_api()
    assert api is not None, "jaxlib's MLIR bindings (internals/jax_private) are gone"
    make_ir_context, ir, _ = api
    calls: list[tuple[str, int, int]] = []

    def visit(op) -> None:
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    child = child.operation
                    if child.name in ("stablehlo.custom_call", "mhlo.custom_call"):
                        target = ir.StringAttr(child.attributes["call_target_name"]).value
                        calls.append((target, len(child.operands), len(child.results)))
                    visit(child)

    with make_ir_context():
        visit(ir.Module.parse(exp.mlir_module()).operation)
    return calls


def _linalg_solve(a, y):
    import jax.numpy as jnp

    return jnp.linalg.solve(a, y)


def _linalg_eigh(a):
    import jax.numpy as jnp

    w, v = jnp.linalg.eigh(a)
    return w, v


def _linalg_both(a, y):
    import jax.numpy as jnp

    return jnp.linalg.solve(a, y), jnp.linalg.eigh(a)[0]


# (function, input shapes; "b" is a symbolic batch dimension, "a" a symbolic size)
_CUSTOM_CALL_CASES = {
    "shape_assertion": (lambda x, y: x[: y.shape[0]] + y, [("a",), ("a",)]),
    "shape_assertion_2a": (lambda x: x.reshape(2, -1), [("2*a",)]),
    "solve": (_linalg_solve, [(3, 3), (3, 2)]),
    "solve_batch": (_linalg_solve, [("b", 3, 3), ("b", 3, 1)]),
    "eigh": (_linalg_eigh, [(4, 4)]),
    "eigh_batch": (_linalg_eigh, [("b", 4, 4)]),
    "solve_eigh_batch": (_linalg_both, [("b", 3, 3), ("b", 3, 1)]),
}


@pytest.mark.parametrize("case", sorted(_CUSTOM_CALL_CASES))
def test_reader_custom_calls_agree_with_mlir_text(case: str) -> None:
    """The jax-free reader finds the custom calls the installed jax writes (StableHLO 1.15 with
    ``vhlo.custom_call_v1`` on jax 0.10, 1.18 with ``vhlo.custom_call_v2`` on jax 0.12)."""
    import jax
    import jax.numpy as jnp
    from jax import export

    fun, shapes = _CUSTOM_CALL_CASES[case]
    a, b = export.symbolic_shape("a, b")
    dims = {"a": a, "b": b, "2*a": 2 * a}
    args = [
        jax.ShapeDtypeStruct(tuple(dims.get(d, d) for d in shape), jnp.float32) for shape in shapes
    ]
    exp = export.export(jax.jit(fun), platforms=["cpu"])(*args)
    blob = bytes(exp.serialize())
    d = read_blob(blob)
    expected = _mlir_custom_calls(exp)
    assert expected, f"{case}: the export has no custom call to check"
    assert d.module_error is None
    assert d.custom_call_targets == tuple(sorted({t for t, _, _ in expected}))
    assert d.custom_call_targets == _jax_custom_calls(exp)  # the regex on the text agrees
    assert d.custom_calls == tuple(sorted(set(expected)))
    symbolic = any(isinstance(x, str) for shape in shapes for x in shape)
    assert ("shape_assertion" in d.custom_call_targets) == symbolic
    if case.startswith("solve"):
        assert {"lapack_sgetrf_ffi", "lapack_strsm_ffi"} <= set(d.custom_call_targets)
    if "eigh" in case:
        assert "lapack_ssyevd_ffi" in d.custom_call_targets
    assert d.stablehlo_producer is not None and d.stablehlo_producer.startswith("StableHLO_v")


def test_unknown_vhlo_custom_call_version_is_reported_not_missed() -> None:
    """A ``vhlo.custom_call_vN`` this reader does not know makes the targets unknown (None, with
    ``module_error``): never an empty tuple, which would claim "no custom calls"."""
    import jax
    import jax.numpy as jnp
    from jax import export

    a, b = export.symbolic_shape("a, b")
    exp = export.export(jax.jit(_linalg_solve), platforms=["cpu"])(
        jax.ShapeDtypeStruct((b, 3, 3), jnp.float32), jax.ShapeDtypeStruct((b, 3, 1), jnp.float32)
    )
    blob = bytes(exp.serialize())
    assert read_blob(blob).custom_call_targets  # read as written
    names = re.findall(rb"custom_call_v[0-9]", blob)
    assert len(set(names)) == 1, names  # one op name in the module's string table
    for newer in (b"custom_call_v9", b"custom_call_v0"):
        d = read_blob(blob.replace(names[0], newer))
        assert d.custom_call_targets is None and d.custom_calls is None
        assert d.module_error is not None
        assert f"vhlo.{newer.decode()}" in d.module_error and "does not know" in d.module_error
        assert d.fun_name == exp.fun_name  # the rest of the blob is still described


def test_schema_history_is_one_table() -> None:
    """``codec.schema.SCHEMA_HISTORY`` is the schema's history: the compatibility verdict and
    docs/codec.md take theirs from it, and the reader's evidence constants are its versions."""
    import datetime as dt

    from jaxexp_mlflow.codec import schema
    from jaxexp_mlflow.runtime import compat

    numbers = [v.number for v in schema.SCHEMA_HISTORY]
    assert numbers == sorted(numbers) and 7 not in numbers  # 7 was pulled back by JAX
    dates = [v.date for v in schema.SCHEMA_HISTORY]
    assert dates == sorted(dates)
    assert compat.SCHEMA_DATES is schema.SCHEMA_DATES and compat.SCHEMA_DATES[5] == dt.date(
        2025, 11, 23
    )
    assert compat.BREAKING_SCHEMAS == (5, 10) and compat.ENFORCING_JAX is schema.ENFORCING_JAX
    evidence = {v for k, v in vars(schema).items() if k.startswith("SCHEMA_") and type(v) is int}
    assert evidence <= set(numbers) and schema.OLDEST_SCHEMA_READ_BY_ENFORCING_JAX in numbers
    doc = (Path(__file__).parents[2] / "docs" / "codec.md").read_text()
    section = doc.split("### Schema generations", 1)[1].split("###", 1)[0]
    rows = re.findall(r"^\| (\d+) \| [^|]*\((\w{3})\w* (\d{4})", section, flags=re.M)
    assert [int(n) for n, _, _ in rows] == numbers
    for (_, month, year), v in zip(rows, schema.SCHEMA_HISTORY, strict=True):
        assert (month, int(year)) == (v.date.strftime("%b"), v.date.year), v
