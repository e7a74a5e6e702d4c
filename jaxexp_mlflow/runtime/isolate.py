"""Run JAX's deserialization of an untrusted blob in a child process first.

``jax.export.deserialize`` and the MLIR reader behind ``Exported.mlir_module()`` are native code
that trusts its input: a damaged StableHLO module (with a consistent sha256, e.g. logged from
such bytes) can crash the process (SIGSEGV, SIGABRT), allocate without bound or hang. The
jax-free reader (``codec.reader``, ``codec.mlir_bytecode``) validates the flatbuffer and the
bytecode's framing first, but only JAX parses the module for real. ``probe`` does exactly that
in a fresh interpreter with an address-space cap (``resource.setrlimit(RLIMIT_AS)``) and a
timeout, so a crash, a runaway allocation or a hang becomes an ``ArtifactError`` here.

``jaxexp check`` and ``jaxexp verify`` always probe; ``load_model(..., isolate=True)`` does too
(about one second: the child imports JAX, and MLflow only to register a blob's custom pytree node
types). A blob that passed is not probed again by the same JAX under the same environment and
limits: an authenticated record of the pass is kept beside the compilation cache
(``runtime.probed``). Without ``isolate``, ``load_model`` trusts a blob that passed the checksum
and the jax-free checks (see docs/security.md).
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
from typing import Any

from jaxexp_mlflow import settings
from jaxexp_mlflow.errors import ArtifactError
from jaxexp_mlflow.runtime import probed

#: Address-space cap of the child (JAX alone reserves about 1 GiB of virtual memory).
DEFAULT_MEMORY_BYTES = settings.JAXEXP_ISOLATE_MEMORY_BYTES.get()
DEFAULT_TIMEOUT_S = settings.JAXEXP_ISOLATE_TIMEOUT_S.get()

_CHILD = """
import json, os, resource, struct, sys
cap = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
data = sys.stdin.buffer.read()
(n,) = struct.unpack(">I", data[:4])
node_types = [t for t in json.loads(data[4 : 4 + n].decode("utf-8")) if t]
data = data[4 + n :]
import jax
import jax.export
if node_types:  # only then: the registrations import MLflow (about a second), via errors.py
    from jaxexp_mlflow.codec.pytrees import register_for_load
    register_for_load(node_types)
try:
    exported = jax.export.deserialize(bytearray(data))
    exported.mlir_module()
except MemoryError:
    os._exit(3)
except Exception as err:
    sys.stdout.write(f"REFUSED {type(err).__name__}: {err}"[:400])
    sys.stdout.flush()
    os._exit(4)
os._exit(0)
"""


def _child_input(data: bytes | bytearray | memoryview, node_types: list[str]) -> bytes:
    """What the child reads on stdin: the node type names (length-prefixed JSON), then the
    blob. Nothing the model wrote goes on the child's command line (no ``E2BIG``, no option
    injection)."""
    names = json.dumps(list(node_types)).encode("utf-8")
    return struct.pack(">I", len(names)) + names + bytes(data)


def _expired_flag_set() -> bool:
    """Whether this process's jax reads expired blobs (``jax_export_deserialize_expired_versions``
    set through ``jax.config.update``, which a child does not inherit)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return False
    return bool(getattr(jax.config, "jax_export_deserialize_expired_versions", False))


def probe(
    data: bytes | bytearray | memoryview,
    *,
    source: str,
    node_types: list[str] | None = None,
    memory_bytes: int | None = None,
    timeout_s: float | None = None,
) -> None:
    """Deserialize ``data`` (and parse its MLIR module) in a capped child; raise if it fails.

    Raises ``ArtifactError`` naming how the child ended: killed by a signal (a crash inside
    JAX), out of memory under the cap, past the timeout, or a Python error from JAX. A pass is
    recorded (``runtime.probed``): the same blob under the same conditions starts no child again.
    """
    cap = int(memory_bytes or DEFAULT_MEMORY_BYTES)
    timeout = float(timeout_s or DEFAULT_TIMEOUT_S)
    names = list(node_types or [])
    if names:  # typed errors (ArtifactError) here, before a child is started
        from jaxexp_mlflow.codec.mlmodel import check_node_type_names
        from jaxexp_mlflow.codec.pytrees import register_for_load

        check_node_type_names(names)
        register_for_load(names)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    if _expired_flag_set():  # set in this process with jax.config.update: the child reads alike
        env["JAX_EXPORT_DESERIALIZE_EXPIRED_VERSIONS"] = "1"
    # -P: the current directory (perhaps a model directory, `jaxexp check .`) is not put first
    # on sys.path; the child runs in an empty directory of its own, so that relative entries of
    # PYTHONPATH name nothing either. It imports jax and jaxexp_mlflow from the installation.
    cmd = [sys.executable, "-P", "-c", _CHILD, str(cap)]
    record = probed.record_name(data, names, memory_bytes=cap, timeout_s=timeout, env=env)
    if probed.passed_before(record):  # this very blob, read by this JAX, under these limits
        return
    try:
        with tempfile.TemporaryDirectory(prefix="jaxexp-isolate-") as cwd:
            proc = subprocess.run(
                cmd,
                input=_child_input(data, names),
                capture_output=True,
                timeout=timeout,
                env=env,
                cwd=cwd,
                check=False,
            )
    except subprocess.TimeoutExpired:
        raise ArtifactError(
            f"JAX did not finish deserializing {source} within {timeout:g} s (in an isolated "
            "child process): the serialized function is damaged or hostile. Do not load it; "
            "re-log the model from its source."
        ) from None
    code = proc.returncode
    if code == 0:
        probed.remember(record)
        return
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else code
        found = f"JAX crashed ({name})"
    elif code == 3:
        found = f"JAX ran out of the {cap >> 20} MiB memory cap"
    elif code == 4:
        detail = proc.stdout.decode("utf-8", "replace").removeprefix("REFUSED ")
        found = f"JAX refused it ({' '.join(detail.split())[:300]})"
    else:
        tail = proc.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or ["?"]
        found = f"the child exited with status {code} ({tail[0][:200]})"
    raise ArtifactError(
        f"{source} cannot be deserialized safely: {found} while reading it in an isolated child "
        "process. The serialized function is damaged or not meant for this JAX; do not load "
        "it, re-log the model from its source (or check it with `jaxexp check`)."
    )


def probe_file(path: Any, *, node_types: list[str] | None = None) -> None:
    """:func:`probe` on a blob file (read as a bounded regular file)."""
    from jaxexp_mlflow.codec import files

    data = files.read_file(path, what="serialized function", max_bytes=files.MAX_BLOB_BYTES)
    probe(data, source=os.path.basename(path), node_types=node_types)
