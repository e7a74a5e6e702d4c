"""The per-user secret that authenticates stored executables.

Every entry of the executable stores (``jaxexp-executables``, ``jaxexp-lite``) and of the IREE
compile cache carries an HMAC-SHA256 over its file name and its bytes, made with a secret of 32
random bytes that only this user can read: ``$XDG_CONFIG_HOME/jaxexp-mlflow/cache.key``
(``~/.config/jaxexp-mlflow/cache.key``), outside every cache directory and every model
directory. Only a process of this user that read the secret can make an entry that verifies,
so an entry planted in a cache directory, shipped inside a model, renamed to another entry's
name or copied from another machine (another secret) is compiled afresh, never run.

The secret is created once, atomically and exclusively (a private temporary file linked into
place: a concurrent creator's key is never overwritten, never read half-written), mode 0600 in
a directory made 0700. A key file that is a symbolic link, not a regular file, not owned by
this user, readable or writable by group or others, or not 32 bytes long is refused: the
stores are then off (every bucket compiled) and a warning says how to fix it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
import threading
from pathlib import Path

_logger = logging.getLogger(__name__)

KEY_BYTES = 32
KEY_NAME = "cache.key"
_DOMAIN = b"jaxexp-mlflow stored executable 1\0"

_lock = threading.Lock()
_secrets: dict[str, bytes | None] = {}  # by key path: a test or a user may move XDG_CONFIG_HOME


def key_path() -> Path:
    """Where this user's secret lives: ``$XDG_CONFIG_HOME/jaxexp-mlflow/cache.key`` (an
    absolute ``XDG_CONFIG_HOME`` only, as the XDG specification asks), else under
    ``~/.config``."""
    base = os.environ.get("XDG_CONFIG_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".config")
    return Path(base, "jaxexp-mlflow", KEY_NAME)


def secret() -> bytes | None:
    """This user's secret, created on first use; None when the key file is refused or cannot
    be made (the stores are off then)."""
    path = key_path()
    found = _secrets.get(str(path), b"")
    if found != b"":
        return found
    with _lock:
        if str(path) not in _secrets:
            try:
                _secrets[str(path)] = _load_or_create(path)
            except OSError as err:
                _logger.warning(
                    "jaxexp: stored executables off: cannot make the cache key %s (%s)", path, err
                )
                _secrets[str(path)] = None
        return _secrets[str(path)]


def signer(name: str) -> hmac.HMAC | None:
    """An HMAC-SHA256 under this user's secret, started with the entry's ``name`` (its file
    name: a renamed entry does not verify); the caller feeds it the entry's bytes. None
    without a usable secret."""
    key = secret()
    if key is None:
        return None
    mac = hmac.new(key, _DOMAIN, hashlib.sha256)
    raw = name.encode()
    mac.update(len(raw).to_bytes(4, "little") + raw)
    return mac


def tag(name: str, *parts: bytes) -> str | None:
    """The hex HMAC of an entry called ``name`` holding ``parts`` (None without a secret)."""
    mac = signer(name)
    if mac is None:
        return None
    for part in parts:
        mac.update(part)
    return mac.hexdigest()


def matches(mac: hmac.HMAC | None, expected: bytes | str) -> bool:
    """Whether ``mac`` (fed the entry's bytes) gives ``expected`` (hex), in constant time."""
    if mac is None:
        return False
    want = expected.encode() if isinstance(expected, str) else bytes(expected)
    return hmac.compare_digest(mac.hexdigest().encode(), want)


def _load_or_create(path: Path) -> bytes | None:
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{KEY_NAME}.{os.getpid()}.{os.urandom(4).hex()}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(tmp, flags | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(os.urandom(KEY_BYTES))
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)  # exclusive and atomic: an existing key (another process's) wins
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)
    return _read_key(path)


def _read_key(path: Path) -> bytes | None:
    """The key at ``path`` if it is this user's private regular file of ``KEY_BYTES`` bytes."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as err:  # ELOOP: a symbolic link
        return _refuse(path, f"it cannot be opened as a plain file ({err.strerror})")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return _refuse(path, "it is not a regular file")
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            return _refuse(path, f"it is owned by uid {st.st_uid}, not by this user")
        if st.st_mode & 0o077:
            return _refuse(path, f"its mode is {stat.S_IMODE(st.st_mode):04o}, not 0600")
        data = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) != KEY_BYTES:
        return _refuse(path, f"it holds {len(data)} bytes, not {KEY_BYTES}")
    return data


def _refuse(path: Path, why: str) -> None:
    _logger.warning(
        "jaxexp: stored executables off (every bucket compiled): the cache key %s is refused: "
        "%s. Remove it (a new private key is made, and the entries it signed are compiled "
        "again).",
        path,
        why,
    )
    return None
