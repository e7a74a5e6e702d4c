"""The file format of stored executables (``jaxexp-executables``, ``jaxexp-lite``).

An entry is the magic line, the hex HMAC-SHA256 (``runtime/cache_auth.py``) over the entry's
file name and everything after it, then the payload: a serialized executable, machine code this
process will run. Optionally a header of its own comes first (a 4-byte little-endian length,
then that many bytes: the lite store's). The HMAC is made with this user's secret, so only a
process of this user writes an entry that verifies: one planted in the directory, renamed or
hard-linked to another name, or copied from another machine is not read, and the bucket is
compiled (and stored) afresh. Entries are written atomically (temporary file, rename) and read
only from regular files of this user with one link.
"""

from __future__ import annotations

import os
import stat
import tempfile
import time
from pathlib import Path

from jaxexp_mlflow.runtime import cache_auth

MAX_ENTRIES = 256
MAX_BYTES = 1 << 30
#: a new format gets a new line: entries of another format (unauthenticated ones) are not read
MAGIC = b"jaxexp-executable-2\n"
_TAG = 64  # hex HMAC-SHA256


def read_entry(path: Path, headed: bool = False) -> tuple[bytes, bytes] | None:
    """One entry: a regular file of this user with one link, its HMAC verified under its file
    name; ``(header, payload)``, None otherwise. ``OSError`` when it cannot be opened.

    ``headed``: the payload starts with a header of its own, returned apart. Each part is read
    into a bytes object of its own (a serialized executable must be one for jaxlib), so a 7.5
    MB entry costs one allocation of its size, not three copies (a fresh process pays each in
    new pages: 19-53 -> 9-13 ms for the transformer of the ONNX comparison). ``header`` is
    ``b""`` otherwise."""
    mac = cache_auth.signer(path.name)
    if mac is None:
        return None
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    flags |= getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)  # no link, no FIFO wait
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        mine = not hasattr(os, "getuid") or st.st_uid == os.getuid()
        if not stat.S_ISREG(st.st_mode) or not mine or st.st_nlink != 1:
            return None
        if st.st_size > MAX_BYTES:
            return None
        head = len(MAGIC) + _TAG
        with os.fdopen(fd, "rb", closefd=False) as fh:
            lead = fh.read(head)
            if len(lead) < head or not lead.startswith(MAGIC):
                return None
            header, left = b"", st.st_size - head
            if headed:
                size = fh.read(4)
                n = int.from_bytes(size, "little")
                if len(size) < 4 or n > left - 4:
                    return None
                header = fh.read(n)
                mac.update(size)
                mac.update(header)
                left -= 4 + n
            payload = fh.read(left)  # one bytes object of the stated size
            if len(payload) != left or fh.read(1):  # the file changed size meanwhile
                return None
    finally:
        os.close(fd)
    mac.update(payload)
    if not cache_auth.matches(mac, lead[len(MAGIC) :]):
        return None
    return header, payload


def write_entry(directory: Path, path: Path, payload: bytes, header: bytes | None = None) -> None:
    """Store ``payload`` at ``path`` atomically, after the magic and the HMAC of what follows
    under ``path``'s name; ``header``: written before the payload, framed as
    :func:`read_entry` ``headed=True`` reads it. The parts are written as they are, not
    joined. ``OSError`` when the directory cannot be written or there is no usable secret."""
    parts = [payload] if header is None else [len(header).to_bytes(4, "little"), header, payload]
    tag = cache_auth.tag(path.name, *parts)
    if tag is None:
        raise PermissionError(f"no usable cache key ({cache_auth.key_path()})")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(MAGIC + tag.encode())
            for part in parts:
                fh.write(part)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def prune(directory: Path, pattern: str, keep: int = MAX_ENTRIES) -> None:
    """Keep the newest ``keep`` entries matching ``pattern``; drop writes left half done an
    hour ago (a process killed while storing)."""
    for tmp in directory.glob(".tmp-*"):
        try:
            if tmp.is_file() and time.time() - tmp.stat().st_mtime > 3600:
                tmp.unlink()
        except OSError:
            pass
    entries = [p for p in directory.glob(pattern) if p.is_file()]
    if len(entries) <= keep:
        return
    entries.sort(key=lambda p: p.stat().st_mtime)
    for old in entries[: len(entries) - keep]:
        old.unlink(missing_ok=True)
