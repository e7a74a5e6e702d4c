"""Threads that compile or load a model in the background, wound down before the interpreter.

A server compiles its batch buckets, and a lite load loads through jax, on a daemon thread
after it answers (``serving/pyfunc.py``, ``serving/lite_pyfunc.py``). A process that exits
meanwhile (a server stopped within its first minute, a script that loaded a model and ended)
used to abort: the interpreter ends daemon threads by unwinding them where they stand, and one
standing inside XLA's compiler ended the process with "terminate called ... FATAL: exception
not rethrown" (SIGABRT, exit status 134). So at exit these threads are told to stop after the
step they are on (:func:`stopping`), and the exit waits for that step.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable
from typing import Any

_logger = logging.getLogger(__name__)
_STOP = threading.Event()
_THREADS: list[threading.Thread] = []
_LOCK = threading.Lock()
_registered = [False]


def stopping() -> bool:
    """Whether the process is exiting: background work stops at its next step."""
    return _STOP.is_set()


def start(target: Callable[..., Any], *args: Any, name: str) -> threading.Thread:
    """Run ``target(*args)`` on a daemon thread that the process's exit waits for."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    with _LOCK:
        if not _registered[0]:
            atexit.register(_wind_down)
            _registered[0] = True
        _THREADS[:] = [t for t in _THREADS if t.is_alive()]
        _THREADS.append(thread)
    thread.start()
    return thread


def _wind_down() -> None:
    _STOP.set()
    with _LOCK:
        alive = [t for t in _THREADS if t.is_alive()]
    if alive:
        _logger.info("jaxexp: exiting after the background step in progress (%d)", len(alive))
    for thread in alive:
        thread.join()
