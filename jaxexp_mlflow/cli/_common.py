"""What every ``jaxexp`` command shares: options, error handling, progress, output helpers.

Nothing heavy is imported here (no jax, no mlflow, no numpy): ``jaxexp inspect`` must stay cheap
and must never load jax. Exit codes: 0 success, 1 when the answer is "no" (incompatible,
mismatch), 2 for usage or input errors (click's own usage errors also exit 2).

Strings from a model (MLmodel fields, registered names, blob metadata) are untrusted: every line
a command prints goes through :func:`safe_text` (tables, errors, and the command's stdout
itself while it runs), so control characters reach the terminal as visible escapes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import click

EXIT_NO = 1
EXIT_INPUT = 2


class Failure(Exception):
    """A command's answer is "no" (mismatch, incompatible): exit 1 with this one-line message."""

    exit_code = EXIT_NO


class InputProblem(Exception):
    """The user's input cannot be used (bad file, unknown URI): exit 2 with this message."""

    exit_code = EXIT_INPUT


#: Errors raised on purpose, with messages written for the user: no type name, no hint.
_EXPECTED = {"JaxExpError", "Failure", "InputProblem", "MlflowException"}


def _class_names(err: BaseException) -> set[str]:
    return {c.__name__ for c in type(err).__mro__}


def exit_code_for(err: BaseException) -> int:
    """1 for "no" answers (incompatible, mismatch), 2 for everything else that went wrong.

    Classes are matched by name so that this module does not import ``jaxexp_mlflow.errors``
    (which imports mlflow).
    """
    if isinstance(err, Failure | InputProblem):
        return err.exit_code
    if "IncompatibleError" in _class_names(err):
        return EXIT_NO
    return EXIT_INPUT


def one_line(err: BaseException) -> str:
    """The error's message on one line (MLflow errors carry ``.message``)."""
    message = getattr(err, "message", None) or str(err) or type(err).__name__
    text = " ".join(str(message).split())
    if not (_EXPECTED & _class_names(err)):
        text = f"{type(err).__name__}: {text}"
    return text


# -- terminal safety ---------------------------------------------------------------------------

#: Bidirectional-text controls (marks, embeddings, overrides, isolates): they reorder what a
#: terminal shows. U+2028/U+2029 (line and paragraph separators) break lines.
_BIDI = (0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A))
_UNSAFE = (*range(0x20), 0x7F, *range(0x80, 0xA0), *_BIDI, 0x2028, 0x2029)


def _escape(cp: int) -> str:
    named = {0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"}
    return named.get(cp) or (f"\\x{cp:02x}" if cp < 0x100 else f"\\u{cp:04x}")


_SINGLE_LINE = {cp: _escape(cp) for cp in _UNSAFE}
_MULTI_LINE = {cp: v for cp, v in _SINGLE_LINE.items() if cp not in (0x09, 0x0A)}


def safe_text(value: Any, *, multiline: bool = False) -> str:
    """``value`` as text a terminal shows as it is: control characters (C0, DEL, C1, hence
    every ESC sequence and carriage return), bidi overrides and Unicode line separators become
    visible escapes (``\\x1b``, ``\\u202e``). ``multiline`` keeps newlines and tabs (a
    block the command laid out itself); a cell or a value keeps none."""
    return str(value).translate(_MULTI_LINE if multiline else _SINGLE_LINE)


class _SafeStdout:
    """``sys.stdout`` while a command runs: every write goes through :func:`safe_text`
    (multi-line). JSON is unchanged by it (``json.dumps`` escapes control characters)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.encoding = getattr(stream, "encoding", None) or "utf-8"
        self.errors = getattr(stream, "errors", None) or "strict"

    def write(self, text: Any) -> int:
        if isinstance(text, bytes | bytearray | memoryview):
            # a tool's raw output (iree-compile's stderr, written as bytes where a stream
            # has no `buffer`): decoded, then escaped like any text
            self._stream.write(safe_text(bytes(text).decode("utf-8", "replace"), multiline=True))
            return len(text)
        if isinstance(text, str):
            text = safe_text(text, multiline=True)
        return self._stream.write(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return bool(getattr(self._stream, "isatty", lambda: False)())

    def fileno(self) -> int:
        return self._stream.fileno()

    def writable(self) -> bool:
        return True

    @property
    def unescaped(self) -> Any:
        """The stream itself, for a progress bar's own carriage returns (nothing a model or a
        store wrote may go there)."""
        return self._stream

    def __getattr__(self, name: str) -> Any:
        if name == "buffer":  # no way around the sanitizer (click writes text through it)
            raise AttributeError(name)
        return getattr(self._stream, name)


@contextlib.contextmanager
def safe_stdout() -> Iterator[None]:
    """Route ``sys.stdout`` and ``sys.stderr`` through :func:`safe_text` for the block
    (``click.echo``, warnings, and every logging handler that was writing to either, such as
    the one printing a verdict's reasons). A terminal progress bar writes to the stream's
    ``unescaped`` attribute (its carriage returns are its own)."""
    before_out, before_err = sys.stdout, sys.stderr
    if before_out is None or isinstance(before_out, _SafeStdout):
        yield
        return
    streams = {id(before_out): _SafeStdout(before_out)}
    if before_err is not None and not isinstance(before_err, _SafeStdout):
        streams[id(before_err)] = _SafeStdout(before_err)
    for raw in (sys.__stdout__, sys.__stderr__):  # handlers made before the runner swapped them
        if raw is not None and id(raw) not in streams:
            streams[id(raw)] = _SafeStdout(raw)
    handlers = []
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", ()):
            wrapped = streams.get(id(getattr(handler, "stream", None)))
            if isinstance(handler, logging.StreamHandler) and wrapped is not None:
                handlers.append((handler, handler.stream))
                handler.stream = wrapped
    sys.stdout = streams[id(before_out)]  # type: ignore[assignment]
    sys.stderr = streams.get(id(before_err), before_err)  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout, sys.stderr = before_out, before_err
        for handler, stream in handlers:
            handler.stream = stream


#: ``ctx.meta`` key of ``--trust-requirements`` (read by ``cli/verify_env.py``).
TRUST_REQUIREMENTS = "jaxexp.trust_requirements"


def _remember_trust(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    ctx.meta[TRUST_REQUIREMENTS] = bool(value)
    return value


def trust_requirements_option() -> click.Option:
    """``--trust-requirements``: what a command that restores a model's recorded environment
    (it has ``--env-manager``) may install."""
    return click.Option(
        ["--trust-requirements"],
        is_flag=True,
        expose_value=False,
        callback=_remember_trust,
        help="--env-manager installs what MLmodel records (Python, jax, jaxlib, numpy, "
        "flatbuffers, orbax-checkpoint, mlflow, jaxexp-mlflow) from your package index, printed "
        "before anything is installed. What the model's requirements add (python_env.yaml, "
        "requirements.txt, conda.yaml) is shown and installed only with this flag, as written, "
        "running any build backend the model ships; without it, lines beyond plain "
        "`name[extras] (op version)` (local paths, URLs, VCS, -e, --index-url and other "
        "options) are refused with exit 2. Only for models you trust to run code here.",
    )


class Command(click.Command):
    """A click command that turns exceptions into a one-line error and the right exit code.

    Its stdout goes through :func:`safe_text` while it runs. A command with ``--env-manager``
    also gets ``--trust-requirements`` (:func:`trust_requirements_option`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        names = {p.name for p in self.params}
        if "env_manager" in names and "trust_requirements" not in names:
            self.params.append(trust_requirements_option())

    def invoke(self, ctx: click.Context) -> Any:
        with safe_stdout():
            return self._invoke(ctx)

    def _invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.Abort, click.ClickException):
            raise
        except KeyboardInterrupt:
            click.echo("jaxexp: interrupted", err=True)
            ctx.exit(130)
        except Exception as err:  # noqa: BLE001 - the CLI's job is to report it
            code = exit_code_for(err)
            if ctx.params.get("debug"):
                traceback.print_exc()
            message = safe_text(
                one_line(err).replace("allow_incompatible=True", "--allow-incompatible")
            )
            if ctx.params.get("as_json"):
                emit_json(
                    {
                        "ok": False,
                        "error": {"type": type(err).__name__, "message": message},
                        "exit_code": code,
                    }
                )
            expected = _EXPECTED & _class_names(err)
            hint = (
                ""
                if expected or ctx.params.get("debug") or "debug" not in ctx.params
                else " (--debug shows the traceback)"
            )
            click.echo(f"jaxexp {ctx.info_name}: error: {message}{hint}", err=True)
            ctx.exit(code)


def common_options(fn: Callable) -> Callable:
    """``--json`` and ``--debug``, on every command."""
    fn = click.option("--debug", is_flag=True, help="Show tracebacks and library log messages.")(fn)
    fn = click.option(
        "--json", "as_json", is_flag=True, help="Print machine-readable JSON on stdout."
    )(fn)
    return fn


def tolerance_options(what: str) -> Callable[[Callable], Callable]:
    """``--rtol`` and ``--atol`` (non-negative; unset: the per-dtype defaults), for ``what``."""

    def add(fn: Callable) -> Callable:
        for name, kind in (("--atol", "Absolute"), ("--rtol", "Relative")):
            fn = click.option(
                name,
                type=click.FloatRange(min=0),
                default=None,
                help=f"{kind} tolerance of {what} (default per dtype).",
            )(fn)
        return fn

    return add


def run_options(fn: Callable) -> Callable:
    """``--allow-incompatible``, ``--allow-other-platform`` and ``--backend``, on the commands
    that run a model."""
    fn = click.option(
        "--backend",
        type=click.Choice(["jax", "iree"]),
        default="jax",
        show_default=True,
        help="Run with JAX, or compile with IREE and run without importing JAX "
        "(pip install 'jaxexp-mlflow[iree]').",
    )(fn)
    fn = click.option(
        "--allow-other-platform",
        is_flag=True,
        help="Run on this backend even if the model was not exported for it.",
    )(fn)
    fn = click.option(
        "--allow-incompatible", is_flag=True, help="Try even when the verdict is incompatible."
    )(fn)
    return fn


def setup_logging(debug: bool) -> None:
    """Quiet library chatter (absl/Orbax INFO and WARNING lines) unless ``--debug``."""
    if debug:
        logging.basicConfig(level=logging.INFO)
        return
    for name in ("absl", "orbax", "jax._src.xla_bridge"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # MLflow's INFO lines ("Experiment ... does not exist. Creating a new experiment"): the
    # command prints what it did itself; warnings still show. MLflow sets its level from
    # MLFLOW_LOGGING_LEVEL when it is imported (often later than this), else here.
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    if "mlflow" in sys.modules:
        logging.getLogger("mlflow").setLevel(logging.WARNING)
    if not sys.stderr.isatty():  # MLflow's tqdm download bars only on a terminal
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


# -- progress ---------------------------------------------------------------------------------


def progress_enabled() -> bool:
    """Progress lines go to stderr, and only when stderr is a terminal (see ``transfer``)."""
    from jaxexp_mlflow.store.transfer import progress_enabled as enabled

    return enabled()


@contextlib.contextmanager
def step(label: str) -> Iterator[None]:
    """Show ``label ... done (1.2 s)`` on a terminal around a long step; silent otherwise."""
    if not progress_enabled():
        yield
        return
    click.echo(f"{label} ...", err=True, nl=False)
    start = time.perf_counter()
    try:
        yield
    except BaseException:
        click.echo(" failed", err=True)
        raise
    click.echo(f" done ({time.perf_counter() - start:.1f} s)", err=True)


# -- output -----------------------------------------------------------------------------------


def emit_json(payload: Any) -> None:
    """Print ``payload`` as indented JSON on stdout."""
    click.echo(json.dumps(payload, indent=2, default=str))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], indent: int = 2) -> str:
    """A plain-text table with aligned columns (no box drawing: greppable, diffable). Cells go
    through :func:`safe_text` (one line each)."""
    cells = [[safe_text(h) for h in headers]]
    cells += [["" if c is None else safe_text(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    pad = " " * indent
    lines = [pad + "  ".join(c.ljust(w) for c, w in zip(cells[0], widths, strict=True)).rstrip()]
    lines.append(pad + "  ".join("-" * w for w in widths))
    for r in cells[1:]:
        lines.append(pad + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return "\n".join(lines)


def human_bytes(n: int | None) -> str:
    """``1.2 MB`` style sizes (decimal units, as ``ls -h --si``)."""
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"  # pragma: no cover


def fmt_err(x: float) -> str:
    """Error magnitudes in a compact, comparable form."""
    return "0" if x == 0 else f"{x:.2e}"
