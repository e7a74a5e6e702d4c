"""The private names of jaxlib that run a stored XLA:CPU executable without importing jax.

``import jax`` costs ~0.35 s of a fresh process (its Python modules; ``jaxlib._jax`` itself and a
CPU client cost ~30 ms), more than the whole load of an ``mlflow.onnx`` model. A pyfunc model
whose executable for a batch bucket is already stored (``serving/lite_pyfunc.py``) is run here
on a CPU client of jaxlib's own: the serialized executable deserialized, the input put on the
device, the output read back through DLPack. Each step uses a jaxlib name that jax itself
wraps; ``PRIVATE_NAMES`` lists them (``tests/serving/test_lite_pyfunc.py`` checks each against the
installed jaxlib). The public fallback is the ordinary path through jax: :func:`available`
is False when a name is gone, and a step that fails raises :class:`LiteUnavailable`, on which
the caller loads the model through jax as always (a new jaxlib costs start-up time, never a
wrong answer).

Nothing here imports jax; :func:`serialize` takes a ``jax.stages.Compiled`` made by the caller.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

#: name -> (what we use it for, what happens without it)
PRIVATE_NAMES: dict[str, tuple[str, str]] = {
    "xla_client.make_cpu_client": (
        "a CPU client of jaxlib's own, running on the calling thread (jax makes its backend "
        "with the same call)",
        "the lite path is off: models load through jax",
    ),
    "Client.deserialize_executable": (
        "load a stored executable (what jax.experimental.serialize_executable calls)",
        "the lite path is off",
    ),
    "_jax.batched_device_put": ("put a numpy input on the CPU device", "the lite path is off"),
    "_jax.SingleDeviceSharding": (
        "the input's sharding: the one CPU device",
        "the lite path is off",
    ),
    "_jax.array_result_handler": (
        "wrap the output buffer without jax's array class: (aval, sharding, committed, "
        "_skip_checks=True) in jaxlib 0.10, whose checks would import jax; (aval, sharding, "
        "committed) in jaxlib 0.12, which checks nothing through jax",
        "the lite path is off (another signature): models load through jax",
    ),
    "_jax.buffer_to_dlpack_managed_tensor": (
        "read the output into numpy without a copy (DLPack)",
        "the lite path is off",
    ),
}


class LiteUnavailable(RuntimeError):
    """This jaxlib cannot run a stored executable without jax: load through jax instead."""


_LOCK = threading.Lock()
_STATE: dict[str, Any] = {}


def _modules() -> tuple[Any, Any]:
    # what `import jax` does before it loads jaxlib (jax/__init__.py): XLA's INFO lines (a
    # client's device count, ...) off unless the process asked for them
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    from jaxlib import _jax, xla_client

    return _jax, xla_client


def available() -> bool:
    """Whether every name of ``PRIVATE_NAMES`` is present in the installed jaxlib."""
    try:
        _jax, xc = _modules()
    except ImportError:
        return False
    return (
        all(
            hasattr(obj, attr)
            for obj, attr in (
                (xc, "make_cpu_client"),
                (_jax, "Client"),
                (_jax, "batched_device_put"),
                (_jax, "SingleDeviceSharding"),
                (_jax, "array_result_handler"),
                (_jax, "buffer_to_dlpack_managed_tensor"),
                (_jax, "HostBufferSemantics"),
            )
        )
        and hasattr(_jax.Client, "deserialize_executable")
        and _handler_tail(_jax) is not None
    )


def _handler_tail(_jax: Any) -> tuple | None:
    """The arguments after ``committed`` that make ``array_result_handler`` wrap an output
    without jax: ``(True,)`` where it takes ``_skip_checks`` (jaxlib 0.10: its checks import
    jax), ``()`` where its signature is ``(aval, sharding, committed)`` (jaxlib 0.12: nothing
    to skip, nothing imported; ``tests/serving/test_lite_pyfunc.py`` checks that a fresh process
    never imports jax), None for any other signature (the lite path is then off)."""
    doc = getattr(_jax.array_result_handler, "__doc__", None) or ""
    if "_skip_checks" in doc:
        return (True,)
    if "(aval: object, sharding: object, committed: bool) ->" in doc:
        return ()
    return None


def _client() -> dict[str, Any]:
    """The process's one lite CPU client, its device and the input sharding (made once)."""
    with _LOCK:
        if _STATE.get("pid") != os.getpid():  # none yet, or a forked child's inherited one
            _STATE.clear()
            _jax, xc = _modules()
            try:  # computations on the calling thread: runtime/dispatch.py says why
                client = xc.make_cpu_client(asynchronous=False)
            except TypeError:  # a jaxlib without the argument: its default
                client = xc.make_cpu_client()
            device = client.local_devices()[0]

            class _OneDevice(_jax.SingleDeviceSharding):  # what jax's own sharding adds
                memory_kind = None

                def _to_xla_hlo_sharding(self, ndim: int) -> Any:
                    return xc.HloSharding.replicate()

                @property
                def _internal_device_list(self) -> Any:
                    return xc.DeviceList((device,))

            _STATE.update(
                pid=os.getpid(),
                jax=_jax,
                client=client,
                device=device,
                devices=xc.DeviceList((device,)),
                sharding=_OneDevice(device),
                semantics=_jax.HostBufferSemantics.IMMUTABLE_ONLY_DURING_CALL,
            )
        return _STATE


class _Aval:
    """The shape and dtype jaxlib reads off an array's abstract value."""

    __slots__ = ("shape", "dtype", "weak_type")

    def __init__(self, shape: Sequence[int], dtype: np.dtype) -> None:
        self.shape, self.dtype, self.weak_type = tuple(shape), np.dtype(dtype), False


class _DLPack:
    """A jaxlib buffer seen by ``np.from_dlpack``."""

    __slots__ = ("buffer", "jax")

    def __init__(self, buffer: Any, jax: Any) -> None:
        self.buffer, self.jax = buffer, jax

    def __dlpack__(self, stream: Any = None, **_: Any) -> Any:
        return self.jax.buffer_to_dlpack_managed_tensor(self.buffer)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU, device 0


class CpuExecutable:
    """A serialized XLA:CPU executable of numpy inputs and outputs, run without jax.

    ``outputs``: the ``(shape, dtype)`` of each output, as the executable returns them.
    """

    def __init__(self, payload: bytes, outputs: Sequence[tuple[Sequence[int], Any]]) -> None:
        if not available():
            raise LiteUnavailable("this jaxlib lacks a name the lite path needs")
        try:
            state = _client()
            self._exe = state["client"].deserialize_executable(
                payload, executable_devices=state["devices"]
            )
        except Exception as err:  # noqa: BLE001 - any jaxlib refusal means: go through jax
            raise LiteUnavailable(f"the stored executable did not load: {err}") from err
        self._state = state
        self._pid = state["pid"]
        try:
            tail = _handler_tail(state["jax"]) or ()
            self._handlers = [
                state["jax"].array_result_handler(_Aval(s, d), state["sharding"], True, *tail)
                for s, d in outputs
            ]
        except TypeError as err:
            raise LiteUnavailable(f"this jaxlib wraps outputs otherwise: {err}") from err

    def __call__(self, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The outputs on ``inputs`` (C-contiguous numpy arrays of the compiled shapes).
        Raises :class:`LiteUnavailable` in a forked child (the client is its parent's)."""
        if os.getpid() != self._pid:
            raise LiteUnavailable("this executable was loaded by the parent of this process")
        state = self._state
        put, jax_ = state["jax"].batched_device_put, state["jax"]
        dev, sharding, sem = state["device"], state["sharding"], state["semantics"]
        args = [
            put(_Aval(x.shape, x.dtype), sharding, [x], [dev], True, False, sem, False)
            for x in inputs
        ]
        results = self._exe.execute_sharded(args).consume_with_handlers(self._handlers)
        return [np.from_dlpack(_DLPack(r, jax_)) for r in results]


def serialize(compiled: Any) -> bytes:
    """The bytes of a ``jax.stages.Compiled``'s XLA executable (``runtime_executable()``)."""
    exe = compiled.runtime_executable()
    return bytes(exe.client.serialize_executable(exe))
