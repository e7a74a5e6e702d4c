"""Damaged and hostile blobs: the reader raises BlobFormatError (naming the fault) or returns a
description, never anything else, and its work stays linear in the blob size.

Default run: a few hundred hypothesis examples per property (seconds). Longer run:
``HYPOTHESIS_PROFILE=long pytest tests/codec/test_codec_fuzz.py`` (20k examples per property), or
``JAXEXP_FUZZ_EXAMPLES=N``. A coverage-guided target for atheris is in
``benchmarks/fuzz_codec_atheris.py`` (see docs/codec.md).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import flatbuffers
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxexp_mlflow.codec.mlir_bytecode import MlirModuleInfo, scan_module
from jaxexp_mlflow.codec.reader import BlobDescription, BlobFormatError, read_blob
from jaxexp_mlflow.codec.schema import Budget, ExportedSlots, PyTreeDefSlots, root_table

REPO = Path(__file__).resolve().parents[2]
CORPUS = Path(os.environ.get("JAXEXP_CORPUS", REPO.parent / "shared" / "corpus"))

_LONG = os.environ.get("HYPOTHESIS_PROFILE") == "long"
EXAMPLES = int(os.environ.get("JAXEXP_FUZZ_EXAMPLES", 20_000 if _LONG else 300))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# A tiny valid MLIR bytecode module would need a full writer; the reader tolerates any module
# bytes (it reports custom_call_targets=None), so crafted blobs carry this header only.
_MODULE = b"ML\xefR\x0dcrafted\x00"


def _seeds() -> list[bytes]:
    blobs = sorted(CORPUS.glob("jax-*/*/exported.bin")) if CORPUS.is_dir() else []
    if blobs:
        # One blob per case and version is plenty; keep the smallest and the most varied.
        return [p.read_bytes() for p in blobs]
    return [_crafted()]


# -- a minimal flatbuffer writer for crafted Exported blobs ----------------------------------


def _vector(b: flatbuffers.Builder, offsets: list[int]) -> int:
    b.StartVector(4, len(offsets), 4)
    for off in reversed(offsets):
        b.PrependUOffsetTRelative(off)
    return b.EndVector()


def _tree_node(b: flatbuffers.Builder, kind: int, children: list[int] | None = None) -> int:
    vec = _vector(b, children) if children else None
    b.StartObject(5)
    if kind:
        b.PrependInt8Slot(PyTreeDefSlots.kind, kind, 0)
    if vec is not None:
        b.PrependUOffsetTRelativeSlot(PyTreeDefSlots.children, vec, 0)
    return b.EndObject()


def _exported(
    b: flatbuffers.Builder, in_tree=None, n_in_avals: int = 0, fun_name: str = "crafted", vjp=None
) -> int:
    """An Exported table with the required fields; ``in_tree`` builds the input tree."""
    name = b.CreateString(fun_name)
    module = b.CreateByteVector(_MODULE)
    tree = in_tree(b) if in_tree else _tree_node(b, 2, [_tree_node(b, 2), _tree_node(b, 4)])
    out_tree = _tree_node(b, 2)
    avals = []
    for _ in range(n_in_avals):
        b.StartObject(4)
        b.PrependInt8Slot(2, 10, 0)  # float32, shape []
        avals.append(b.EndObject())
    in_avals = _vector(b, avals)
    b.StartObject(ExportedSlots.KNOWN)
    b.PrependUint16Slot(ExportedSlots.serialization_version, 3, 0)
    b.PrependUOffsetTRelativeSlot(ExportedSlots.function_name, name, 0)
    b.PrependUOffsetTRelativeSlot(ExportedSlots.in_tree, tree, 0)
    b.PrependUOffsetTRelativeSlot(ExportedSlots.in_avals, in_avals, 0)
    b.PrependUOffsetTRelativeSlot(ExportedSlots.out_tree, out_tree, 0)
    b.PrependUOffsetTRelativeSlot(ExportedSlots.mlir_module_serialized, module, 0)
    b.PrependUint16Slot(ExportedSlots.calling_convention_version, 10, 0)
    if vjp is not None:
        b.PrependUOffsetTRelativeSlot(ExportedSlots.vjp, vjp, 0)
    b.PrependUint32Slot(ExportedSlots.nr_devices, 1, 0)
    return b.EndObject()


def _crafted(in_tree=None, n_in_avals: int = 0, vjp_levels: int = 0) -> bytes:
    b = flatbuffers.Builder(1024)
    vjp = None
    for level in range(vjp_levels):
        vjp = _exported(b, fun_name=f"vjp{vjp_levels - level}", vjp=vjp)
    b.Finish(_exported(b, in_tree, n_in_avals, vjp=vjp))
    return bytes(b.Output())


SEEDS = _seeds()


def _check(data: bytes) -> BlobDescription | None:
    """The fuzz invariant: a description or a BlobFormatError with a message, nothing else."""
    try:
        d = read_blob(data)
    except BlobFormatError as e:
        assert str(e), "BlobFormatError without a message"
        return None
    assert isinstance(d, BlobDescription)
    assert d.size == len(data)
    assert d.custom_call_targets is None or all(isinstance(t, str) for t in d.custom_call_targets)
    return d


# -- properties -------------------------------------------------------------------------------


def test_crafted_blob_reads() -> None:
    d = read_blob(_crafted())
    assert d.fun_name == "crafted" and d.in_tree_str() == "PyTreeDef(((), {}))"
    assert d.stablehlo_producer == "crafted" and d.custom_call_targets is None
    assert d.module_error  # header only: the sections are missing


@pytest.mark.parametrize("seed", range(len(SEEDS)))
def test_every_truncation_is_rejected(seed: int) -> None:
    data = SEEDS[seed]
    step = max(1, len(data) // 97)
    # Cutting only the final alignment padding leaves every referenced byte in place; anything
    # shorter loses the first-written object (a string) or more.
    for cut in range(0, len(data) - 3, step):
        with pytest.raises(BlobFormatError):
            read_blob(data[:cut])


@FUZZ
@given(seed=st.sampled_from(range(len(SEEDS))), data=st.data())
def test_bit_flips(seed: int, data: st.DataObject) -> None:
    blob = bytearray(SEEDS[seed])
    for pos in data.draw(st.lists(st.integers(0, len(blob) - 1), min_size=1, max_size=8)):
        blob[pos] ^= 1 << data.draw(st.integers(0, 7))
    _check(bytes(blob))


@FUZZ
@given(seed=st.sampled_from(range(len(SEEDS))), data=st.data())
def test_overwritten_words(seed: int, data: st.DataObject) -> None:
    """Offsets, lengths and vtable entries replaced by extreme or nearby values."""
    blob = bytearray(SEEDS[seed])
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(blob) - 4)) & ~3 if len(blob) >= 4 else 0
        word = data.draw(
            st.one_of(
                st.sampled_from(
                    [0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, len(blob), len(blob) - 4]
                ),
                st.integers(0, 0xFFFFFFFF),
            )
        )
        blob[pos : pos + 4] = struct.pack("<I", word)
    _check(bytes(blob))


@FUZZ
@given(data=st.binary(max_size=4096))
def test_random_bytes(data: bytes) -> None:
    _check(data)


@FUZZ
@given(seed=st.sampled_from(range(len(SEEDS))), data=st.data())
def test_spliced_blobs(seed: int, data: st.DataObject) -> None:
    """Pieces of two valid blobs glued together: valid-looking tables at wrong offsets."""
    a, b = SEEDS[seed], data.draw(st.sampled_from(SEEDS))
    i, j = data.draw(st.integers(0, len(a))), data.draw(st.integers(0, len(b)))
    _check(a[:i] + b[j:])


@FUZZ
@given(module=st.binary(max_size=2048), prefix=st.booleans())
def test_mlir_scanner_never_raises(module: bytes, prefix: bool) -> None:
    data = (b"ML\xefR\x0dStableHLO_v1.0.0\x00" + module) if prefix else module
    info = scan_module(data)
    assert isinstance(info, MlirModuleInfo)
    assert (info.custom_call_targets is None) == (info.error is not None)


@pytest.mark.parametrize("seed", range(len(SEEDS)))
def test_mlir_module_damage_is_reported_not_raised(seed: int) -> None:
    d = read_blob(SEEDS[seed])
    module_start = SEEDS[seed].find(b"ML\xefR")
    for cut in range(8, d.module_size, max(1, d.module_size // 50)):
        info = scan_module(SEEDS[seed][module_start : module_start + cut])
        # A cut exactly after the last required section leaves a valid module.
        assert info.custom_call_targets in (None, d.custom_call_targets)
        assert (info.custom_call_targets is None) == (info.error is not None)


# -- targeted hostile blobs -------------------------------------------------------------------


def _root_field(data: bytes, slot: int) -> int:
    """Absolute position of an offset field of the root table."""
    t = root_table(data, "Exported", Budget(10**6))
    return t._field(slot, 4, "x")


def test_offset_outside_buffer_is_named() -> None:
    data = bytearray(SEEDS[0])
    data[0:4] = struct.pack("<I", len(data) + 100)
    with pytest.raises(BlobFormatError, match="outside the"):
        read_blob(bytes(data))
    data = bytearray(SEEDS[0])
    p = _root_field(bytes(data), ExportedSlots.in_tree)
    data[p : p + 4] = struct.pack("<I", 0x7FFFFFF0)
    with pytest.raises(BlobFormatError, match=r"Exported\.in_tree"):
        read_blob(bytes(data))


def test_huge_vector_length_is_rejected_without_allocating() -> None:
    data = bytearray(SEEDS[0])
    p = _root_field(bytes(data), ExportedSlots.platforms)
    vec = p + struct.unpack_from("<I", data, p)[0]
    data[vec : vec + 4] = struct.pack("<I", 0xFFFFFFFF)
    with pytest.raises(BlobFormatError, match=r"Exported\.platforms: vector of 4294967295"):
        read_blob(bytes(data))


def test_non_utf8_string_is_named() -> None:
    data = bytearray(SEEDS[0])
    p = _root_field(bytes(data), ExportedSlots.function_name)
    s = p + struct.unpack_from("<I", data, p)[0]
    data[s + 4] = 0xFF
    with pytest.raises(
        BlobFormatError, match=r"Exported\.function_name: string is not valid UTF-8"
    ):
        read_blob(bytes(data))


def test_deeply_nested_tree_is_rejected() -> None:
    """Offsets are unsigned, so a reference always points further into the buffer and cycles
    cannot be expressed; nesting depth is what must be bounded."""

    def chain(b: flatbuffers.Builder) -> int:
        node = _tree_node(b, 0)
        for _ in range(300):
            node = _tree_node(b, 3, [node])
        return node

    with pytest.raises(BlobFormatError, match=r"Exported\.in_tree(\.children\[0\])+: .*deeper"):
        read_blob(_crafted(chain))


def test_exponential_dag_is_rejected_by_the_budget() -> None:
    """Each node's two children are the same table: 2**60 paths in a few hundred bytes."""

    def dag(b: flatbuffers.Builder) -> int:
        node = _tree_node(b, 0)
        for _ in range(60):
            node = _tree_node(b, 2, [node, node])
        return node

    with pytest.raises(BlobFormatError, match="more than .* tables/elements"):
        read_blob(_crafted(dag))


def test_vjp_chain_depth_is_counted() -> None:
    assert read_blob(_crafted(vjp_levels=3)).vjp_order == 3


def test_overlong_vjp_chain_is_rejected() -> None:
    with pytest.raises(BlobFormatError, match="vjp: chain deeper than 200"):
        read_blob(_crafted(vjp_levels=201))


def test_tree_and_avals_disagree() -> None:
    with pytest.raises(BlobFormatError, match="in_tree: has 0 leaves but in_avals has 2"):
        read_blob(_crafted(n_in_avals=2))
