"""Model directories up to an MLflow artifact store, on the pool of ``store.transfer``.

``EarlyUpload`` sends every file of ``log_model`` as soon as it exists (params chunks
while the save is still writing, the params manifest last); ``stage_upload`` and
``upload_dirs`` send whole directories in parallel after ``save_model``.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from jaxexp_mlflow import settings
from jaxexp_mlflow.store.transfer import (
    MANIFEST,
    ListBounds,
    SilentProgress,
    grow_total,
    list_checked,
    progress,
    run_all,
    workers,
)


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

        run_all(tasks, one)
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
            settings.JAXEXP_EARLY_UPLOAD.get()
        )
        self.subdir = subdir  # the params directory, whose manifest goes up last
        self.submitted: set[str] = set()  # paths (relative to the model) on their way up
        self.futures: list[Future] = []
        self.lock = threading.Lock()
        self.stage: Path | None = None
        self.pool: ThreadPoolExecutor | None = None
        self._progress = contextlib.ExitStack()
        self.bar: Any = SilentProgress()
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
        bounds = ListBounds("")
        out: set[str] = set()
        todo: list[str | None] = [None]
        try:
            while todo:
                parent = todo.pop()
                infos = list_checked(self.repo, parent)
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
        biggest first, except those already on their way."""
        if not self.enabled:
            return
        root = Path(local_dir)
        found = [(p.stat().st_size, p) for p in root.rglob("*") if p.is_file()]
        for _, path in sorted(found, key=lambda f: (-f[0], f[1])):  # biggest first
            key = f"{where}/{path.relative_to(root).as_posix()}"
            if key not in self.submitted:  # not twice
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
        if key == f"{self.subdir}/{MANIFEST}":  # last of ours: see finish()
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
        grow_total(self.bar, self.lock, link.stat().st_size)  # learnt as the files arrive
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
            self.repo.log_artifact(str(Path(params_dir, MANIFEST)), self.subdir)

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
