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
import os
import posixpath
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, NamedTuple

from jaxexp_mlflow.internals import mlflow_private

#: Parallel transfers per model (files in flight). Override with ``JAXEXP_TRANSFER_WORKERS``.
DEFAULT_WORKERS = 8
#: Downloaded files at least this big are checksummed (CRC-32C) as soon as they land.
CHECKSUM_MIN_BYTES = 1 << 20
_MANIFEST = "jaxexp_manifest.json"  # params.manifest.MANIFEST_FILE (not imported: cheap module)
#: Deepest directory a model download follows (``JAXEXP_MAX_LIST_DEPTH``): a model is ~5 deep.
DEFAULT_MAX_LIST_DEPTH = 32
#: Most entries (files and directories) a model download accepts from the store's listings and
#: the params manifest together (``JAXEXP_MAX_LIST_ENTRIES``): a model is ~125 files.
DEFAULT_MAX_LIST_ENTRIES = 100_000


def workers() -> int:
    """Files transferred at once (``JAXEXP_TRANSFER_WORKERS``, default 8)."""
    try:
        return max(1, int(os.environ.get("JAXEXP_TRANSFER_WORKERS", DEFAULT_WORKERS)))
    except ValueError:
        return DEFAULT_WORKERS


def _knob(name: str, default: int) -> int:
    try:
        return max(1, int(os.environ.get(name, default)))
    except ValueError:
        return default


def list_limits() -> tuple[int, int]:
    """(depth, entries) a download follows (``JAXEXP_MAX_LIST_DEPTH``, default 32;
    ``JAXEXP_MAX_LIST_ENTRIES``, default 100 000)."""
    return (
        _knob("JAXEXP_MAX_LIST_DEPTH", DEFAULT_MAX_LIST_DEPTH),
        _knob("JAXEXP_MAX_LIST_ENTRIES", DEFAULT_MAX_LIST_ENTRIES),
    )


class _Bounds:
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

    forced = os.environ.get("JAXEXP_PROGRESS")
    if forced in ("0", "1"):
        return forced == "1"
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty()) and MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.get()


class _Silent:
    def update(self, n: int = 1) -> None:
        pass


def _grow(bar: Any, lock: threading.Lock, nbytes: int) -> None:
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
        yield _Silent()
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


def _run_all(tasks: list[tuple[Any, ...]], fn: Any) -> None:
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


def upload_dirs(
    dirs: list[tuple[Path, str | None]],
    artifact_uri: str,
    skip: dict[str, set[str]] | None = None,
) -> int:
    """Upload every file under each ``(local_dir, artifact_path)`` to ``artifact_uri`` on one
    pool, biggest first, with one progress bar, except ``skip`` (``{artifact_path: paths
    relative to its directory}``). Returns the bytes uploaded.

    Uses the artifact repository MLflow picks for the URI (its ``log_artifact``: multipart for
    big files where the store supports it).
    """
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    repo = get_artifact_repository(artifact_uri)
    tasks = []  # (size, file, artifact directory)
    for root, artifact_path in dirs:
        skipped = (skip or {}).get(artifact_path or "", set())
        for path in root.rglob("*"):
            if path.is_file() and path.relative_to(root).as_posix() not in skipped:
                rel = path.parent.relative_to(root).as_posix()
                parts = [p for p in (artifact_path, rel if rel != "." else None) if p]
                tasks.append((path.stat().st_size, path, posixpath.join(*parts) if parts else None))
    tasks.sort(key=lambda t: t[0], reverse=True)
    total = sum(t[0] for t in tasks)
    names = ", ".join(root.name for root, _ in dirs)
    with progress(total, f"Uploading {names}") as bar:

        def one(size: int, path: Path, where: str | None) -> None:
            repo.log_artifact(str(path), where)
            bar.update(size)

        _run_all(tasks, one)
    return total


class EarlyUpload:
    """Uploads a model being saved for ``log_model`` while the save goes on, on one pool:

    * the ``code/`` copy of the package as soon as it is copied (:meth:`send_tree`: ~70 small
      files, each a request of its own), while the export and the params save run;
    * the params checkpoint, once Orbax has written it and its manifest is there
      (:meth:`send_tree`), biggest files first, the manifest last (:meth:`finish`);
    * the other top-level files once the save is done (:meth:`send_files`), all but what
      ``Model.log`` itself uploads last (``MLmodel``).

    Each file is hard-linked into a private directory at once (a link keeps the same bytes, no
    copy) and the link is dropped once the file is up, through the repository object MLflow
    picks (``log_artifact``: its retries, auth and multipart uploads). A file that cannot be
    linked (another filesystem) is left to ``stage_upload``. Disabled (every call a no-op) for
    local artifact stores, which MLflow copies itself, and with ``JAXEXP_EARLY_UPLOAD=0``.
    """

    def __init__(self, artifact_uri: str, subdir: str) -> None:
        import tempfile

        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
        from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository

        self.repo = get_artifact_repository(artifact_uri)
        self.enabled = not isinstance(self.repo, LocalArtifactRepository) and (
            os.environ.get("JAXEXP_EARLY_UPLOAD", "1") != "0"
        )
        self.subdir = subdir  # the params directory, whose manifest goes up last
        self.submitted: set[str] = set()  # paths (relative to the model) on their way up
        self.futures: list[Future] = []
        self.lock = threading.Lock()
        self.stage: Path | None = None
        self.pool: ThreadPoolExecutor | None = None
        self._progress = contextlib.ExitStack()
        self.bar: Any = _Silent()
        #: paths (files and directories) the store held here before this upload (a re-log into
        #: an existing ``model_id``), None when they could not be listed
        self.existing: set[str] | None = set()
        self.manifest: Path | None = None  # params manifest: sent last, by :meth:`finish`
        if self.enabled:
            self.existing = self._list_existing()
            self.stage = Path(tempfile.mkdtemp(prefix="jaxexp-upload-"))
            self.pool = ThreadPoolExecutor(workers(), thread_name_prefix="jaxexp-early")
            self.bar = self._progress.enter_context(progress(0, "Uploading model"))

    def _list_existing(self) -> set[str] | None:
        """Every path under the destination now (one listing when it is empty, as for a new
        model), bounded like a download's listings; None if the store cannot list it."""
        bounds = _Bounds("")
        out: set[str] = set()
        todo: list[str | None] = [None]
        try:
            while todo:
                parent = todo.pop()
                infos = _list(self.repo, parent)
                bounds.check(parent or "", [i.path for i in infos])
                for info in infos:
                    out.add(posixpath.normpath(info.path))
                    if info.is_dir:
                        todo.append(info.path)
        except Exception:  # noqa: BLE001 - unknown: discard() then deletes nothing
            return None
        return out

    def send_tree(self, local_dir: str | os.PathLike, where: str) -> None:
        """Upload every file under ``local_dir`` to ``where`` (relative to the model) now,
        except those already on their way."""
        if not self.enabled:
            return
        root = Path(local_dir)
        for path in sorted(root.rglob("*")):
            key = f"{where}/{path.relative_to(root).as_posix()}"
            if key not in self.submitted and path.is_file():  # not twice
                self._add(key, path)

    def send_files(self, paths: list[Path]) -> None:
        """Upload these top-level files of the model now."""
        for path in paths:
            self._add(path.name, path)

    def skipped(self, where: str) -> set[str]:
        """What went up here under ``where``, relative to it (for ``stage_upload``'s ``skip``)."""
        prefix = f"{where}/"
        return {k[len(prefix) :] for k in self.submitted if k.startswith(prefix)}

    def _add(self, key: str, current: Path) -> None:
        if not self.enabled:
            return
        if key == f"{self.subdir}/{_MANIFEST}":  # last of ours: see finish()
            with self.lock:
                self.manifest = current
                self.submitted.add(key)  # not stage_upload's either
            return
        link = self.stage / key
        try:
            link.parent.mkdir(parents=True, exist_ok=True)
            os.link(current, link)
        except OSError:  # renamed meanwhile, or no hard links here: uploaded with the rest
            return
        _grow(self.bar, self.lock, link.stat().st_size)  # learnt as the files arrive
        with self.lock:
            self.futures.append(self.pool.submit(self._send, key, link))
            self.submitted.add(key)

    def _send(self, key: str, link: Path) -> None:
        size = link.stat().st_size
        self.repo.log_artifact(str(link), posixpath.dirname(key) or None)
        link.unlink()
        self.bar.update(size)

    def finish(self, params_dir: str | os.PathLike) -> None:
        """Wait for the uploads and raise the first failure; then upload the params manifest."""
        if not self.enabled:
            return
        wait(self.futures)
        for f in self.futures:
            if f.exception() is not None:
                raise f.exception()
        # The manifest goes up once every other file of ours is there: an upload cut before
        # leaves the previous manifest (a re-log: files it overwrote fail its checksums, loud)
        # or none; one cut after leaves the previous MLmodel, which the new manifest's binding
        # refuses (params.manifest). Never the previous function with the new weights.
        if self.manifest is not None:
            self.repo.log_artifact(str(Path(params_dir, _MANIFEST)), self.subdir)

    def discard(self) -> None:
        """Best effort: delete what went up (the save failed; no ``MLmodel`` will follow, so
        it could never load, but it should not stay behind either).

        Only what this upload created: into an existing ``model_id`` (a re-log) the files and
        directories the store held before are kept, even those overwritten (their previous
        manifest, or MLmodel, refuses them loudly); the new ones are deleted, by their topmost
        new directory. Nothing when the previous content could not be listed."""
        if not self.enabled or not self.submitted or self.existing is None:
            return
        doomed: set[str] = set()
        for key in self.submitted:
            parts = key.split("/")
            for i in range(1, len(parts) + 1):
                head = "/".join(parts[:i])
                if head not in self.existing:
                    doomed.add(head)  # the topmost path of ``key`` that did not exist
                    break

        # a store deleting by prefix (S3) must not take an older path along: file by file there
        def clash(path: str) -> bool:
            return any(e.startswith(path) for e in self.existing)

        for d in [d for d in doomed if clash(d)]:
            doomed.discard(d)
            doomed.update(
                k for k in self.submitted if (k == d or k.startswith(f"{d}/")) and not clash(k)
            )
        for path in sorted(doomed):
            if any(path.startswith(f"{d}/") for d in doomed):
                continue  # inside a directory deleted whole
            with contextlib.suppress(Exception):  # a store without deletes keeps them
                self.repo.delete_artifacts(path)

    def trash(self, paths: list[Path]) -> list[Path]:
        """Move these files or directories (all uploaded) into the private directory, deleted
        by :meth:`close` in the background; returns those that could not be moved there."""
        if self.stage is None:
            return list(paths)
        left = []
        for i, path in enumerate(paths):
            try:
                os.rename(path, self.stage / f".trash-{i}")
            except OSError:  # another filesystem: the caller deletes it
                left.append(path)
        return left

    def close(self) -> None:
        """Stop what has not started; delete the private directory (links left, trash) on a
        background thread, which the interpreter waits for at exit: deleting a gigabyte of
        files takes this VM a few tenths of a second that ``log_model`` need not wait."""
        import shutil

        if self.pool is not None:
            for f in self.futures:
                f.cancel()
            self.pool.shutdown(wait=True)
        if self.stage is not None:
            threading.Thread(
                target=shutil.rmtree,
                args=(self.stage,),
                kwargs={"ignore_errors": True},
                name="jaxexp-cleanup",
            ).start()
            self.stage = None
        self._progress.close()


def stage_upload(
    local_dir: str | os.PathLike,
    artifact_uri: str,
    subdirs: list[str],
    skip: dict[str, set[str]] | None = None,
) -> bool:
    """Upload ``subdirs`` of a model staged in ``local_dir`` now, in parallel; the caller then
    drops them from the staging directory, so that MLflow's own (serial) upload of the
    directory that follows only carries the small top-level files, ``MLmodel`` last among them.
    Returns False (nothing done) for a local artifact store.

    A model whose upload breaks off has no ``MLmodel`` yet, or params whose manifest check
    fails at load: it never loads wrong. Local artifact stores are left to MLflow (a copy).
    ``skip``: ``{subdir: files relative to it}`` uploaded by someone else (``EarlyUpload``).
    """
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
    from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository

    if isinstance(get_artifact_repository(artifact_uri), LocalArtifactRepository):
        return False
    dirs = [(Path(local_dir, sub), sub) for sub in subdirs if Path(local_dir, sub).is_dir()]
    upload_dirs(dirs, artifact_uri, skip)
    return True


# --------------------------------------------------------------------------------------------
# download


def resolve_repository(model_uri: str) -> tuple[Any, Any, str] | None:
    """(the repository MLflow picks for ``model_uri``, the one holding its files, the path
    inside it), or None where MLflow's own download is used: local paths, ``runs:/`` URIs
    (MLflow looks them up among logged models too), Databricks and Unity Catalog stores."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
    from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository
    from mlflow.store.artifact.models_artifact_repo import ModelsArtifactRepository
    from mlflow.store.artifact.runs_artifact_repo import RunsArtifactRepository

    if os.path.exists(model_uri):
        return None
    root_uri, artifact_path = mlflow_private.root_uri_and_artifact_path(model_uri)
    outer = get_artifact_repository(root_uri)
    if isinstance(outer, RunsArtifactRepository):
        return None
    repo = outer.repo if isinstance(outer, ModelsArtifactRepository) else outer
    if isinstance(repo, LocalArtifactRepository | ModelsArtifactRepository) or (
        "databricks" in type(repo).__module__ or "unity_catalog" in type(repo).__module__
    ):
        return None
    return outer, repo, artifact_path or ""


def _keep(path: str, skip: tuple[str, ...]) -> Any:
    """Predicate on ``FileInfo``: False for the directories in ``skip`` (relative to ``path``)."""

    def keep(info: Any) -> bool:
        return (posixpath.relpath(info.path, path) if path else info.path) not in skip

    return keep


class _Tree:
    """Lists a model's directories and downloads its files on one pool: a file starts as soon
    as the listing of its directory has come back (MLflow lists the whole tree first), and the
    listings of deeper directories go ahead of the downloads found beside them."""

    def __init__(self, repo: Any, root: str, local_root: Path, keep: Any, bar: Any) -> None:
        self.repo, self.root, self.local_root = repo, root, local_root
        self.keep, self.bar = keep, bar
        self.bounds = _Bounds(root)
        self.pool = ThreadPoolExecutor(workers(), thread_name_prefix="jaxexp-xfer")
        self.lock = threading.Lock()
        self.pending: set[Future] = set()
        self.crc32c: dict[str, int] = {}

    def _submit(self, fn: Any, *args: Any) -> None:
        with self.lock:
            self.pending.add(self.pool.submit(fn, *args))

    def _local(self, info: Any) -> Path:
        rel = posixpath.relpath(info.path, self.root) if self.root else info.path
        local = (self.local_root / rel).resolve()
        if not local.is_relative_to(self.local_root.resolve()):
            from jaxexp_mlflow.errors import ArtifactError

            raise ArtifactError(
                f"The artifact store listed {info.path!r} under {self.root!r}: expected a path "
                "inside the model directory. Refusing to write outside it."
            )
        return local

    def add(self, listing: list[Any], parent: str | None = None) -> None:
        """Queue the directories, then the files (biggest first), of one listing.

        A directory holding a params manifest (``jaxexp_manifest.json``: every file of the
        checkpoint with its size) is not listed further: the manifest is fetched first and
        names the files of its subdirectories (one request instead of one per array). What
        it names is checked like a listing (inside the model); what it omits is not fetched,
        and restore refuses a checkpoint whose files differ from its manifest anyway.

        ``parent`` is the directory listed: every entry must lie under it, none seen before,
        none deeper or more numerous than the limits (``_Bounds``).
        """
        self.bounds.check(parent if parent is not None else self.root, [i.path for i in listing])
        listing = [i for i in listing if self.keep(i)]
        dirs = [i for i in listing if i.is_dir]
        manifest = next((i for i in listing if posixpath.basename(i.path) == _MANIFEST), None)
        if dirs and manifest is not None:
            named = self._from_manifest(manifest, {d.path for d in dirs})
            if named is not None:
                listing = [i for i in listing if not i.is_dir and i is not manifest] + named
                dirs = []
        files = sorted((i for i in listing if not i.is_dir), key=lambda i: -(i.file_size or 0))
        targets = [(info, self._local(info)) for info in files]  # all checked before any starts
        for info in dirs:
            self._submit(lambda p: self.add(_list(self.repo, p), p), info.path)
        _grow(self.bar, self.lock, sum(i.file_size or 0 for i in files))
        for info, local in targets:
            self._submit(self._download, info, local)

    def _from_manifest(self, info: Any, subdirs: set[str]) -> list[Any] | None:
        """Download the manifest ``info`` now; the ``FileInfo`` of the files it names in
        ``subdirs``, or None (then they are listed) when it does not name them all or is not
        a manifest this package can read."""
        from mlflow.entities import FileInfo

        from jaxexp_mlflow.errors import ArtifactError
        from jaxexp_mlflow.params.manifest import read_manifest

        self._download(info, self._local(info))
        base = posixpath.dirname(info.path)
        try:
            entries = read_manifest(self._local(info).parent).files
        except ArtifactError:
            return None
        tops = {d.rstrip("/") for d in subdirs}
        named, covered = [], set()
        for rel, (size, _) in entries.items():
            if "/" in rel:  # top-level files of the directory come from its listing
                path = posixpath.join(base, rel)
                covered.add(posixpath.join(base, rel.split("/", 1)[0]))
                named.append(FileInfo(path, False, size))
        if covered != tops:
            return None  # a subdirectory the manifest does not describe: list them all
        self.bounds.check(base, [i.path for i in named])
        return named

    def _download(self, info: Any, local: Path) -> None:
        fetch_listed(self.repo, info, local)
        if (info.file_size or 0) >= CHECKSUM_MIN_BYTES:  # while its pages are in the cache
            from jaxexp_mlflow.codec.crc32c import path_crc32c

            value = path_crc32c(local)
            with self.lock:
                self.crc32c[local.relative_to(self.local_root).as_posix()] = value
        self.bar.update(info.file_size or 0)

    def run(self, listing: list[Any]) -> None:
        """Download everything under the root whose listing is given. The first failure
        cancels what has not started and is raised."""
        try:
            self.add(listing, self.root)
            while True:
                with self.lock:
                    current = set(self.pending)
                if not current:
                    return
                done, _ = wait(current, return_when=FIRST_EXCEPTION)
                with self.lock:
                    self.pending -= done
                for f in done:
                    if f.exception() is not None:
                        raise f.exception()
        finally:
            with self.lock:
                for f in self.pending:
                    f.cancel()
            self.pool.shutdown(wait=True)


def _fetch(repo: Any, info: Any, local: Path) -> None:
    """Download ``info`` to ``local``. Through ``mlflow server`` (HTTP) at most the listed
    size and one byte more are read (``mlflow_private.download_file_at_most``): a store sending
    more is cut off, not followed to the end of the disk. Other stores' own downloads are
    checked for size afterwards (``_Tree._download``)."""
    if info.file_size is None:
        mlflow_private.download_file(repo, info.path, local)
    else:  # one byte more tells "larger than listed"
        mlflow_private.download_file_at_most(repo, info.path, local, info.file_size + 1)


def fetch_listed(repo: Any, info: Any, local: Path, max_bytes: int | None = None) -> None:
    """Download the listed file ``info`` to ``local``, stopping at its listed size: a size over
    ``max_bytes`` is refused before anything is fetched, a store sending more than it listed
    is cut off (``_fetch``) and the file removed. ``ArtifactError`` otherwise."""
    from mlflow.exceptions import MlflowException

    from jaxexp_mlflow.errors import ArtifactError

    if max_bytes is not None and (info.file_size is None or info.file_size > max_bytes):
        raise ArtifactError(
            f"The artifact store lists {info.path!r} with {info.file_size} bytes: expected at "
            f"most {max_bytes} for this file. Nothing was downloaded; the store is broken or "
            "hostile, or the limit (JAXEXP_MAX_*_BYTES) is too low for this model."
        )
    local.parent.mkdir(parents=True, exist_ok=True)
    try:
        _fetch(repo, info, local)
    except MlflowException:
        local.unlink(missing_ok=True)
        raise
    except Exception as err:  # requests' HTTPError, boto's ClientError... (after retries)
        local.unlink(missing_ok=True)
        raise ArtifactError(
            f"Downloading {info.path!r} from the artifact store failed: expected the file "
            f"the store listed, found {type(err).__name__}: {str(err)[:300]}. Retry; if it "
            "fails again the stored model is damaged or the server cannot read it."
        ) from err
    found = local.stat().st_size
    if info.file_size is not None and found != info.file_size:
        local.unlink(missing_ok=True)
        raise ArtifactError(
            f"The artifact store listed {info.path!r} with {info.file_size} bytes but sent "
            f"{'more' if found > info.file_size else f'{found} bytes'}: expected the size "
            "it listed. The download was cut off and nothing was loaded; the store is "
            "broken or hostile (or the file changed meanwhile: retry)."
        )


def _logged_model_uri(model_uri: str, max_pages: int = 100) -> str:
    """A ``runs:/<run_id>/<name>/...`` URI as the artifact location (``.../<rest>``) of the
    model logged under that name by that run (MLflow 3 keeps logged models apart from run
    artifacts), else the run's artifact URI; other URIs unchanged. Public MLflow API only."""
    from mlflow.store.artifact.runs_artifact_repo import RunsArtifactRepository

    if not RunsArtifactRepository.is_runs_uri(model_uri):
        return model_uri
    from mlflow.tracking import MlflowClient

    run_id, rel = RunsArtifactRepository.parse_runs_uri(model_uri)
    name, _, rest = (rel or "").partition("/")
    if name:
        client = MlflowClient()
        experiment = client.get_run(run_id).info.experiment_id
        quoted = "'" not in name  # MLflow's filter syntax cannot quote both quotes
        token = None
        for _ in range(max_pages):
            page = client.search_logged_models(
                experiment_ids=[experiment],
                filter_string=f"name = '{name}'" if quoted else None,
                page_token=token,
            )
            for found in page:
                if found.source_run_id == run_id and found.name == name:
                    base = str(found.artifact_location).rstrip("/")
                    return f"{base}/{rest}" if rest else base
            token = page.token
            if not token:
                break
    return RunsArtifactRepository.get_underlying_uri(model_uri)


def list_top(model_uri: str) -> tuple[Any, str, dict[str, Any]]:
    """(the repository holding ``model_uri``, the path inside it, ``{name: FileInfo}`` of its
    top-level entries), the listing checked like a download's (``_Bounds``, sizes): what
    ``jaxexp inspect/check/audit`` fetch single files from."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    model_uri = _logged_model_uri(model_uri)
    resolved = resolve_repository(model_uri)
    if resolved is not None:
        _, repo, root = resolved
    else:
        root_uri, root = mlflow_private.root_uri_and_artifact_path(model_uri)
        repo, root = get_artifact_repository(root_uri), root or ""
    listing = _list(repo, root or None)
    _Bounds(root).check(root, [i.path for i in listing])
    return repo, root, {posixpath.basename(i.path.rstrip("/")): i for i in listing}


class Download(NamedTuple):
    """Where a model was downloaded, and what this module knows of the files it fetched."""

    path: str  # the local model directory
    ours: bool  # downloaded here (False: MLflow's own download, or a local path as it is)
    #: CRC-32C of each downloaded file of at least ``CHECKSUM_MIN_BYTES``, computed right after
    #: it landed (page cache hot), by path relative to ``path``
    crc32c: dict[str, int]
    #: the private temporary directory this module made for it (None: the caller's dst_path)
    tmp: str | None = None


def download_model(
    model_uri: str, dst_path: str | None = None, skip: tuple[str, ...] = ()
) -> Download:
    """Download the model at ``model_uri`` into ``dst_path`` (a new temp dir if None), except
    the directories in ``skip`` (paths relative to the model, e.g. ``code/jaxexp_mlflow``).

    Files go straight to their final place, several at a time, while the tree is still being
    listed (``_Tree``), and big files are checksummed as they land, so that loading from a
    private download need not read them again (``params.restore_params``)."""
    from mlflow.artifacts import download_artifacts
    from mlflow.utils.file_utils import create_tmp_dir

    # runs:/ URIs: the logged model's own location, so that its files come through _Tree too
    resolved = resolve_repository(model_uri)
    if resolved is None and not os.path.exists(model_uri):
        resolved = resolve_repository(_logged_model_uri(model_uri))
    if resolved is None:
        return Download(download_artifacts(artifact_uri=model_uri, dst_path=dst_path), False, {})
    outer, repo, root = resolved
    listing = _list(repo, root or None)
    if not listing:  # a file URI, or nothing there: let MLflow say what it is
        return Download(download_artifacts(artifact_uri=model_uri, dst_path=dst_path), False, {})
    dst = Path(dst_path or create_tmp_dir()).absolute()
    local_root = dst / posixpath.basename(root.rstrip("/")) if root else dst
    known = sum(i.file_size or 0 for i in listing if not i.is_dir)
    try:
        with progress(known, f"Downloading {posixpath.basename(root) or model_uri}") as bar:
            tree = _Tree(repo, root, local_root, _keep(root, skip), bar)
            tree.run(listing)
        if dst_path is None:  # ours: refused here, it is removed below, params included
            check_download(local_root, tree.crc32c)
    except BaseException:
        if dst_path is None:  # our private directory: nothing of a refused model stays
            import shutil

            shutil.rmtree(dst, ignore_errors=True)
        raise
    if outer is not repo and (local_root / "MLmodel").is_file():
        # as MLflow's download does: registered_model_meta up to MLflow 3.17, nothing since 3.18
        mlflow_private.add_registered_model_meta(outer, local_root)
    return Download(str(local_root), True, tree.crc32c, None if dst_path else str(dst))


def _list(repo: Any, path: str | None) -> list[Any]:
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


def check_download(path: Path, crc32c: dict[str, int]) -> None:
    """Check a private download before anything loads it (jax-free, cheap): a jaxexp model's
    params checkpoint against its manifest (file set, sizes, CRC-32C of the metadata files and
    of the files checksummed as they landed) and the manifest against ``MLmodel`` (written by
    the same save: ``params.manifest``'s binding). Other models, and what only JAX can judge,
    are left to the loader. Raises ``ArtifactError``."""
    from jaxexp_mlflow.codec import mlmodel
    from jaxexp_mlflow.codec.zarr import is_chunk_file
    from jaxexp_mlflow.params import manifest

    if not (path / "MLmodel").is_file():
        return
    conf = mlmodel.read_mlmodel(path).get("flavors", {})
    conf = conf.get("jaxexp") if isinstance(conf, dict) else None
    if not isinstance(conf, dict) or not isinstance(conf.get("params"), str):
        return
    from jaxexp_mlflow.codec import files

    ckpt = files.resolve_inside(path, conf["params"], what="params checkpoint")
    if not ckpt.is_dir():
        return  # the loader says what is missing
    prefix = ckpt.resolve().relative_to(path.resolve()).as_posix() + "/"
    landed = {k[len(prefix) :]: v for k, v in crc32c.items() if k.startswith(prefix)}
    found = manifest.verify_checkpoint(
        ckpt, checksum=lambda rel: rel not in landed and not is_chunk_file(rel)
    )
    found.same_save()
    for rel, value in landed.items():
        if rel in found.files:
            found.check(rel, value)
