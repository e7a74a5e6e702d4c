"""Compile for XLA:CPU, choosing per executable two of XLA's defaults that can cost the memory.

**Reductions on YNNPACK.** XLA:CPU (jaxlib 0.10-0.12 at least) hands dots, convolutions and
reductions to YNNPACK by default (``xla_cpu_experimental_ynn_fusion_type``). Around reductions
it builds big YNNPACK fusions, and where such a fusion cannot hold a broadcast it takes it as an
input that XLA fills in memory first: a transformer encoder at a large batch gets several of
those (LayerNorm, softmax and GELU constants broadcast up to ``[rows, tokens, hidden]``), most
of its temporaries, fresh pages on every call and a slower call than with reductions left to
XLA (docs/serving/batching.md, "Reductions and YNNPACK"). A CNN's pooling needs the offload the
other way round (XLA's own ``reduce-window`` is several times slower there), so no single setting is
right and none is set process-wide.

**Converted copies hoisted out of loops.** XLA's while-loop-invariant code motion moves a loop's
invariant instructions before it, converts included: a bfloat16 decoder's decode loop then
starts by converting every weight to float32 (most of its temporaries), and each step reads
those f32 copies, twice the bytes of the weights. Left in the loop, each layer's weights are
converted as the step reaches them: a fraction of the temporaries, and a faster ``generate``
(docs/serving/batching.md, "Loop-invariant converts"). The pass also hoists what is worth hoisting
(an invariant matmul run once instead of once a step), so it is turned off only where it moved no
dot or convolution out of a loop.

:func:`compile_lowered` compiles with XLA's defaults first. Only when that executable runs on
the CPU and needs more than :data:`TEMP_BYTES` of temporaries does it look at its optimized
module: a quarter or more of the temporaries broadcasts filled for YNNPACK fusions asks for
:data:`LEAN_OPTIONS`; a quarter or more converted copies made before the loops (instructions
of the entry computation) asks for :data:`LOOP_OPTIONS`. It then compiles once more with what
was asked (``compiler_options`` of that one compile) and keeps that executable when it needs at
most half the temporaries and, with :data:`LOOP_OPTIONS`, has no more dots and convolutions
inside loops than the default. The choice is a function of the module and this jaxlib only, so
an executable stored under a key that names both stays valid. ``JAXEXP_CPU_YNN_CHOICE=0``
turns both off.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from jaxexp_mlflow import settings as env_settings

_logger = logging.getLogger(__name__)

#: Below this many bytes of temporaries an executable is kept as XLA's defaults make it.
TEMP_BYTES = 32 * 1024**2
_OPTION = "xla_cpu_experimental_ynn_fusion_type"
#: XLA's default offload minus ``REDUCE`` (the jaxlib 0.10-0.12 default is these two plus it).
LEAN_OPTIONS = {
    _OPTION: "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION"
}
#: XLA's while-loop-invariant code motion left out of a compile (a pass name XLA's
#: ``xla_disable_hlo_passes`` takes).
_LOOP_OPTION = "xla_disable_hlo_passes"
LOOP_OPTIONS = {_LOOP_OPTION: "while-loop-invariant-code-motion"}
_unsupported: set[str] = set()  # options a jaxlib refused: never asked again in this process


def enabled() -> bool:
    """Whether the choices are made (``JAXEXP_CPU_YNN_CHOICE``, default on; the name is the
    first choice's, kept for the environments that set it)."""
    return env_settings.JAXEXP_CPU_YNN_CHOICE.get()


def settings() -> dict[str, Any]:
    """What of this module decides an executable, for the keys of stored executables."""
    return {
        "ynn_choice": enabled(),
        "temp_bytes": TEMP_BYTES,
        "lean": LEAN_OPTIONS,
        "loop": LOOP_OPTIONS,
    }


def temp_bytes(compiled: Any) -> int | None:
    """The temporaries XLA states for a compiled executable (bytes), None where it states none."""
    try:
        return int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - a backend or executable without the analysis
        return None


def _array_bytes(kind: str, bits: str, dims: str) -> int:
    """The bytes of an HLO array type read as ``f32[4,8]`` -> ``("f", "32", "4,8")``."""
    size = max(1, int(bits or 8) // 8) if kind != "pred" else 1
    for d in filter(None, dims.split(",")):
        size *= int(d)
    return size


_BROADCAST = re.compile(r"%wrapped_broadcast[.\d]* = ([a-z]+)(\d*)\[([\d,]*)\]")


def broadcast_bytes(hlo_text: str) -> int:
    """The bytes of the broadcasts an optimized HLO module fills in memory as instructions of
    their own (``wrapped_broadcast`` fusions): what YNNPACK fusions take as inputs."""
    return sum(_array_bytes(*found) for found in _BROADCAST.findall(hlo_text))


_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) \(.*\{$", re.M)
_CALLED = re.compile(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)")
_CALLED_SETS = re.compile(r"(?:branch_computations|called_computations)=\{([^}]*)\}")
_LOOP = re.compile(
    r" while\([^\n]*?(?:condition|body)=%([\w.\-]+)[^\n]*?(?:condition|body)=%([\w.\-]+)"
)
_HEAVY = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = \S+ (?:dot|convolution)\(", re.M)


def _computations(hlo_text: str) -> dict[str, tuple[str, bool]]:
    """``{name: (text, is the entry)}`` of an optimized HLO module's computations."""
    heads = list(_HEADER.finditer(hlo_text))
    out = {}
    for i, head in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(hlo_text)
        out[head.group(2)] = (hlo_text[head.start() : end], bool(head.group(1)))
    return out


_PARAMETER = re.compile(
    r"^\s*%([\w.\-]+) = ([a-z]+\d*)\[([\d,]*)\](?:\{[^}]*\})? parameter\(", re.M
)
_ONE_OPERAND = re.compile(
    r"^\s*%[\w.\-]+ = ([a-z]+)(\d*)\[([\d,]*)\](?:\{[^}]*\})? [\w\-]+\(%([\w.\-]+)\)", re.M
)


def hoisted_convert_bytes(hlo_text: str) -> int:
    """The bytes of the converted copies of its inputs an optimized HLO module makes in its
    entry computation, before any loop (where loop-invariant code motion puts a loop's
    converted inputs): instructions of one operand, an entry parameter of the same shape and
    another element type (``wrapped_convert`` fusions in jaxlib 0.10, ``parallel_convert``
    calls in 0.6)."""
    entry = [text for text, is_entry in _computations(hlo_text).values() if is_entry]
    if not entry:
        return 0
    params = {name: (kind, dims) for name, kind, dims in _PARAMETER.findall(entry[0])}
    total = 0
    for kind, bits, dims, operand in _ONE_OPERAND.findall(entry[0]):
        given = params.get(operand)
        if given is None or given[1] != dims or given[0] == kind + bits or kind == "pred":
            continue
        total += _array_bytes(kind, bits, dims)
    return total


def loop_heavy_ops(hlo_text: str) -> int:
    """The dots and convolutions an optimized HLO module runs inside its while loops (in the
    computations their bodies and conditions call, fusions and YNNPACK fusions included)."""
    comps = _computations(hlo_text)
    todo = [name for pair in _LOOP.findall(hlo_text) for name in pair]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        text = comps[name][0]
        todo += _CALLED.findall(text)
        for group in _CALLED_SETS.findall(text):
            todo += [x.strip().lstrip("%") for x in group.split(",") if x.strip()]
    return sum(len(_HEAVY.findall(comps[name][0])) for name in seen)


def _on_cpu(compiled: Any) -> bool:
    """Whether ``compiled`` runs on CPU devices (its shardings say; a GPU module's text is
    never read)."""
    import jax

    try:
        shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
        return bool(shardings) and all(d.platform == "cpu" for s in shardings for d in s.device_set)
    except Exception:  # noqa: BLE001 - shardings a release does not state
        return False


def options_for(default: Any) -> dict[str, str]:
    """The compile options worth a second compile of an executable compiled with XLA's
    defaults (``{}``: none): :data:`LEAN_OPTIONS` where a quarter or more of its temporaries
    are broadcasts filled for YNNPACK fusions, :data:`LOOP_OPTIONS` where a quarter or more are
    converted copies made before its loops; only above :data:`TEMP_BYTES` of temporaries."""
    return _judge(default)[0]


def _judge(default: Any) -> tuple[dict[str, str], str]:
    """:func:`options_for` and the module text it read (``""`` where it read none)."""
    if not enabled():
        return {}, ""
    temp = temp_bytes(default)
    if temp is None or temp <= TEMP_BYTES or not _on_cpu(default):
        return {}, ""
    try:
        text = default.as_text()
    except Exception:  # noqa: BLE001 - no text: nothing to judge by
        return {}, ""
    asked: dict[str, str] = {}
    if "__ynn_fusion" in text and 4 * broadcast_bytes(text) >= temp:
        asked.update(LEAN_OPTIONS)
    if " while(" in text and 4 * hoisted_convert_bytes(text) >= temp:
        asked.update(LOOP_OPTIONS)
    return {k: v for k, v in asked.items() if k not in _unsupported}, text


def compile_lowered(lowered: Any) -> tuple[Any, dict[str, str]]:
    """``lowered.compile()``, or its compile with the options :func:`options_for` asks for
    where that needs at most half the temporaries (and, leaving loop-invariant code in its
    loops, moved no dot or convolution into one); returns ``(compiled, options)``, ``options``
    ``{}`` for XLA's defaults."""
    default = lowered.compile()
    options, text = _judge(default)
    if not options:
        return default, {}
    try:
        chosen = lowered.compile(compiler_options=dict(options))
    except Exception as err:  # noqa: BLE001 - a jaxlib without the options or their values
        _unsupported.update(options)
        _logger.debug("jaxexp: XLA:CPU refused %s: %s", options, err)
        return default, {}
    before, after = temp_bytes(default), temp_bytes(chosen)
    if before is None or after is None or 2 * after > before:
        return default, {}
    if _LOOP_OPTION in options:
        try:
            moved = loop_heavy_ops(chosen.as_text()) > loop_heavy_ops(text)
        except Exception:  # noqa: BLE001 - no text: no proof that nothing moved
            moved = True
        if moved:
            return default, {}
    _logger.debug("jaxexp: compiled with %s: temporaries %d -> %d bytes", options, before, after)
    return chosen, dict(options)
