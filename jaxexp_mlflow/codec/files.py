"""Confined, bounded reads of a model directory's files (stdlib only: no JAX, no MLflow import).

A model directory is untrusted input. Every file this package reads for a model goes through
here:

* the name comes from the model (MLmodel, a manifest): it must be relative, without ``..``, and
  its real path (symbolic links resolved) must stay inside the model directory;
* the file is opened with ``O_NOFOLLOW | O_NONBLOCK`` and ``fstat``-ed: only regular files are
  read (a FIFO or a device is refused without blocking), and the size on disk is checked against
  a limit before any buffer is allocated;
* error messages name the path as written in the model and the kind of problem, never the
  content or the listing of a file outside the model.

Checks and opening are separate system calls: a directory that is changed *while* it is loaded
by another local user is out of scope (see docs/security.md).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from jaxexp_mlflow import settings

__all__ = [
    "MAX_BLOB_BYTES",
    "fsync_path",
    "check_relative",
    "MAX_MLMODEL_BYTES",
    "MAX_SMALL_FILE_BYTES",
    "fail",
    "open_regular",
    "read_bytes",
    "read_file",
    "resolve_inside",
    "walk_files",
]

#: MLmodel is a few kB; 1 MiB leaves room for long signatures and metadata.
MAX_MLMODEL_BYTES = settings.JAXEXP_MAX_MLMODEL_BYTES.get()
#: The serialized function (StableHLO + metadata); weights live in params/, not in the blob.
MAX_BLOB_BYTES = settings.JAXEXP_MAX_BLOB_BYTES.get()
#: JSON metadata files (manifest, Orbax ``_METADATA``, ``zarr.json``).
MAX_SMALL_FILE_BYTES = 64 << 20

_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def fail(message: str) -> Exception:
    """An ``ArtifactError`` (imported lazily: this module must stay cheap to import)."""
    from jaxexp_mlflow.errors import ArtifactError

    return ArtifactError(message)


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes on the filesystem that holds (or will hold) ``path``."""
    import shutil

    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def is_disk_full(err: BaseException) -> bool:
    """Whether an error (OSError, or Orbax/TensorStore's wrapped ones) means the disk is full."""
    import errno

    return getattr(err, "errno", None) == errno.ENOSPC or "No space left on device" in str(err)


def disk_full(path: str | os.PathLike, needed: int, err: BaseException | None = None) -> Exception:
    """The ``ArtifactError`` for a model that does not fit on the disk at ``path``."""
    return fail(
        f"Not enough disk space to save the model at {path}: it needs about {needed} bytes "
        f"({needed / 2**20:.1f} MiB), the filesystem has {free_bytes(path)} bytes free"
        f"{'' if err is None else ' (No space left on device)'}. Free some space or save the "
        "model elsewhere."
    )


def _shown(name: object) -> str:
    text = repr(name)
    return text if len(text) <= 120 else text[:117] + "..."


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def check_relative(rel: object, *, what: str) -> str:
    """``rel`` if it is a non-empty relative path without ``..``; ``ArtifactError`` otherwise."""
    if not isinstance(rel, str) or not rel or "\x00" in rel:
        raise fail(
            f"The model's {what}: expected a relative path inside the model directory, found "
            f"{_shown(rel)}. The MLmodel file is damaged or was altered; download the model again."
        )
    parts = PurePosixPath(rel.replace("\\", "/")).parts
    if os.path.isabs(rel) or rel.startswith(("/", "\\")) or ".." in parts:
        raise fail(
            f"The model's {what} is {_shown(rel)}: expected a path inside the model directory, "
            "found an absolute path or a '..' escape. A model may only refer to its own files; "
            "the model was altered or built by hand: do not load it."
        )
    return rel


def resolve_inside(root: str | os.PathLike, rel: object, *, what: str) -> Path:
    """The real path of ``rel`` (a path written in the model) under ``root``; refuse escapes.

    Raises ``ArtifactError`` for a non-string or empty name, an absolute path, a ``..``
    component, or a path whose symbolic links lead outside ``root``. Nothing is opened.
    """
    check_relative(rel, what=what)
    base = os.path.realpath(root)
    full = os.path.realpath(os.path.join(base, rel))
    if full != base and os.path.commonpath([base, full]) != base:
        raise fail(
            f"The model's {what} ({_shown(rel)}) is a symbolic link leading outside the model "
            "directory. A model may only refer to its own files; replace the link by the file "
            "itself, or download the model again."
        )
    return Path(full)


def open_regular(path: str | os.PathLike, *, what: str, max_bytes: int | None) -> tuple[int, int]:
    """Open a resolved path read-only: ``(fd, size)``. Regular files only, size checked.

    ``O_NOFOLLOW`` refuses a symbolic link swapped in after ``resolve_inside``; ``O_NONBLOCK``
    keeps a FIFO from blocking the open; ``fstat`` refuses anything but a regular file.
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise fail(
            f"The model's {what} is missing: expected a file, found nothing. Download the "
            "complete model directory again."
        ) from None
    except OSError as err:
        raise fail(
            f"The model's {what} cannot be opened ({err.strerror}): expected a regular file. "
            "Download the model again."
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise fail(
                f"The model's {what}: expected a regular file, found {_kind(st.st_mode)}. A model "
                "directory holds plain files only; download the model again."
            )
        if max_bytes is not None and st.st_size > max_bytes:
            raise fail(
                f"The model's {what} has {st.st_size} bytes, more than the limit of {max_bytes}. "
                "The file is not what a jaxexp model writes there; download the model again."
            )
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def read_file(path: str | os.PathLike, *, what: str, max_bytes: int | None) -> bytes:
    """Read a whole regular file whose path is already confined (see :func:`open_regular`)."""
    fd, size = open_regular(path, what=what, max_bytes=max_bytes)
    try:
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        while got < size:
            n = os.readv(fd, [view[got:]])
            if n <= 0:
                raise fail(
                    f"The model's {what} shrank while it was read (expected {size} bytes, found "
                    f"{got}). Download the model again."
                )
            got += n
        return bytes(buf)
    finally:
        os.close(fd)


def read_bytes(root: str | os.PathLike, rel: object, *, what: str, max_bytes: int | None) -> bytes:
    """Read the model's file ``rel`` under ``root``: confined, regular, at most ``max_bytes``."""
    return read_file(resolve_inside(root, rel, what=what), what=what, max_bytes=max_bytes)


def walk_files(
    root: str | os.PathLike, rel: object, *, what: str
) -> Iterator[tuple[str, os.stat_result]]:
    """``(path relative to the directory, lstat)`` of every file under the directory ``rel``.

    The directory must resolve inside ``root``; every entry must be a regular file or a
    directory whose real path stays inside ``root`` (a symbolic link leading outside, a FIFO, a
    device or a socket raises ``ArtifactError``). Yields files in sorted order, each directory's
    files before its subdirectories, as ``os.walk(top, followlinks=True)`` visits them; a
    directory that cannot be listed is skipped, as ``os.walk`` skips it (its files are then
    missing to whoever compares the listing with a manifest). A subdirectory that is not a link
    lies where its parent's real path says: only links are resolved (``os.path.realpath``),
    which spares a checkpoint's walk a system call per path component of every directory.
    """
    top = resolve_inside(root, rel, what=what)
    base = os.path.realpath(root)
    if not top.is_dir():
        raise fail(
            f"The model's {what} ({_shown(rel)}): expected a directory, found "
            f"{'nothing' if not top.exists() else 'a file'}. Download the model again."
        )
    seen: set[str] = set()
    stack = [(str(top), str(top), ".")]  # (path walked, its real path, path relative to top)
    while stack:
        dirpath, real, rel_dir = stack.pop()
        if real != base and os.path.commonpath([base, real]) != base:
            raise fail(
                f"The model's {what} holds a symbolic link ({_shown(rel_dir)}) leading outside "
                "the model directory. Replace links by the files themselves, or download the "
                "model again."
            )
        if real in seen:
            continue
        seen.add(real)
        try:
            with os.scandir(dirpath) as listing:
                entries = sorted(listing, key=lambda e: e.name)
        except OSError:
            continue
        subdirs = []
        for entry in entries:
            try:
                is_dir = entry.is_dir()  # follows a link, as os.walk(followlinks=True) does
            except OSError:  # as os.walk: then it is listed as a file (and checked as one)
                is_dir = False
            if is_dir:
                link = entry.is_symlink()
                sub_real = os.path.realpath(entry.path) if link else os.path.join(real, entry.name)
                subdirs.append(
                    (entry.path, sub_real, os.path.normpath(os.path.join(rel_dir, entry.name)))
                )
                continue
            shown = os.path.normpath(os.path.join(rel_dir, entry.name))
            try:  # not a link: it lies where its directory's real path does (checked above)
                st = entry.stat(follow_symlinks=False)
            except OSError:
                st = None
            if st is None or stat.S_ISLNK(st.st_mode):
                target = os.path.realpath(entry.path)
                if os.path.commonpath([base, target]) != base:
                    raise fail(
                        f"The model's {what} holds a symbolic link ({_shown(shown)}) leading "
                        "outside the model directory. Replace links by the files themselves, or "
                        "download the model again."
                    )
                try:
                    st = os.stat(target)
                except OSError:
                    raise fail(
                        f"The model's {what} holds {_shown(shown)}, which cannot be read (a "
                        "broken link or a vanishing file). Download the model again."
                    ) from None
            if not stat.S_ISREG(st.st_mode):
                raise fail(
                    f"The model's {what} holds {_shown(shown)}: expected a regular file, found "
                    f"{_kind(st.st_mode)}. Download the model again."
                )
            yield shown, st
        stack.extend(reversed(subdirs))  # depth first, in sorted order


def fsync_path(path: str | os.PathLike) -> None:
    """``fsync`` the file or directory at ``path`` (a directory: its entries are durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
