"""Big batches in chunks of a smaller bucket, where a bucket's temporaries would be fresh memory
on every call.

XLA:CPU allocates an executable's temporaries (``memory_analysis().temp_size_in_bytes``) on
every call and frees them after. glibc's malloc serves a block above its mmap threshold, which
never rises past 32 MiB, with new pages from the kernel and gives them back at ``free``: every
call then faults in and zeroes each page again. Measured on the 2-core VM (jax 0.10.2): the
transformer encoder of ``benchmarks/onnx_models.py`` (seq 128, d 256) at 1024 rows needs 3.4 GiB
of temporaries, 2.8 M page faults and 4.9-5.0 s a call; run as 64 calls of its 16-row bucket
(22 MiB each) it takes 1.50 s, with no page faults, outputs within 1e-6. The MLP and the CNN
there have temporaries of under 1 MiB at 1024 rows and are never cut.

So a pyfunc whose rows are proven independent (it pads them to buckets already), with no loop,
runs a batch whose bucket's temporaries exceed the budget (``JAXEXP_CHUNK_TEMP_BYTES``, default
32 MiB; ``0`` turns it off) as chunks of the largest smaller bucket within it, on the CPU. The
bucket is chosen once per size, from the temporaries XLA states for the compiled executables:
the first guess scales the big bucket's figure down linearly, then smaller buckets are tried
(each one compiled, or loaded from the executable store, once).

``load_model(path)(x)`` does the same on the CPU (``runtime/model.py``, :class:`RowChunks`) for
a model whose rows were proven independent at save, with one symbolic leading dimension on every
input and output and no loop: a batch whose executable's temporaries exceed the budget runs as
chunks of a power-of-two number of rows (the last one padded as buckets pad, with its last row),
at most :data:`IN_PROCESS_TRIES` smaller sizes compiled to find it; a bigger batch of the same
trailing shapes is cut alike. The transformer above at 1024 rows, in process: 2.4 -> 1.4 s.
A model that loops (a decode loop, a scan) is never cut: each call of it reads the weights once
per step whatever its rows, so chunks would multiply that.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxexp_mlflow import settings

#: Largest temporaries (bytes) a call may allocate before its batch is cut into chunks.
ENV_CHUNK_TEMP_BYTES = "JAXEXP_CHUNK_TEMP_BYTES"
#: glibc's ceiling for its mmap threshold on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``): blocks
#: at or under it are kept in the heap once freed, and reused without new pages.
DEFAULT_TEMP_BYTES = 32 << 20
#: Smaller sizes an in-process call compiles at most to find its chunk (each is one compile).
IN_PROCESS_TRIES = 3
#: The chunk sizes an in-process call may run in.
POWERS = tuple(1 << k for k in range(31))


def budget() -> int:
    """``$JAXEXP_CHUNK_TEMP_BYTES`` (bytes; ``0`` off), else :data:`DEFAULT_TEMP_BYTES`."""
    raw = settings.JAXEXP_CHUNK_TEMP_BYTES.get().strip()
    if not raw:
        return DEFAULT_TEMP_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(
            f"{ENV_CHUNK_TEMP_BYTES}={raw!r}: expected a whole number of bytes (0 turns "
            "chunking off), found something else. Set it to e.g. 33554432, or unset it."
        )
    return value


class ChunkPlan:
    """The rows each batch bucket runs in: the bucket itself, or a smaller bucket whose
    temporaries fit the budget (see the module docstring).

    ``temp_bytes(size)`` gives the temporaries of bucket ``size`` (compiling it if need be), or
    None when it cannot tell; ``sizes`` are the buckets, ascending. ``tries``: how many smaller
    sizes are tried at most (None: all).
    """

    def __init__(
        self,
        sizes: Sequence[int],
        temp_bytes: Callable[[int], int | None],
        limit: int,
        tries: int | None = None,
    ) -> None:
        self._sizes = sorted(sizes)
        self._temp = temp_bytes
        self._limit = limit
        self._tries = tries
        self._rows: dict[int, int] = {}
        self._lock = threading.Lock()

    def rows(self, size: int) -> int:
        """The rows a batch of bucket ``size`` runs in (``size``: whole)."""
        got = self._rows.get(size)
        if got is None:
            with self._lock:
                got = self._rows.get(size)
                if got is None:
                    got = self._rows[size] = self._choose(size)
        return got

    def _choose(self, size: int) -> int:
        if self._limit <= 0 or size <= 1:
            return size
        temp = self._temp(size)
        if temp is None or temp <= self._limit:
            return size
        guess = size * self._limit // temp  # temporaries grow at least linearly with rows
        smaller = [s for s in self._sizes if s < size and s <= max(guess, 1)]
        for rows in list(reversed(smaller))[: self._tries]:
            found = self._temp(rows)
            if found is None:
                return size  # cannot tell: run it whole, as before
            if found <= self._limit:
                return rows
        return size  # even the smallest bucket exceeds it: nothing measured says cutting helps


class RowChunks:
    """A call ``inner(params, *inputs, **kwargs)`` of ``rows`` rows made to take any number of
    rows: every input leaf (arrays on the host, rows along axis 0) is cut into ``rows``-row
    slices, the last one padded with its last row (``runtime.buckets.pad_rows``); each slice
    is run, and every output leaf's rows are joined, the padding dropped. Only for rows proven
    independent (``runtime/rows.py``)."""

    __slots__ = ("inner", "rows")

    def __init__(self, inner: Callable[..., Any], rows: int) -> None:
        self.inner, self.rows = inner, rows

    def __call__(self, params: Any, *inputs: Any, **kwargs: Any) -> Any:
        import jax

        from jaxexp_mlflow.runtime.buckets import pad_rows

        leaves, tree = jax.tree.flatten((inputs, kwargs))
        hosts = [np.asarray(x) for x in leaves]  # a CPU array's own buffer: no copy
        n, step = hosts[0].shape[0], self.rows
        outs = []
        for start in range(0, n, step):
            args, kw = jax.tree.unflatten(
                tree, [pad_rows(x[start : start + step], step) for x in hosts]
            )
            outs.append(self.inner(params, *args, **kw))
        flat = [jax.tree.leaves(out) for out in outs]
        joined = [np.concatenate([np.asarray(f[i]) for f in flat])[:n] for i in range(len(flat[0]))]
        return jax.tree.unflatten(jax.tree.structure(outs[0]), [jax.device_put(j) for j in joined])
