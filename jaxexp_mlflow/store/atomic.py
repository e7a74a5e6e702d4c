"""Atomic model directories: build a model in a temporary sibling, then rename it into place.

``save_model`` writes every file of a model into ``.<name>.jaxexp-tmp-<random>`` next to the
target and, once the model has been read back and found loadable, renames that directory to the
target in one ``rename(2)``. So:

* a failure at any point (an exception, a refused read-back) removes the temporary directory and
  leaves the target as it was: absent, or the empty directory the caller made;
* two processes saving to one path both build their own complete copy; the first rename wins,
  the second finds a non-empty target and fails with :class:`SaveConflictError`, removing its
  copy: the path ends with exactly one complete model, never a mix of two;
* a process killed mid-save (SIGKILL, power loss) leaves at most a hidden ``.jaxexp-tmp-``
  sibling, never a half model at the target.

:func:`atomic_directory` is independent of what is written, so that other writers (an artifact
upload staging a local copy, for one) can reuse it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS

from jaxexp_mlflow.codec.files import fsync_path
from jaxexp_mlflow.errors import SaveConflictError

#: Marker in the names of temporary sibling directories (``.<name>.jaxexp-tmp-<hex>``).
TMP_MARKER = ".jaxexp-tmp-"


def _is_non_empty_dir(path: Path) -> bool:
    try:
        with os.scandir(path) as entries:
            return any(True for _ in entries)
    except NotADirectoryError:
        return True  # a file is in the way: as "taken" as a non-empty directory
    except FileNotFoundError:
        return False


def check_target(path: str | os.PathLike) -> None:
    """Refuse a target that already holds something (MLflow's own rule and error)."""
    if _is_non_empty_dir(Path(path)):
        raise MlflowException(
            message=f"Path '{os.fspath(path)}' already exists and is not empty",
            error_code=RESOURCE_ALREADY_EXISTS,
        )


def publish(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Rename the finished directory ``tmp`` to ``path`` (absent or empty), atomically.

    Raises :class:`SaveConflictError` when ``path`` was filled meanwhile (another save won).
    """
    tmp, path = Path(tmp), Path(path)
    try:
        os.rename(tmp, path)  # replaces an empty directory; fails on a non-empty one
    except OSError as err:
        if err.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise
        raise SaveConflictError(
            f"Cannot save the model to {path}: expected the path to be absent or empty when the "
            f"model was complete, found another model (or file) there: another save to the same "
            "path finished first. That model was kept whole and this one discarded. Save to "
            "another path, or remove the existing one and save again."
        ) from err
    fsync_path(path.parent)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, *, durable: bool = True) -> Iterator[Path]:
    """Yield a new temporary sibling of ``path`` to write into; publish it on success.

    ``path`` must be absent or an empty directory (else MLflow's ``RESOURCE_ALREADY_EXISTS``).
    On any exception the temporary directory is removed and ``path`` is left untouched. With
    ``durable`` every file is fsynced before the rename, so that the model survives a crash once
    this returns.
    """
    final = Path(path).absolute()
    check_target(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}{TMP_MARKER}{uuid.uuid4().hex[:12]}"
    tmp.mkdir()  # honours the umask, unlike tempfile.mkdtemp's 0700
    try:
        yield tmp
        if durable:
            from jaxexp_mlflow.params import fsync_tree

            fsync_tree(tmp)
        publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
