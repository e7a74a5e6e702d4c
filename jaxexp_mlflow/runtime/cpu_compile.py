"""Compile for XLA:CPU, choosing per executable whether reductions go to YNNPACK.

XLA:CPU (jaxlib 0.10-0.12 at least) hands dots, convolutions and reductions to YNNPACK by
default (``xla_cpu_experimental_ynn_fusion_type``). Around reductions it builds big YNNPACK
fusions, and where such a fusion cannot hold a broadcast it takes it as an input that XLA fills
in memory first: the transformer encoder of issue 38 at 1024 rows had 9 of those (LayerNorm,
softmax and GELU constants broadcast up to ``[1024, 128, 1024]``), 2.3 of its 3.4 GiB of
temporaries, fresh pages on every call and 5.0 s a call; with reductions left to XLA, 1.1 GiB
and 2.4 s
(docs/serving.md, "Reductions and YNNPACK"). A CNN's pooling needs the offload the other way
round (XLA's own ``reduce-window`` took its 1024-row call from 24 to 126 ms), so no single
setting is right and none is set process-wide.

:func:`compile_lowered` compiles with XLA's defaults first. Only when that executable runs on
the CPU, needs more than :data:`TEMP_BYTES` of temporaries, holds YNNPACK fusions and a quarter
or more of its temporaries are such broadcasts (the 1B decoder of issue 39: 4 MiB of 4.1 GiB,
so no second compile) does it compile a second time with reductions kept off YNNPACK
(``compiler_options`` of that one compile), and it keeps the second when it needs at most half
the temporaries. The choice is a function of the module and this jaxlib only, so an executable
stored under a key that names both stays valid. ``JAXEXP_CPU_YNN_CHOICE=0`` turns it off.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

_logger = logging.getLogger(__name__)

#: Below this many bytes of temporaries an executable is kept as XLA's defaults make it.
TEMP_BYTES = 32 * 1024**2
_OPTION = "xla_cpu_experimental_ynn_fusion_type"
#: XLA's default offload minus ``REDUCE`` (the jaxlib 0.10-0.12 default is these two plus it).
LEAN_OPTIONS = {
    _OPTION: "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION"
}
_unsupported = False  # set once a jaxlib refused the option: never asked again in this process


def enabled() -> bool:
    """Whether the choice is made (``JAXEXP_CPU_YNN_CHOICE``, default on)."""
    return os.environ.get("JAXEXP_CPU_YNN_CHOICE", "1").strip().lower() not in {"0", "off", "no"}


def settings() -> dict[str, Any]:
    """What of this module decides an executable, for the keys of stored executables."""
    return {"ynn_choice": enabled(), "temp_bytes": TEMP_BYTES, "lean": LEAN_OPTIONS}


def _temp_bytes(compiled: Any) -> int | None:
    try:
        return int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - a backend or executable without the analysis
        return None


_BROADCAST = re.compile(r"%wrapped_broadcast[.\d]* = ([a-z]+)(\d*)\[([\d,]*)\]")


def broadcast_bytes(hlo_text: str) -> int:
    """The bytes of the broadcasts an optimized HLO module fills in memory as instructions of
    their own (``wrapped_broadcast`` fusions): what YNNPACK fusions take as inputs."""
    total = 0
    for kind, bits, dims in _BROADCAST.findall(hlo_text):
        size = max(1, int(bits or 8) // 8) if kind != "pred" else 1
        for d in filter(None, dims.split(",")):
            size *= int(d)
        total += size
    return total


def _on_cpu(compiled: Any) -> bool:
    """Whether ``compiled`` runs on CPU devices (its shardings say; a GPU module's text is
    never read)."""
    import jax

    try:
        shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
        return bool(shardings) and all(d.platform == "cpu" for s in shardings for d in s.device_set)
    except Exception:  # noqa: BLE001 - shardings a release does not state
        return False


def lean_is_better(default: Any) -> bool:
    """Whether an executable compiled with XLA's defaults is worth compiling again without
    YNNPACK's reductions: more than :data:`TEMP_BYTES` of temporaries, a quarter of them or more
    broadcasts filled for YNNPACK fusions. (A decode loop's temporaries are its weights' f32
    copies and its caches: compiling it twice would only cost time.)"""
    if _unsupported or not enabled():
        return False
    temp = _temp_bytes(default)
    if temp is None or temp <= TEMP_BYTES or not _on_cpu(default):
        return False
    try:
        text = default.as_text()
    except Exception:  # noqa: BLE001 - no text: nothing to judge by
        return False
    return "__ynn_fusion" in text and 4 * broadcast_bytes(text) >= temp


def compile_lowered(lowered: Any) -> tuple[Any, bool]:
    """``lowered.compile()``, or its compile without YNNPACK's reductions where that needs at
    most half the temporaries; returns ``(compiled, lean)``."""
    global _unsupported
    default = lowered.compile()
    if not lean_is_better(default):
        return default, False
    try:
        lean = lowered.compile(compiler_options=dict(LEAN_OPTIONS))
    except Exception as err:  # noqa: BLE001 - a jaxlib without the option or its values
        _unsupported = True
        _logger.debug("jaxexp: XLA:CPU refused %s: %s", LEAN_OPTIONS, err)
        return default, False
    before, after = _temp_bytes(default), _temp_bytes(lean)
    if before is None or after is None or 2 * after > before:
        return default, False
    _logger.debug("jaxexp: reductions kept off YNNPACK: temporaries %d -> %d bytes", before, after)
    return lean, True
