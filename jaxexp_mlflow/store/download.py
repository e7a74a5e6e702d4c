"""Model directories down from an MLflow artifact store, bounded and checked.

``download_model`` lists and downloads on one pool (``store.transfer``), every listing
bounded (``ListBounds``), every file stopped at its listed size, and checks the result
without JAX (``check_download``); ``fetch_listed`` and ``list_top`` give the CLI single
files of a model under the same bounds. A store is untrusted input.
"""

from __future__ import annotations

import os
import posixpath
import threading
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, NamedTuple

from jaxexp_mlflow.internals import mlflow_private
from jaxexp_mlflow.store.transfer import (
    CHECKSUM_MIN_BYTES,
    MANIFEST,
    ListBounds,
    grow_total,
    list_checked,
    progress,
    workers,
)


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
        self.bounds = ListBounds(root)
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
        none deeper or more numerous than the limits (``ListBounds``).
        """
        self.bounds.check(parent if parent is not None else self.root, [i.path for i in listing])
        listing = [i for i in listing if self.keep(i)]
        dirs = [i for i in listing if i.is_dir]
        manifest = next((i for i in listing if posixpath.basename(i.path) == MANIFEST), None)
        if dirs and manifest is not None:
            named = self._from_manifest(manifest, {d.path for d in dirs})
            if named is not None:
                listing = [i for i in listing if not i.is_dir and i is not manifest] + named
                dirs = []
        files = sorted((i for i in listing if not i.is_dir), key=lambda i: -(i.file_size or 0))
        targets = [(info, self._local(info)) for info in files]  # all checked before any starts
        for info in dirs:
            self._submit(lambda p: self.add(list_checked(self.repo, p), p), info.path)
        grow_total(self.bar, self.lock, sum(i.file_size or 0 for i in files))
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
        fetched = self._check_used(base, self._local(info).parent, entries, named)
        return [i for i in named if i.path not in fetched]

    def _check_used(self, base: str, root: Path, entries: dict, named: list[Any]) -> set[str]:
        """Fetch the arrays' zarr metadata among ``named`` and refuse, before anything else
        of the checkpoint is downloaded, every file no array uses (``store.used_files``).
        Returns the store paths fetched here."""
        from jaxexp_mlflow.codec import zarr
        from jaxexp_mlflow.errors import ArtifactError
        from jaxexp_mlflow.store import used_files

        by_path = {i.path: i for i in named}
        fetched: set[str] = set()
        for rel in used_files.metadata_files(entries):
            info = by_path[posixpath.join(base, rel)]
            fetch_listed(self.repo, info, self._local(info), max_bytes=used_files.META_MAX_BYTES)
            fetched.add(info.path)
        ocdbt = any(posixpath.basename(rel) == "manifest.ocdbt" for rel in entries)
        bad = used_files.refused(entries, lambda d: zarr.read_meta(root, d, entries), ocdbt)
        if bad:
            rel, size, why = bad[0]
            more = f" (and {len(bad) - 1} more files)" if len(bad) > 1 else ""
            raise ArtifactError(
                f"The params manifest lists {rel!r} ({size} bytes), {why}: expected only the "
                f"files the checkpoint's arrays use{more}. Nothing of it was downloaded; the "
                "stored model was altered (a store adding files), log it again."
            )
        return fetched

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
    top-level entries), the listing checked like a download's (``ListBounds``, sizes): what
    ``jaxexp inspect/check/audit`` fetch single files from."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    model_uri = _logged_model_uri(model_uri)
    resolved = resolve_repository(model_uri)
    if resolved is not None:
        _, repo, root = resolved
    else:
        root_uri, root = mlflow_private.root_uri_and_artifact_path(model_uri)
        repo, root = get_artifact_repository(root_uri), root or ""
    listing = list_checked(repo, root or None)
    ListBounds(root).check(root, [i.path for i in listing])
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
    #: the bytes of its MLmodel as ``check_download`` read them (None: not read here)
    mlmodel: bytes | None = None


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
    listing = list_checked(repo, root or None)
    if not listing:  # a file URI, or nothing there: let MLflow say what it is
        return Download(download_artifacts(artifact_uri=model_uri, dst_path=dst_path), False, {})
    dst = Path(dst_path or create_tmp_dir()).absolute()
    local_root = dst / posixpath.basename(root.rstrip("/")) if root else dst
    known = sum(i.file_size or 0 for i in listing if not i.is_dir)
    try:
        with progress(known, f"Downloading {posixpath.basename(root) or model_uri}") as bar:
            tree = _Tree(repo, root, local_root, _keep(root, skip), bar)
            tree.run(listing)
        raw = None
        if dst_path is None:  # ours: refused here, it is removed below, params included
            raw = check_download(local_root, tree.crc32c)
    except BaseException:
        if dst_path is None:  # our private directory: nothing of a refused model stays
            import shutil

            shutil.rmtree(dst, ignore_errors=True)
        raise
    if outer is not repo and (local_root / "MLmodel").is_file():
        # as MLflow's download does: registered_model_meta up to MLflow 3.17, nothing since 3.18
        mlflow_private.add_registered_model_meta(outer, local_root)
    return Download(str(local_root), True, tree.crc32c, None if dst_path else str(dst), raw)


def check_download(path: Path, crc32c: dict[str, int]) -> bytes | None:
    """Check a private download before anything loads it (jax-free, cheap): a jaxexp model's
    params checkpoint against its manifest (file set, sizes, CRC-32C of the metadata files and
    of the files checksummed as they landed) and the manifest against ``MLmodel`` (written by
    the same save: ``params.manifest``'s binding). Other models, and what only JAX can judge,
    are left to the loader. Raises ``ArtifactError``. Returns the bytes of ``MLmodel`` as it
    read them (None without one): the load parses them instead of reading the file again."""
    from jaxexp_mlflow.codec import mlmodel
    from jaxexp_mlflow.codec.zarr import is_chunk_file
    from jaxexp_mlflow.params import manifest

    if not (path / "MLmodel").is_file():
        return None
    raw = mlmodel.read_mlmodel_bytes(path)
    parsed = mlmodel.parse_mlmodel(raw)
    conf = parsed.get("flavors", {})
    conf = conf.get("jaxexp") if isinstance(conf, dict) else None
    if not isinstance(conf, dict) or not isinstance(conf.get("params"), str):
        return raw
    from jaxexp_mlflow.codec import files

    ckpt = files.resolve_inside(path, conf["params"], what="params checkpoint")
    if not ckpt.is_dir():
        return raw  # the loader says what is missing
    prefix = ckpt.resolve().relative_to(path.resolve()).as_posix() + "/"
    landed = {k[len(prefix) :]: v for k, v in crc32c.items() if k.startswith(prefix)}
    found = manifest.verify_checkpoint(
        ckpt,
        checksum=lambda rel: rel not in landed and not is_chunk_file(rel),
        mlmodel=parsed if ckpt.parent.resolve() == path.resolve() else None,
    )
    found.same_save()
    for rel, value in landed.items():
        if rel in found.files:
            found.check(rel, value)
    return raw
