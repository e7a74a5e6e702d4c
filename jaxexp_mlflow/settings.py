"""Every ``JAXEXP_*`` environment variable the product reads, in one registry.

Each variable is one module-level :class:`EnvVar` constant holding its name, type, default and a
one-line description; the code reads it through ``.get()`` (``settings.JAXEXP_MAX_SHAPES.get()``),
never through ``os.environ`` itself. ``.get()`` reads the environment when called, so a
variable read per call stays per call and one read at import stays at import.

Types:

* ``int`` / ``float``: parsed as Python does (``int("64")``); unset or empty gives the default.
  A value that does not parse raises :class:`BadEnvVarError` (in the product the
  ``jaxexp_mlflow.errors.EnvVarError`` subclass, a ``JaxExpError``) naming the variable, the
  value found and what is expected.
* ``bool``: on unless the value (case and surrounding blanks ignored) is one of the variable's
  ``off`` words; unset gives the default.
* ``str``: the text as set; the reading module parses it further where it has a syntax of its
  own (lists, ``off``, directories) and checks it there.
* ``Path``: ``~`` expanded; unset or empty gives the default.

This module imports only the standard library: every module may import it, and the docs build
reads it without JAX or MLflow (``docs/hooks/env_reference.py``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

#: The ``bool`` values that turn a variable off unless it names its own.
OFF_WORDS = ("0", "off", "false", "no")

#: Groups in the order the reference page lists them; ``development`` is read by the tests,
#: benchmarks and scripts only, never by the package.
GROUPS = {
    "limits": "Limits on what a model directory or a download may hold",
    "store": "Saving, uploading and downloading models",
    "runtime": "Loading and running models (JAX backend)",
    "cache": "Compilation caches",
    "serving": "pyfunc and the scoring server",
    "iree": "IREE backend",
    "development": "Development: tests, benchmarks and scripts only",
}

_TYPES = (int, float, bool, str, Path)
_EXPECTED = {int: "an integer", float: "a number", Path: "a path"}
_UNSET: Any = object()


class BadEnvVarError(ValueError):
    """A ``JAXEXP_*`` variable holds a value its type cannot take.

    Args:
        message: what was expected, what was found and what to do.
        name: the variable's name.
        value: the text found in the environment.
        expected: what the variable takes (``"an integer"``).
    """

    def __init__(
        self, message: str, *, name: str = "", value: str = "", expected: str = ""
    ) -> None:
        super().__init__(message)
        self.name = name
        self.value = value
        self.expected = expected


def _error_type() -> type[BadEnvVarError]:
    """``jaxexp_mlflow.errors.EnvVarError`` where MLflow is installed, else the plain base
    (the docs build imports this module without MLflow)."""
    try:
        from jaxexp_mlflow.errors import EnvVarError
    except ImportError:
        return BadEnvVarError
    return EnvVarError


class EnvVar:
    """One environment variable: its name, type, default and what it does.

    Args:
        name: the variable's name (``JAXEXP_...``).
        type_: ``int``, ``float``, ``bool``, ``str`` or ``Path``.
        default: what ``get`` returns when the variable is unset (``None``: the reading code
            computes its own, which ``description`` states).
        description: one line for the reference page.
        group: one of :data:`GROUPS`.
        off: for ``bool``: the words that turn it off (default :data:`OFF_WORDS`).
        import_time: read once, when its module is imported (a change later is not seen).
    """

    def __init__(
        self,
        name: str,
        type_: type,
        default: Any,
        description: str,
        *,
        group: str,
        off: tuple[str, ...] = OFF_WORDS,
        import_time: bool = False,
    ) -> None:
        if type_ not in _TYPES:
            raise TypeError(f"{name}: type {type_!r} is not one of {_TYPES}")
        if group not in GROUPS:
            raise ValueError(f"{name}: group {group!r} is not one of {list(GROUPS)}")
        self.name = name
        self.type = type_
        self.default = default
        self.description = description
        self.group = group
        self.off = off
        self.import_time = import_time

    def __repr__(self) -> str:
        return f"EnvVar({self.name!r}, {self.type.__name__}, {self.default!r})"

    def is_set(self) -> bool:
        """Whether the variable is in the environment (empty counts as set)."""
        return self.name in os.environ

    def raw(self) -> str | None:
        """The text in the environment, or None when unset."""
        return os.environ.get(self.name)

    def get(self, default: Any = _UNSET) -> Any:
        """The variable's value, parsed for its type.

        Args:
            default: returned instead of the registered default when the variable is unset
                (or, for numbers and paths, empty): a default the caller computes.

        Returns:
            The parsed value, else the default.

        Raises:
            BadEnvVarError: an ``int``/``float`` value that does not parse (in the product
                ``jaxexp_mlflow.errors.EnvVarError``, which derives from it).
        """
        fallback = self.default if default is _UNSET else default
        text = os.environ.get(self.name)
        if text is None:
            return fallback
        if self.type is str:
            return text
        if self.type is bool:
            return text.strip().lower() not in self.off
        if not text.strip():
            return fallback
        if self.type is Path:
            return Path(text).expanduser()
        try:
            return self.type(text)
        except ValueError:
            expected = _EXPECTED[self.type]
            shown = f" ({self.default!r})" if self.default is not None else ""
            raise _error_type()(
                f"{self.name}={text!r:.80}: expected {expected}, found text that is not one "
                f"({self.name}: {self.description.rstrip('.')}). Set it to {expected}, or "
                f"unset it for the default{shown}.",
                name=self.name,
                value=text,
                expected=expected,
            ) from None


REGISTRY: dict[str, EnvVar] = {}


def _var(*args: Any, **kwargs: Any) -> EnvVar:
    var = EnvVar(*args, **kwargs)
    if var.name in REGISTRY:
        raise ValueError(f"{var.name} is registered twice")
    REGISTRY[var.name] = var
    return var


def lookup(name: str) -> EnvVar:
    """The registered variable called ``name``.

    Raises:
        KeyError: no variable of that name is registered.
    """
    return REGISTRY[name]


# -- limits ----------------------------------------------------------------------------------
JAXEXP_MAX_MLMODEL_BYTES = _var(
    "JAXEXP_MAX_MLMODEL_BYTES", int, 1 << 20,
    "Largest MLmodel file read (bytes).", group="limits", import_time=True,
)  # fmt: skip
JAXEXP_MAX_BLOB_BYTES = _var(
    "JAXEXP_MAX_BLOB_BYTES", int, 2 << 30,
    "Largest serialized export (blob) read (bytes).", group="limits", import_time=True,
)  # fmt: skip
JAXEXP_MAX_REFERENCE_BYTES = _var(
    "JAXEXP_MAX_REFERENCE_BYTES", int, 1 << 30,
    "Largest stored reference input/output archive read (bytes).",
    group="limits", import_time=True,
)  # fmt: skip
JAXEXP_MAX_LIST_DEPTH = _var(
    "JAXEXP_MAX_LIST_DEPTH", int, 32,
    "Deepest directory a model download follows (at least 1; a bad value keeps the default).",
    group="limits",
)  # fmt: skip
JAXEXP_MAX_LIST_ENTRIES = _var(
    "JAXEXP_MAX_LIST_ENTRIES", int, 100_000,
    "Most files and directories a model download accepts from listings and the params manifest "
    "(at least 1; a bad value keeps the default).",
    group="limits",
)  # fmt: skip
JAXEXP_READBACK_RESTORE_MAX_BYTES = _var(
    "JAXEXP_READBACK_RESTORE_MAX_BYTES", int, 256 * 1024**2,
    "Params bigger than this (bytes) are not restored a second time by the save-time read-back.",
    group="limits",
)  # fmt: skip

# -- store -----------------------------------------------------------------------------------
JAXEXP_READ_THREADS = _var(
    "JAXEXP_READ_THREADS", int, None,
    "Threads one file is read on (default: the usable cores, at most 4).", group="store",
)  # fmt: skip
JAXEXP_CRC32C_NATIVE = _var(
    "JAXEXP_CRC32C_NATIVE", bool, True,
    "Use the native CRC-32C (0: the pure-Python fallback).", group="store", off=("0",),
)  # fmt: skip
JAXEXP_FSYNC_THREADS = _var(
    "JAXEXP_FSYNC_THREADS", int, 8, "Threads that fsync a saved tree's files at once.",
    group="store",
)  # fmt: skip
JAXEXP_RESTORE_FLUSH_BYTES = _var(
    "JAXEXP_RESTORE_FLUSH_BYTES", int, 512 * 1024**2,
    "Host bytes a params restore reads ahead before one batched transfer to an accelerator.",
    group="store",
)  # fmt: skip
JAXEXP_TRANSFER_WORKERS = _var(
    "JAXEXP_TRANSFER_WORKERS", int, 8,
    "Files uploaded or downloaded at once per model (a bad value keeps the default).",
    group="store",
)  # fmt: skip
JAXEXP_EARLY_UPLOAD = _var(
    "JAXEXP_EARLY_UPLOAD", bool, True,
    "Upload a logged model's files while its read-back runs (0: after it).",
    group="store", off=("0",),
)  # fmt: skip
JAXEXP_PROGRESS = _var(
    "JAXEXP_PROGRESS", str, None,
    "1 or 0 forces transfer progress on stderr on or off (unset: on a terminal when MLflow's "
    "artifact progress bars are on).",
    group="store",
)  # fmt: skip
JAXEXP_ENVS_DIR = _var(
    "JAXEXP_ENVS_DIR", Path, None,
    "Where the virtual environments of other jax versions are cached (default: "
    "$XDG_CACHE_HOME/jaxexp/envs, else ~/.cache/jaxexp/envs).",
    group="store",
)  # fmt: skip
JAXEXP_DEBUG = _var(
    "JAXEXP_DEBUG", str, None,
    "Any non-empty value: errors from another environment's runner include its traceback.",
    group="store",
)  # fmt: skip

# -- runtime ---------------------------------------------------------------------------------
JAXEXP_BACKEND = _var(
    "JAXEXP_BACKEND", str, None,
    "Backend of a pyfunc load when model_config names none: jax or iree (unset: the saved "
    "serving config's, else jax).",
    group="runtime",
)  # fmt: skip
JAXEXP_MAX_SHAPES = _var(
    "JAXEXP_MAX_SHAPES", int, 64,
    "Compiled input shapes a model keeps in memory (never fewer than its buckets).",
    group="runtime",
)  # fmt: skip
JAXEXP_CPU_INLINE = _var(
    "JAXEXP_CPU_INLINE", str, "",
    "1: run CPU computations on the calling thread in any process whose load imports jax "
    "first; 0: never; unset: in scoring servers only.",
    group="runtime",
)  # fmt: skip
JAXEXP_CPU_YNN_CHOICE = _var(
    "JAXEXP_CPU_YNN_CHOICE", bool, True,
    "Choose per CPU executable the XLA options that cost less memory (0/off/no: XLA's "
    "defaults always).",
    group="runtime", off=("0", "off", "no"),
)  # fmt: skip
JAXEXP_BUCKETS = _var(
    "JAXEXP_BUCKETS", str, None,
    "Batch buckets when model_config sets none: pow2 (default), off, or comma-separated sizes.",
    group="runtime",
)  # fmt: skip
JAXEXP_MAX_BATCH = _var(
    "JAXEXP_MAX_BATCH", str, None,
    "Largest power-of-two bucket when model_config sets none (default 1024).", group="runtime",
)  # fmt: skip
JAXEXP_PRECOMPILE = _var(
    "JAXEXP_PRECOMPILE", str, None,
    "Buckets compiled at load when model_config sets none: true, false, or comma-separated "
    "sizes (unset: every bucket in a scoring server, in the background; else none).",
    group="runtime",
)  # fmt: skip
JAXEXP_CHUNK_TEMP_BYTES = _var(
    "JAXEXP_CHUNK_TEMP_BYTES", str, "",
    "Largest temporaries (bytes) a call may allocate before its batch is cut into chunks "
    "(0: off; unset: 32 MiB).",
    group="runtime",
)  # fmt: skip
JAXEXP_ISOLATE_MEMORY_BYTES = _var(
    "JAXEXP_ISOLATE_MEMORY_BYTES", int, 4 << 30,
    "Address-space cap (bytes) of the child process that deserializes an untrusted blob first.",
    group="runtime", import_time=True,
)  # fmt: skip
JAXEXP_ISOLATE_TIMEOUT_S = _var(
    "JAXEXP_ISOLATE_TIMEOUT_S", float, 120.0,
    "Seconds the child process that deserializes an untrusted blob first may run.",
    group="runtime", import_time=True,
)  # fmt: skip
JAXEXP_LITE = _var(
    "JAXEXP_LITE", bool, True,
    "Use the lite store: XLA:CPU executables of pyfunc buckets that run without importing jax "
    "(0/off/false/no: never).",
    group="runtime",
)  # fmt: skip
JAXEXP_LITE_MAX_PARAM_BYTES = _var(
    "JAXEXP_LITE_MAX_PARAM_BYTES", int, 64 << 20,
    "Largest params (bytes) folded into a lite executable.", group="runtime",
)  # fmt: skip

# -- cache -----------------------------------------------------------------------------------
JAXEXP_COMPILATION_CACHE = _var(
    "JAXEXP_COMPILATION_CACHE", str, None,
    "JAX compilation cache when model_config sets none: 0/off/false turns it off, 1/on the "
    "default (~/.cache/jaxexp-mlflow/xla), else an absolute directory.",
    group="cache",
)  # fmt: skip
JAXEXP_COMPILATION_CACHE_MAX_BYTES = _var(
    "JAXEXP_COMPILATION_CACHE_MAX_BYTES", int, 2 << 30,
    "Size past which JAX evicts entries of the compilation cache the product set up.",
    group="cache",
)  # fmt: skip
JAXEXP_PYFUNC_CACHE = _var(
    "JAXEXP_PYFUNC_CACHE", bool, True,
    "Reuse a model a process already loaded, with its compiled buckets (0/off/false/no: load "
    "every time).",
    group="cache",
)  # fmt: skip

# -- serving ---------------------------------------------------------------------------------
JAXEXP_ALLOW_NAN = _var(
    "JAXEXP_ALLOW_NAN", str, None,
    "Accept NaN and infinities in requests when model_config does not say (1/true/on/yes; "
    "unset: the saved serving config's, else no).",
    group="serving",
)  # fmt: skip
JAXEXP_MAX_REQUEST_BYTES = _var(
    "JAXEXP_MAX_REQUEST_BYTES", int, None,
    "Largest request body (bytes) when model_config sets none (unset: the saved serving "
    "config's, else 64 MiB).",
    group="serving",
)  # fmt: skip
JAXEXP_MAX_DECODED_BYTES = _var(
    "JAXEXP_MAX_DECODED_BYTES", int, None,
    "Most bytes of decoded input one request may hold (unset: 4 x the body limit).",
    group="serving",
)  # fmt: skip
JAXEXP_MAX_INFLIGHT_BYTES = _var(
    "JAXEXP_MAX_INFLIGHT_BYTES", int, None,
    "Request bodies in flight (bytes) past which a server answers 503 (unset: 4 x the body "
    "limit).",
    group="serving",
)  # fmt: skip
JAXEXP_BODY_TIMEOUT_S = _var(
    "JAXEXP_BODY_TIMEOUT_S", float, 60.0,
    "Seconds a request body may take to arrive whole (else 408).", group="serving",
)  # fmt: skip
JAXEXP_HEADER_TIMEOUT_S = _var(
    "JAXEXP_HEADER_TIMEOUT_S", float, 10.0,
    "Seconds a connection may take to send whole request headers (set by jaxexp serve "
    "--header-timeout).",
    group="serving",
)  # fmt: skip
JAXEXP_MAX_CONNECTIONS = _var(
    "JAXEXP_MAX_CONNECTIONS", int, 256,
    "Sockets one server process holds at once, at least 2 (set by jaxexp serve "
    "--max-connections).",
    group="serving",
)  # fmt: skip
JAXEXP_LITE_SERVER_UPGRADE = _var(
    "JAXEXP_LITE_SERVER_UPGRADE", bool, True,
    "A server loaded lite starts loading through jax on its first request (0: only when a "
    "request needs jax).",
    group="serving", off=("0",),
)  # fmt: skip
JAXEXP_SERVE_MODEL_URI = _var(
    "JAXEXP_SERVE_MODEL_URI", str, None,
    "The model a jaxexp serve worker loads (set by jaxexp serve for its workers).",
    group="serving",
)  # fmt: skip
JAXEXP_SERVE_MODEL_CONFIG = _var(
    "JAXEXP_SERVE_MODEL_CONFIG", str, None,
    "The model_config (JSON) of a jaxexp serve worker (set by jaxexp serve for its workers).",
    group="serving",
)  # fmt: skip

# -- iree ------------------------------------------------------------------------------------
JAXEXP_IREE_CACHE = _var(
    "JAXEXP_IREE_CACHE", str, None,
    "IREE compilation cache when model_config sets none: 0/off turns it off, 1/on the default "
    "(~/.cache/jaxexp-mlflow/iree), else an absolute directory.",
    group="iree",
)  # fmt: skip
JAXEXP_IREE_FLAGS = _var(
    "JAXEXP_IREE_FLAGS", str, "",
    "Extra iree-compile flags, separated by blanks.", group="iree",
)  # fmt: skip
JAXEXP_IREE_SPEED = _var(
    "JAXEXP_IREE_SPEED", bool, True,
    "Try the speed flags and the batch-1 entry (0/off/false/no: the base flags only).",
    group="iree",
)  # fmt: skip
JAXEXP_IREE_STATIC = _var(
    "JAXEXP_IREE_STATIC", bool, True,
    "Compile a model with rows proven independent per batch size as well "
    "(0/off/false/no: never).",
    group="iree",
)  # fmt: skip
JAXEXP_IREE_TRIAL_MS = _var(
    "JAXEXP_IREE_TRIAL_MS", str, "",
    "Call time (ms) on local-sync from which a small size is timed on both drivers (off: "
    "never; unset: 1).",
    group="iree",
)  # fmt: skip
JAXEXP_IREE_CHUNK_ROWS = _var(
    "JAXEXP_IREE_CHUNK_ROWS", str, "",
    "Rows per chunk of a big batch (0: every batch whole; unset: 256).", group="iree",
)  # fmt: skip
JAXEXP_IREE_DRIVER = _var(
    "JAXEXP_IREE_DRIVER", str, None,
    "IREE driver when none is asked for: local-sync or local-task (unset: chosen per model).",
    group="iree",
)  # fmt: skip

# -- development (tests, benchmarks and scripts; never read by the package) -----------------
JAXEXP_GPU_TESTS_ON_CPU = _var(
    "JAXEXP_GPU_TESTS_ON_CPU", bool, False,
    "1: run the accelerator test suite on a CPU host too.", group="development",
    off=("", "0"),
)  # fmt: skip
JAXEXP_STRICT_PRIVATE = _var(
    "JAXEXP_STRICT_PRIVATE", bool, False,
    "1: a private jax/MLflow name that is missing fails its test instead of being reported.",
    group="development", off=("", "0"),
)  # fmt: skip
JAXEXP_CORPUS = _var(
    "JAXEXP_CORPUS", Path, None,
    "Directory of hostile codec inputs the fuzz tests and benchmarks read (default: "
    "../shared/corpus).",
    group="development",
)  # fmt: skip
JAXEXP_FUZZ_EXAMPLES = _var(
    "JAXEXP_FUZZ_EXAMPLES", int, None,
    "Examples per codec fuzz test (default 300, 20 000 in long runs).", group="development",
)  # fmt: skip
JAXEXP_WHEEL_CACHE = _var(
    "JAXEXP_WHEEL_CACHE", Path, None,
    "Where old jax wheels are downloaded for the backward-compatibility tests (default: "
    "~/.cache/jaxexp-mlflow/jax-wheels).",
    group="development",
)  # fmt: skip
JAXEXP_STAGES = _var(
    "JAXEXP_STAGES", str, "main newest oldest",
    "scripts/test.sh: the stages to run, separated by blanks.", group="development",
)  # fmt: skip
JAXEXP_SKIP_OLDEST = _var(
    "JAXEXP_SKIP_OLDEST", bool, False,
    "scripts/test.sh: 1 drops the oldest-stack stage.", group="development", off=("", "0"),
)  # fmt: skip
JAXEXP_PARALLEL = _var(
    "JAXEXP_PARALLEL", bool, True,
    "scripts/test.sh: 0 runs the stages one after the other.", group="development", off=("0",),
)  # fmt: skip
JAXEXP_CI_LOGS = _var(
    "JAXEXP_CI_LOGS", str, ".ci-logs",
    "scripts/test.sh: where each stage's log is written.", group="development",
)  # fmt: skip
JAXEXP_NEWEST_VENV = _var(
    "JAXEXP_NEWEST_VENV", str, ".venv-newest",
    "scripts/test.sh: the newest stack's virtualenv.", group="development",
)  # fmt: skip
JAXEXP_PYTHON313 = _var(
    "JAXEXP_PYTHON313", str, None,
    "scripts/python313.sh: the Python 3.13 interpreter to use first.", group="development",
)  # fmt: skip
JAXEXP_FORCE_TRIXIE = _var(
    "JAXEXP_FORCE_TRIXIE", bool, False,
    "scripts/python313.sh: 1 skips the local interpreters (tests the container fallback).",
    group="development", off=("", "0"),
)  # fmt: skip
JAXEXP_GPU_SITE = _var(
    "JAXEXP_GPU_SITE", str, "/tmp/jaxexp-site",
    "scripts/gpu_suite.sh: where the accelerator wheels are installed.", group="development",
)  # fmt: skip
JAXEXP_GPU_WHEELS = _var(
    "JAXEXP_GPU_WHEELS", str, ".whl",
    "scripts/gpu_suite.sh: directory of the wheels to install.", group="development",
)  # fmt: skip
JAXEXP_BENCH_VENV = _var(
    "JAXEXP_BENCH_VENV", str, None,
    "benchmarks/cold_start_installed.sh: the virtualenv it installs into (default "
    "benchmarks/.venv-bench).",
    group="development",
)  # fmt: skip
