"""Batch buckets: pad a batch up to one of a few sizes so serving never compiles per request.

A model exported with a symbolic batch dimension compiles once per distinct batch size. With
buckets (default: powers of two up to ``max_batch``), a batch of ``n`` rows is padded to the
smallest bucket ``>= n`` (by repeating its last row, so padding never introduces NaN/inf), run,
and the outputs are sliced back to ``n`` rows; a batch larger than the largest bucket runs in
chunks of that size. A bucket compiles on its first use (through the persistent compilation
cache, ``runtime/cache.py``), so a process compiles only the sizes its batches need; inside a
scoring server every bucket is compiled (not run) by a background thread started at load
(``precompile``), smallest first, so the server is up after one load and later requests run
compiled code; for a model that loops (a generate function) only the first bucket is.

Bucketing applies only when every input and every output has the same symbolic leading
dimension (and it appears nowhere else) and the model's rows were proven independent at save
(``runtime/rows.py``, MLmodel ``jaxexp.padding``); otherwise batches run at their own size. A
function that mixes rows of a batch (batch statistics, a softmax over the batch axis, segment
sums of a graph) gives different results on padded batches, so it is never padded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxexp_mlflow import settings

ENV_BUCKETS = "JAXEXP_BUCKETS"
ENV_MAX_BATCH = "JAXEXP_MAX_BATCH"
ENV_PRECOMPILE = "JAXEXP_PRECOMPILE"
DEFAULT_MAX_BATCH = 1024


@dataclass(frozen=True)
class BucketPolicy:
    """The bucket sizes (empty = off), those to compile before their first use, and whether
    that happens in the background (a scoring server's default: it answers requests meanwhile)
    or during the load (``precompile`` asked for explicitly)."""

    sizes: tuple[int, ...]
    precompile: tuple[int, ...]
    background: bool = False

    @property
    def enabled(self) -> bool:
        """Whether batches are padded to buckets at all."""
        return bool(self.sizes)

    @property
    def largest(self) -> int:
        """The largest bucket: bigger batches run in chunks of this size."""
        return self.sizes[-1]

    def bucket_for(self, n: int) -> int:
        """The smallest bucket holding ``n`` rows (``n`` must be <= the largest bucket)."""
        for size in self.sizes:
            if size >= n:
                return size
        return self.largest


def powers_of_two(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to and including ``max_batch`` (which is added if not a power of 2)."""
    sizes = []
    s = 1
    while s < max_batch:
        sizes.append(s)
        s *= 2
    sizes.append(int(max_batch))
    return tuple(sizes)


def _parse_sizes(value: Any, max_batch: int) -> tuple[int, ...]:
    if value is None or value is True:
        return powers_of_two(max_batch)
    if value is False:
        return ()
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("off", "0", "false", "none", "no", ""):
            return ()
        if text in ("pow2", "on", "true", "1", "default"):
            return powers_of_two(max_batch)
        value = [v for v in text.replace(" ", "").split(",") if v]
    if isinstance(value, int):
        return powers_of_two(value)
    try:
        sizes = sorted({int(v) for v in value})
    except (TypeError, ValueError):
        sizes = []
    if not sizes or sizes[0] < 1:
        raise ValueError(
            f"buckets: expected 'pow2', 'off' or a list of positive integers, found {value!r:.80}"
        )
    return tuple(sizes)


def saved_off(serving: dict[str, Any] | None) -> bool:
    """Whether a saved ``serving_config`` (the MLmodel ``jaxexp.serving`` section) turns buckets
    off: then ``save_model`` runs no row proof for them (``flavors.readback``)."""
    value = (serving or {}).get("buckets", None)
    try:
        return value is not None and _parse_sizes(value, DEFAULT_MAX_BATCH) == ()
    except (TypeError, ValueError):  # a bad value is refused where it is read, not here
        return False


def resolve(
    config: dict[str, Any] | None,
    saved: dict[str, Any] | None = None,
    *,
    serving: bool = False,
) -> BucketPolicy:
    """The bucket policy from ``model_config``, then the environment, then the MLmodel section.

    Keys (model_config or the MLmodel ``jaxexp.serving`` section): ``buckets`` (``"pow2"``
    (default), ``"off"``, or a list of sizes), ``max_batch`` (largest power-of-two bucket,
    default 1024), ``precompile`` (``true``: every bucket at load, ``false``: none, each compiles
    on first use, or a list; unset: every bucket when ``serving``, compiled in the background
    so that the server is up after one load and answers meanwhile, else none).
    Environment: ``JAXEXP_BUCKETS``, ``JAXEXP_MAX_BATCH``, ``JAXEXP_PRECOMPILE`` with the same
    values (comma-separated lists).
    """
    config = config or {}
    saved = saved or {}

    def pick(key: str, env: str) -> Any:
        if key in config:
            return config[key]
        if settings.lookup(env).is_set():
            return settings.lookup(env).get()
        return saved.get(key)

    raw_max = pick("max_batch", ENV_MAX_BATCH) or DEFAULT_MAX_BATCH
    try:
        max_batch = int(raw_max)
    except (TypeError, ValueError):
        max_batch = 0
    if max_batch < 1:
        raise ValueError(f"max_batch: expected a positive integer, found {raw_max!r:.80}")
    sizes = _parse_sizes(pick("buckets", ENV_BUCKETS), max_batch)
    pre = pick("precompile", ENV_PRECOMPILE)
    if pre is None:
        return BucketPolicy(sizes, sizes if serving else (), background=serving)
    elif pre is True or (isinstance(pre, str) and pre.lower() in ("1", "true", "on")):
        precompile = sizes
    elif pre is False or (isinstance(pre, str) and pre.lower() in ("0", "false", "off", "")):
        precompile = ()
    else:
        precompile = tuple(s for s in _parse_sizes(pre, max_batch) if not sizes or s in sizes)
    return BucketPolicy(sizes, precompile)


def has_loop(exported: Any) -> bool:
    """Whether the exported module has a ``stablehlo.while`` (a decode loop, a scan), read from
    its bytecode's op names (``codec.mlir_bytecode``; the module is never printed). A
    server compiles only the first bucket of such a model ahead: each may take seconds to
    minutes to compile (a 100M-parameter generate takes minutes for all eleven) and
    most are never asked for; the others compile on first use."""
    from jaxexp_mlflow.codec.mlir_bytecode import scan_module

    try:  # the op names of the bytecode's dialect section: no text of the module printed
        ops = scan_module(bytes(exported.mlir_module_serialized)).vhlo_ops
    except Exception:  # noqa: BLE001 - no module to read: treated as loop-free
        return False
    return ops is not None and any(op.startswith("while") for op in ops)


def aval_symbols(aval: Any) -> tuple[str | None, ...]:
    """An aval's dimensions as symbols: the text of each symbolic one, None for a known size."""
    return tuple(None if isinstance(d, int | np.integer) else str(d) for d in aval.shape)


def batch_symbol(in_symbols: Sequence[tuple], out_symbols: Sequence[tuple]) -> str | None:
    """The symbolic leading dimension shared by every input and output leaf, else None."""
    firsts = {syms[0] if syms else None for syms in (*in_symbols, *out_symbols)}
    if len(firsts) != 1:
        return None
    sym = firsts.pop()
    if sym is None:
        return None
    for syms in (*in_symbols, *out_symbols):
        if any(s is not None and sym in s for s in syms[1:]):
            return None
    return sym


def pad_rows(x: np.ndarray, size: int) -> np.ndarray:
    """``x`` with its last row repeated until it has ``size`` rows."""
    n = x.shape[0]
    if n == size:
        return x
    out = np.empty((size, *x.shape[1:]), dtype=x.dtype)
    out[:n] = x
    out[n:] = x[n - 1]
    return out
