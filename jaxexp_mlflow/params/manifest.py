"""The params manifest: every file of the checkpoint with its size and CRC-32C (no JAX needed).

``save_params`` writes ``jaxexp_manifest.json`` into the checkpoint::

    {"format": "jaxexp-manifest", "version": 2, "checksum": "crc32c",
     "files": {"_METADATA": {"size": 397, "crc32c": "1a2b3c4d"}, "w/0.0": {...}, ...}}

and every restore checks the directory against it before (sizes, file set, metadata files) and
while (array data) reading: a file lost, added, truncated or altered is an ``ArtifactError``,
never a silently zero-filled or corrupted array. CRC-32C is computed in hardware (SSE4.2 /
ARMv8 CRC) by ``google-crc32c`` at several GB/s, so checking costs a fraction of the read itself
(benchmarks/bench_params.py). It detects damage, not forgery: whoever can rewrite the weights
can rewrite the manifest (see docs/security.md).

Manifests written before checksums existed (``{"files": {name: size}}``) are accepted with a
warning (sizes checked); a checkpoint without a manifest is refused. Only the stdlib,
``codec.crc32c`` (``google_crc32c``) and ``codec.files`` are used, so readers without JAX (the
IREE backend, ``jaxexp check``) call :func:`verify_checkpoint` too.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from jaxexp_mlflow.codec import files
from jaxexp_mlflow.codec.checked_read import read_checked
from jaxexp_mlflow.codec.crc32c import crc32c, file_crc32c, path_crc32c
from jaxexp_mlflow.codec.files import fail

__all__ = [
    "MANIFEST_FILE",
    "Manifest",
    "bind_manifest",
    "check_binding",
    "model_identity",
    "crc32c",
    "file_crc32c",
    "path_crc32c",
    "read_manifest",
    "verify_checkpoint",
    "write_manifest",
]

_logger = logging.getLogger(__name__)

MANIFEST_FILE = "jaxexp_manifest.json"
FORMAT = "jaxexp-manifest"
VERSION = 2
_MAX_FILES = 1_000_000
#: The manifest's size limit (docs/security.md: JSON metadata 64 MiB).
MAX_BYTES = files.MAX_SMALL_FILE_BYTES
#: Files up to this size that :meth:`Manifest.verify_files` checks are kept in memory as read
#: (``Manifest.held``): the checkpoint's metadata JSON, parsed right after. At most
#: ``HOLD_TOTAL_BYTES`` in all: a directory of many small files costs no more memory than that
#: (the files past it are read again when parsed, as before).
HOLD_BYTES = 64 * 1024
HOLD_TOTAL_BYTES = 16 * 1024**2
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def _parse(raw: bytes) -> Any:
    """The manifest's JSON, parsed within a budget: outside strings, every container but the
    outermost is a key's value (containers <= keys + 1) and a list holds a few values per key
    (commas <= 4 x (keys + 1)), as in every manifest this package writes. Padding such as
    32 MiB of ``[]`` (a GiB once parsed) is refused (``ArtifactError``) before parsing."""
    bare = _STRING.sub(b'""', raw)
    keys = bare.count(b":")
    containers = bare.count(b"[") + bare.count(b"{")
    if containers > keys + 1 or bare.count(b",") > 4 * (keys + 1):
        raise fail(
            f"The params manifest {MANIFEST_FILE} is beyond its reading budget: expected one "
            f"array or object per key and a few values each, found {containers} arrays/objects "
            f"and {bare.count(b',')} separators for {keys} keys. Download the model again."
        )
    return json.loads(raw)


@dataclass
class Manifest:
    """The checkpoint's files: ``{relative path: (size, crc32c or None)}``.

    ``legacy`` is True for a manifest without checksums (written before version 2).
    """

    directory: Path
    files: dict[str, tuple[int, int | None]]
    legacy: bool = False
    verified: set[str] = field(default_factory=set)
    #: the save this checkpoint belongs to (``bind_manifest``), None for older manifests
    model: dict[str, str] | None = None
    #: why the checkpoint is not the one the MLmodel beside it was saved with (set by
    #: :func:`verify_checkpoint`), raised by :meth:`same_save` before any data is accepted:
    #: after the tree, shape and dtype checks, which say more when those differ too
    foreign: str | None = None
    #: ``{relative path: (st_dev, st_ino)}`` of the files :func:`verify_checkpoint` found
    #: inside the directory: :meth:`verify_files` opens those by name and checks it got the
    #: same file, instead of resolving every path component again
    found: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: ``{relative path: bytes}`` of the small files :meth:`verify_files` checked (at most
    #: :data:`HOLD_BYTES` each: metadata JSON), kept so that what is parsed next is what was
    #: checked, without opening the file again (``params.layout``, ``codec.zarr.read_meta``)
    held: dict[str, bytes] = field(default_factory=dict)
    _held_bytes: int = 0

    def same_save(self) -> None:
        """Raise the binding mismatch :func:`verify_checkpoint` found, if any."""
        if self.foreign is not None:
            raise fail(self.foreign)

    def check(self, rel: str, value: int) -> None:
        """Record that ``rel`` was read whole with CRC ``value``; raise if it differs (or if
        the checkpoint is not the MLmodel's: data is about to be accepted)."""
        self.same_save()
        self._check(rel, value)

    def _check(self, rel: str, value: int) -> None:
        size, want = self.files[rel]
        if want is not None and value != want:
            raise fail(
                f"The params file {rel!r} does not match its checksum in {MANIFEST_FILE} "
                f"(expected crc32c {want:08x}, found {value:08x}, {size} bytes): the weights were "
                "altered or damaged on disk. Download the model again or restore it from a backup."
            )
        self.verified.add(rel)

    def verify_files(self, names: list[str] | None = None) -> None:
        """Checksum the named files (default: every file not yet verified, after checking
        that the checkpoint belongs to the MLmodel beside it)."""
        if names is None:
            self.same_save()
        for rel in sorted(self.files) if names is None else names:
            if rel in self.verified:
                continue
            size, want = self.files[rel]
            if want is None:
                self.verified.add(rel)
                continue
            ident = self.found.get(rel)
            path = (
                files.resolve_inside(self.directory, rel, what=f"params file {rel!r}")
                if ident is None
                else self.directory / rel
            )
            fd, found = files.open_regular(path, what=f"params file {rel!r}", max_bytes=size)
            try:  # big files on several threads at once (codec.checked_read)
                if ident is not None and ident != _ident(os.fstat(fd)):
                    raise fail(
                        f"The params file {rel!r} was replaced while the checkpoint was checked: "
                        "expected the file found in the directory a moment before, found another. "
                        "Load the model again once nothing writes to it."
                    )
                if found <= HOLD_BYTES and self._held_bytes + found <= HOLD_TOTAL_BYTES:
                    data = _read_whole(fd, found, rel)  # metadata: kept as checked, to parse
                    self._check(rel, crc32c(data))
                    self.held[rel] = data
                    self._held_bytes += found
                else:
                    what = f"The params file {rel!r}"
                    self._check(rel, read_checked(fd, found, [], what=what))
            finally:
                os.close(fd)


def _read_whole(fd: int, size: int, rel: str) -> bytes:
    """The ``size`` bytes of the open file ``fd`` (one ``pread`` for a small file)."""
    parts, done = [], 0
    while done < size:
        part = os.pread(fd, size - done, done)
        if not part:
            raise fail(
                f"The params file {rel!r} ended early: expected {size} bytes, found {done}. The "
                "checkpoint is damaged; download the model again."
            )
        parts.append(part)
        done += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _entry(rel: object, value: object, where: Path) -> tuple[str, tuple[int, int | None]]:
    def bad(found: str) -> Exception:
        return fail(
            f"The params manifest {where.name} is damaged: expected entries "
            f'"<relative path>": {{"size": <bytes>, "crc32c": "<8 hex digits>"}}, found {found}. '
            "Download the model again."
        )

    if not isinstance(rel, str) or not rel or len(rel) > 4096:
        raise bad("an entry without a usable name")
    parts = PurePosixPath(rel).parts
    if rel.startswith("/") or ".." in parts or "\x00" in rel or rel == MANIFEST_FILE:
        raise bad(f"the entry {rel[:100]!r} (an absolute path, a '..' escape or itself)")
    if isinstance(value, int) and not isinstance(value, bool):  # version 1: size only
        size, crc = value, None
    elif isinstance(value, dict):
        size, text = value.get("size"), value.get("crc32c")
        if not isinstance(text, str) or len(text) != 8:
            raise bad(f"{rel[:100]!r} without an 8-digit crc32c")
        try:
            crc = int(text, 16)
        except ValueError:
            raise bad(f"{rel[:100]!r} with a crc32c that is not hexadecimal") from None
    else:
        raise bad(f"{rel[:100]!r} mapped to a {type(value).__name__}")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise bad(f"{rel[:100]!r} without a valid size")
    return rel, (size, crc)


def read_manifest(directory: str | os.PathLike) -> Manifest:
    """Parse and validate the manifest of the checkpoint at ``directory`` (no data files read).

    A missing or malformed manifest raises ``ArtifactError``; a version-1 manifest (sizes only)
    comes back with ``legacy=True``.
    """
    path = Path(directory)
    where = path / MANIFEST_FILE
    if not os.path.lexists(where):
        raise fail(
            f"The params checkpoint has no {MANIFEST_FILE}: expected the list of its files with "
            "their checksums, found none, so damaged or foreign weights could not be detected. "
            "Re-log the model with this version of jaxexp-mlflow (or pass the checkpoint "
            "directory as params= to log_model, which writes the manifest)."
        )
    raw = files.read_file(where, what=f"params manifest {MANIFEST_FILE}", max_bytes=MAX_BYTES)
    try:
        doc = _parse(raw)
    except (ValueError, RecursionError) as err:
        raise fail(
            f"The params manifest {MANIFEST_FILE} is not valid JSON ({type(err).__name__}). "
            "Download the model again."
        ) from None
    entries = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(entries, dict) or len(entries) > _MAX_FILES:
        raise fail(
            f"The params manifest {MANIFEST_FILE} is damaged: expected an object with a 'files' "
            f"mapping, found {type(entries if isinstance(doc, dict) else doc).__name__}. "
            "Download the model again."
        )
    version = doc.get("version", 1)
    if version not in (1, VERSION) or (version == VERSION and doc.get("checksum") != "crc32c"):
        raise fail(
            f"The params manifest {MANIFEST_FILE} has version {str(version)[:20]!r} / checksum "
            f"{str(doc.get('checksum'))[:20]!r}: expected version {VERSION} with crc32c. It was "
            "written by a newer jaxexp-mlflow: upgrade jaxexp-mlflow."
        )
    parsed = dict(_entry(k, v, where) for k, v in entries.items())
    legacy = any(crc is None for _, crc in parsed.values())
    if version == VERSION and legacy:
        raise fail(
            f"The params manifest {MANIFEST_FILE} lacks a checksum for some files; every file of "
            "a version 2 manifest has one. Download the model again."
        )
    return Manifest(path, parsed, legacy=legacy, model=_binding(doc.get("model"), where))


#: What binds a checkpoint to the save that wrote it: MLmodel's creation time (MLflow's
#: ``utc_time_created``, new for every save and log, kept by every MLflow tool that edits an
#: MLmodel) and the blob's sha256 (the ``jaxexp`` section's ``exported_sha256``).
_BINDING_KEYS = ("utc_time_created", "exported_sha256")


def _binding(value: object, where: Path) -> dict[str, str] | None:
    if value is None:
        return None
    if (
        not isinstance(value, dict)
        or not value
        or any(k not in _BINDING_KEYS for k in value)
        or not all(isinstance(v, str) and 0 < len(v) <= 200 for v in value.values())
    ):
        raise fail(
            f"The params manifest {where.name} is damaged: expected 'model' to map "
            f"{list(_BINDING_KEYS)} to strings, found {str(value)[:200]}. Download the model "
            "again."
        )
    return dict(value)


def model_identity(mlmodel: dict[str, Any]) -> dict[str, str]:
    """What identifies the save that wrote this MLmodel (a parsed MLmodel mapping)."""
    flavors = mlmodel.get("flavors")
    conf = flavors.get("jaxexp") if isinstance(flavors, dict) else None
    found = {
        "utc_time_created": mlmodel.get("utc_time_created"),
        "exported_sha256": conf.get("exported_sha256") if isinstance(conf, dict) else None,
    }
    return {k: str(v)[:200] for k, v in found.items() if v not in (None, "")}


def bind_manifest(directory: str | os.PathLike, identity: dict[str, str]) -> None:
    """Record in the checkpoint's manifest which save it belongs to (``model_identity`` of the
    MLmodel beside it): a model directory that mixes two saves, such as a re-log into the same
    ``model_id`` cut between the new params and the new MLmodel, is then refused by
    :func:`verify_checkpoint` instead of loading one save's function with the other's weights.
    The manifest is replaced (a new inode: it may be a hard link into another checkpoint)."""
    if not identity:
        return
    path = Path(directory) / MANIFEST_FILE
    raw = files.read_file(path, what=f"params manifest {MANIFEST_FILE}", max_bytes=MAX_BYTES)
    doc = _parse(raw)
    doc["model"] = dict(identity)
    _replace(path, json.dumps(doc, indent=0))


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def check_binding(
    directory: str | os.PathLike, manifest: Manifest, *, mlmodel: dict[str, Any] | None = None
) -> str | None:
    """Why the checkpoint at ``directory`` does not belong to the save that wrote the MLmodel
    of the model directory holding it (its parent), or None: judged when its manifest records
    its save and that MLmodel is there (a checkpoint on its own is not judged). ``mlmodel``:
    that MLmodel as the load already parsed it (``store.model_files``), not read again."""
    if not manifest.model:
        return None
    model_dir = Path(directory).parent
    if not os.path.lexists(model_dir / "MLmodel"):
        return None
    if mlmodel is None:
        from jaxexp_mlflow.codec.mlmodel import read_mlmodel

        mlmodel = read_mlmodel(model_dir)
    found = model_identity(mlmodel)
    diff = [
        f"{k}: the params were saved with {v!r}, MLmodel has {found.get(k)!r}"
        for k, v in sorted(manifest.model.items())
        if found.get(k) != v
    ]
    if not diff:
        return None
    return (
        "The params checkpoint does not belong to the model's MLmodel: the model directory "
        "mixes files of two saves (a re-log into the same model_id cut part way, or files "
        "copied over another model), so these are not the weights this function was saved "
        "with:\n- " + "\n- ".join(diff) + "\nNothing was loaded. Log the model again, or "
        "restore the directory from a backup."
    )


def _ident(st: os.stat_result) -> tuple[int, int]:
    return (st.st_dev, st.st_ino)


def verify_checkpoint(
    directory: str | os.PathLike,
    *,
    checksum: bool | Callable[[str], bool] = True,
    mlmodel: dict[str, Any] | None = None,
) -> Manifest:
    """Check the checkpoint at ``directory`` against its manifest; return the manifest.

    Always: every file under ``directory`` is a regular file inside it (no link leading out, no
    FIFO or device), the files on disk are exactly those listed (none missing, none added), each
    with the listed size. ``checksum`` selects the files whose CRC is verified now (True: all;
    a predicate on the relative path: those; the rest can be verified as they are read, with
    :meth:`Manifest.check`, or later with :meth:`Manifest.verify_files`). Raises
    ``ArtifactError`` listing at most ten problems. ``mlmodel``: the parsed MLmodel of the
    model directory holding the checkpoint, for :func:`check_binding`.
    """
    path = Path(directory)
    manifest = read_manifest(path)
    # raised before data is accepted
    manifest.foreign = check_binding(path, manifest, mlmodel=mlmodel)
    if manifest.legacy:
        _logger.warning(
            "jaxexp: the params checkpoint %s has a manifest without checksums (saved by "
            "jaxexp-mlflow before checksums were recorded): sizes are checked, contents are "
            "not. Re-log the model to protect it.",
            path,
        )
    on_disk = {}
    for rel, st in files.walk_files(path, ".", what="params checkpoint"):
        if rel != MANIFEST_FILE:
            on_disk[rel] = st.st_size
            manifest.found[rel] = _ident(st)
    problems = []
    for rel, (size, _) in manifest.files.items():
        found = on_disk.get(rel)
        if found != size:
            problems.append(
                f"{rel}: expected {size} bytes, found {'no file' if found is None else found}"
            )
    extra = sorted(set(on_disk) - set(manifest.files))
    problems += [f"{rel}: not in the manifest (expected no such file)" for rel in extra]
    if problems:
        shown = ";\n  ".join(problems[:10]) + (
            f";\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        )
        raise fail(
            f"The params checkpoint is incomplete ({len(problems)} of "
            f"{len(manifest.files)} files):\n  {shown}.\nThe download or copy lost or altered "
            "files: download the model again. "
            "If files keep missing, the artifact store drops them: re-log the model with this "
            "version of jaxexp-mlflow, which stores no directory of a single file."
        )
    if checksum is True:
        manifest.verify_files()
    elif checksum:
        manifest.verify_files([rel for rel in sorted(manifest.files) if checksum(rel)])
    return manifest


def write_manifest(
    directory: str | os.PathLike,
    known: Callable[[dict[str, int]], dict[str, tuple[int, int]]] | None = None,
) -> dict:
    """Write the version-2 manifest of the checkpoint at ``directory``; return its content.

    ``known``: called with ``{relative path: size}`` of the files found, it returns
    ``{relative path: (size, crc32c)}`` for files whose checksum is already known (computed from
    the bytes in memory while they were written: ``params.memory_crc``); those files are not
    read, the others are. A file whose size differs from the known one is read.
    """
    path = Path(directory)
    found = {
        rel: st.st_size
        for rel, st in files.walk_files(path, ".", what="params checkpoint")
        if rel != MANIFEST_FILE
    }
    given = known(found) if known is not None else {}
    entries = {}
    for rel in found:
        size_crc = given.get(rel)
        if size_crc is not None and size_crc[0] == found[rel]:
            entries[rel] = {"size": size_crc[0], "crc32c": f"{size_crc[1]:08x}"}
            continue
        fd, size = files.open_regular(path / rel, what=f"params file {rel!r}", max_bytes=None)
        try:
            entries[rel] = {"size": size, "crc32c": f"{file_crc32c(fd, size):08x}"}
        finally:
            os.close(fd)
    entries = dict(sorted(entries.items()))
    doc = {"format": FORMAT, "version": VERSION, "checksum": "crc32c", "files": entries}
    (path / MANIFEST_FILE).write_text(json.dumps(doc, indent=0))
    return doc
