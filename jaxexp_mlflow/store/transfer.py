"""Move model directories to and from MLflow artifact stores: in parallel, with progress.

MLflow's ``HttpArtifactRepository.log_artifacts`` (``mlflow server`` proxying artifacts) uploads
one file after the other, and ``download_artifacts`` lists a directory tree one request per
directory before it downloads. A jaxexp model is ~100 files (params arrays, the ``code/`` copy of
this package), so both add up. Here the files go through the same repository objects MLflow
uses (``log_artifact`` and their one-file download, reached through ``internals.mlflow_private``:
MLflow's retries, auth, multipart uploads to S3), several at a time, biggest first, with a byte
progress bar on a terminal (tqdm, what MLflow's own artifact progress bars use), silent
otherwise. See docs/remote.md.
"""

from __future__ import annotations

import contextlib
import posixpath
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any

from jaxexp_mlflow import settings

#: Parallel transfers per model (files in flight). Override with ``JAXEXP_TRANSFER_WORKERS``.
DEFAULT_WORKERS = 8
#: Downloaded files at least this big are checksummed (CRC-32C) as soon as they land.
CHECKSUM_MIN_BYTES = 1 << 20
MANIFEST = "jaxexp_manifest.json"  # params.manifest.MANIFEST_FILE (not imported: cheap module)
#: Deepest directory a model download follows (``JAXEXP_MAX_LIST_DEPTH``): a model is ~5 deep.
DEFAULT_MAX_LIST_DEPTH = 32
#: Most entries (files and directories) a model download accepts from the store's listings and
#: the params manifest together (``JAXEXP_MAX_LIST_ENTRIES``): a model is ~125 files.
DEFAULT_MAX_LIST_ENTRIES = 100_000


def workers() -> int:
    """Files transferred at once (``JAXEXP_TRANSFER_WORKERS``, default 8)."""
    try:
        return max(1, settings.JAXEXP_TRANSFER_WORKERS.get(DEFAULT_WORKERS))
    except ValueError:
        return DEFAULT_WORKERS


def _knob(name: str, default: int) -> int:
    try:
        return max(1, settings.lookup(name).get(default))
    except ValueError:
        return default


def list_limits() -> tuple[int, int]:
    """(depth, entries) a download follows (``JAXEXP_MAX_LIST_DEPTH``, default 32;
    ``JAXEXP_MAX_LIST_ENTRIES``, default 100 000)."""
    return (
        _knob("JAXEXP_MAX_LIST_DEPTH", DEFAULT_MAX_LIST_DEPTH),
        _knob("JAXEXP_MAX_LIST_ENTRIES", DEFAULT_MAX_LIST_ENTRIES),
    )


class ListBounds:
    """What a store's listings may hold: every path under the directory listed, each seen once
    (a directory listing itself, or a link loop, repeats a path), at most ``depth`` below the
    root, at most ``entries`` in all. Anything else is an ``ArtifactError``: a hostile or broken
    store cannot keep a download listing forever."""

    def __init__(self, root: str) -> None:
        self.root = posixpath.normpath(root) if root else ""
        self.depth, self.entries = list_limits()
        self.seen: set[str] = {self.root}
        self.count = 0
        self.lock = threading.Lock()

    def check(self, parent: str | None, paths: list[str]) -> None:
        from jaxexp_mlflow.errors import ArtifactError

        base = posixpath.normpath(parent) if parent else ""
        with self.lock:
            self.count += len(paths)
            if self.count > self.entries:
                raise ArtifactError(
                    f"The artifact store listed more than {self.entries} files and directories "
                    f"for the model under {self.root!r} (the listing of {base!r} brought the "
                    "count past the limit): expected a model directory (~125 files). The store "
                    "is broken or hostile; raise JAXEXP_MAX_LIST_ENTRIES if the model really "
                    "holds that many files."
                )
            for path in paths:
                norm = posixpath.normpath(path) if path else ""
                if norm in self.seen:
                    raise ArtifactError(
                        f"The artifact store listed {norm[:200]!r} twice (in the listing of "
                        f"{base!r}): expected a tree, found a directory that lists itself or a "
                        "link loop. The store is broken or hostile; nothing was loaded. Remove "
                        "the loop from the artifact store."
                    )
                inside = norm.startswith(f"{base}/") if base else norm not in ("", ".")
                if not inside or norm.startswith("../") or "/../" in f"/{norm}/":
                    raise ArtifactError(
                        f"The artifact store listed {path[:200]!r} in the directory {base!r}: "
                        "expected entries inside that directory. The store is broken or "
                        "hostile; nothing was loaded."
                    )
                rel = posixpath.relpath(norm, self.root) if self.root else norm
                if rel.count("/") + 1 > self.depth:
                    raise ArtifactError(
                        f"The artifact store listed {norm[:200]!r}, {rel.count('/') + 1} "
                        f"directories deep under {self.root!r}: expected at most {self.depth} "
                        "(a model is ~5 deep), found a tree without end (e.g. a link to a "
                        "parent directory in the store). Nothing was loaded. Remove the link, "
                        "or raise JAXEXP_MAX_LIST_DEPTH if the model really is that deep."
                    )
                self.seen.add(norm)


def progress_enabled() -> bool:
    """Progress on stderr only when it is a terminal and MLflow's artifact progress bars are on
    (``MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR``); ``JAXEXP_PROGRESS=1``/``0`` forces it."""
    from mlflow.environment_variables import MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR

    forced = settings.JAXEXP_PROGRESS.get()
    if forced in ("0", "1"):
        return forced == "1"
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty()) and MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.get()


class SilentProgress:
    """The progress bar when there is none: ``update`` does nothing."""

    def update(self, n: int = 1) -> None:
        pass


def grow_total(bar: Any, lock: threading.Lock, nbytes: int) -> None:
    """Add ``nbytes`` to a bar whose total is learnt as the transfer goes (tqdm only)."""
    if nbytes and hasattr(bar, "total"):
        with lock:
            bar.total = (bar.total or 0) + nbytes
            bar.refresh()


@contextlib.contextmanager
def progress(total_bytes: int, desc: str) -> Iterator[Any]:
    """A tqdm byte bar (bytes, rate, ETA) on a terminal; an object whose ``update`` does
    nothing otherwise. Thread-safe: tqdm locks its updates."""
    if not progress_enabled():
        yield SilentProgress()
        return
    from tqdm.auto import tqdm

    # the CLI's stderr escapes control characters; the bar's carriage returns are its own, and
    # its description is made printable here
    desc = "".join(c if c.isprintable() else "?" for c in desc)
    with tqdm(
        total=total_bytes,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        leave=False,
        file=getattr(sys.stderr, "unescaped", sys.stderr),
    ) as bar:
        yield bar


def run_all(tasks: list[tuple[Any, ...]], fn: Any) -> None:
    """Run ``fn(*task)`` for every task on a pool; the first failure cancels the rest and
    is raised (MLflow's own retries happen inside each call)."""
    if not tasks:
        return
    with ThreadPoolExecutor(min(workers(), len(tasks)), thread_name_prefix="jaxexp-xfer") as pool:
        futures: list[Future] = [pool.submit(fn, *t) for t in tasks]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for f in pending:
            f.cancel()
        for f in futures:
            if f.done() and not f.cancelled() and f.exception() is not None:
                raise f.exception()


# --------------------------------------------------------------------------------------------
# upload


# --------------------------------------------------------------------------------------------
# download


def list_checked(repo: Any, path: str | None) -> list[Any]:
    """``repo.list_artifacts(path)``, each entry's ``file_size`` checked: a store that lists
    garbage (``file_size: "12abc"``, a negative size) gets a typed error, not a ValueError."""
    from jaxexp_mlflow.errors import ArtifactError

    try:
        listing = list(repo.list_artifacts(path))
    except (ValueError, TypeError) as err:
        raise ArtifactError(
            f"The artifact store's listing of {path or 'the model root'!r} could not be read "
            f"({type(err).__name__}: {str(err)[:200]}): expected file entries with integer "
            "sizes. Check the store, or download the model with MLflow and load the directory."
        ) from err
    for info in listing:
        size = info.file_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
            raise ArtifactError(
                f"The artifact store listed {info.path!r} with size {str(size)[:40]!r}: expected "
                "a non-negative integer. Check the store, or download the model with MLflow."
            )
    return listing
