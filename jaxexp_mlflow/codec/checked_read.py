"""Read parts of a file into buffers and checksum every byte of the file, on several threads.

One pass over the bytes: each thread reads a block (``os.preadv``, which releases the GIL) and
takes its CRC-32C at once, while the block is still in the CPU cache. A file is cut into
contiguous parts, one per thread (the calling thread takes the first); each part's CRC-32C is
computed from 0 and the parts are joined in file order with ``crc32c_combine``, so the result is
the CRC-32C of the whole file, the bytes between and after the regions included.

The checksum is ``internals.crc32c_private.extend``: Google's crc32c library called with the GIL
released, so the threads' reads and checksums all run at once (``google_crc32c.extend``, its
public fallback, holds the GIL on a buffer that is not ``bytes``: then two checksums never
overlap; ``benchmarks/bench_params.py``, BENCHMARKS.md).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from jaxexp_mlflow import settings

__all__ = ["BLOCK", "read_checked", "run_spread", "threads"]

#: Bytes read and then checksummed at a time: they stay in the core's L2 cache between the two.
BLOCK = 1 << 20
#: A file is split between threads only in parts of at least this many bytes.
MIN_PART = 4 << 20
_pool: Any = None
_pool_key = (0, 0)  # (process id, threads): a forked child starts a pool of its own


def threads() -> int:
    """Threads one file is read on (env ``JAXEXP_READ_THREADS``; default: the usable cores,
    at most 4)."""
    env = settings.JAXEXP_READ_THREADS.get()
    if env is not None:
        return max(1, env)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


def _executor(n: int) -> Any:
    """The module's thread pool with at least ``n`` threads, made in this process (a pool
    inherited through ``fork`` has no threads left: work sent to it would never run)."""
    global _pool, _pool_key
    pid = os.getpid()
    if _pool is None or _pool_key[0] != pid or _pool_key[1] < n:
        import concurrent.futures

        _pool = concurrent.futures.ThreadPoolExecutor(n, "jaxexp-read")
        _pool_key = (pid, n)
    return _pool


def _segments(size: int, regions: Sequence[tuple[int, memoryview]]) -> list[tuple[int, int, Any]]:
    """``(file offset, length, destination or None)`` covering ``[0, size)`` in order: the
    regions (sorted, not overlapping) and the bytes between them (read only to be checksummed)."""
    out: list[tuple[int, int, Any]] = []
    pos = 0
    for offset, dst in regions:
        if offset > pos:
            out.append((pos, offset - pos, None))
        if len(dst):
            out.append((offset, len(dst), dst))
        pos = offset + len(dst)
    if size > pos:
        out.append((pos, size - pos, None))
    return out


def _split(segments: list[tuple[int, int, Any]], parts: int) -> list[list[tuple[int, int, Any]]]:
    """Cut ``segments`` into ``parts`` runs of about equal bytes, in order."""
    total = sum(n for _, n, _ in segments)
    out: list[list[tuple[int, int, Any]]] = [[] for _ in range(parts)]
    quota = -(-total // parts)
    i, room = 0, quota
    for offset, n, dst in segments:
        done = 0
        while done < n:
            if room == 0:
                i, room = min(i + 1, parts - 1), quota
            take = min(n - done, room) if i < parts - 1 else n - done
            view = None if dst is None else dst[done : done + take]
            out[i].append((offset + done, take, view))
            done += take
            room -= take
    return [p for p in out if p]


def _run(fd: int, part: list[tuple[int, int, Any]], what: str, block: int) -> tuple[int, int]:
    """Read and checksum one part; returns ``(crc32c from 0, bytes)``."""
    import numpy as np

    from jaxexp_mlflow.internals.crc32c_private import extend

    value = 0
    gaps = sum(n for _, n, dst in part if dst is None)  # bytes only checksummed
    scratch = np.empty(min(block, gaps), np.uint8) if gaps else None
    for offset, n, dst in part:
        done = 0
        while done < n:
            k = min(block, n - done)
            if dst is None:
                view = memoryview(scratch)[:k]
            else:
                view = dst[done : done + k]
            got = os.preadv(fd, [view], offset + done)
            if got <= 0:
                from jaxexp_mlflow.codec.files import fail

                raise fail(
                    f"{what} ended early: expected {n - done} more bytes at offset "
                    f"{offset + done}, found end of file. The checkpoint is damaged; download "
                    "the model again."
                )
            value = extend(value, view[:got])
            done += got
    return int(value), sum(n for _, n, _ in part)


def read_checked(
    fd: int,
    size: int,
    regions: Sequence[tuple[int, memoryview]],
    *,
    what: str = "A params file",
    workers: int | None = None,
    min_part: int = MIN_PART,
    block: int | None = None,
) -> int:
    """Read each ``(file offset, destination)`` region of the open file ``fd`` (``size``
    bytes) into its destination and return the CRC-32C of all ``size`` bytes of the file.

    ``regions`` must be sorted by offset and not overlap; bytes outside them are read (into a
    scratch block) only to be checksummed. Destinations are writable byte views. Files of less
    than two ``min_part`` are read on the calling thread; bigger ones in up to ``workers``
    (default :func:`threads`) contiguous parts at once, ``block`` (default :data:`BLOCK`)
    bytes at a time. A file shorter than ``size`` raises
    ``ArtifactError``; every thread has stopped when this returns or raises.
    """
    from jaxexp_mlflow.codec.crc32c import crc32c_combine

    segments = _segments(size, [(o, memoryview(d).cast("B")) for o, d in regions])
    block = block or BLOCK
    parts = max(1, min(workers or threads(), size // max(1, min_part)))
    if parts == 1:
        return _run(fd, segments, what, block)[0]
    pieces = _split(segments, parts)
    pool = _executor(len(pieces) - 1)
    futures = [pool.submit(_run, fd, piece, what, block) for piece in pieces[1:]]
    try:
        results = [_run(fd, pieces[0], what, block)]
    finally:
        import concurrent.futures

        concurrent.futures.wait(futures)  # the buffers stay in use until every part is done
    results += [f.result() for f in futures]
    value = results[0][0]
    for crc, n in results[1:]:
        value = crc32c_combine(value, crc, n)
    return value


def run_spread(tasks: Sequence[Callable[[], Any]], workers: int | None = None) -> list[Any]:
    """Run ``tasks`` on up to ``workers`` threads (default :func:`threads`), the calling thread
    one of them, each thread taking the next task when it is done with one: many files read at
    once with one handoff for all of them rather than one per file. Returns the results in
    order once every task has finished; the first exception, in the tasks' order, is raised."""
    n = min(len(tasks), workers or threads())
    if n <= 1:
        return [task() for task in tasks]
    results: list[Any] = [None] * len(tasks)
    errors: list[BaseException | None] = [None] * len(tasks)
    order = iter(range(len(tasks)))
    lock = threading.Lock()

    def drain() -> None:
        while True:
            with lock:
                i = next(order, None)
            if i is None:
                return
            try:
                results[i] = tasks[i]()
            except BaseException as err:  # noqa: BLE001 - raised below, in the tasks' order
                errors[i] = err

    pool = _executor(n - 1)
    futures = [pool.submit(drain) for _ in range(n - 1)]
    try:
        drain()
    finally:
        import concurrent.futures

        concurrent.futures.wait(futures)  # the buffers stay in use until every task is done
    for err in errors:
        if err is not None:
            raise err
    return results
