"""A symbolic-batch model IREE runs compiled per batch size: ``main`` specialized to static shapes.

IREE 3.13 cannot compile some symbolic-batch modules as they are (an embedding ``gather``, a
flatten's ``dynamic_reshape``: ``verdict.SPECIALIZED``). :class:`StaticIreeModel` runs them with
one module per batch size, each ``main`` specialized to that size before it is compiled
(``specialize``), compiled on first use and kept (the ``.vmfb`` also in the compile cache).

Which sizes: where the model's rows are proven independent at save time (MLmodel
``padding.rows_independent``, ``runtime/rows.py``) and the batch is the leading axis of every
input and output, a batch of ``n`` rows is padded (its last row repeated, as pyfunc pads) to the
next power of two and the padding rows dropped from the outputs, so sizes 1, 2, 4, ..., 1024
cover every batch up to 1024 with 11 modules; otherwise each batch size gets its own module.
Batch 1 is compiled at load (a module that cannot be specialized is refused there, not at the
first call). The params are uploaded once and passed to every module.

Which driver: where none was asked for (``iree_driver=``, ``JAXEXP_IREE_DRIVER``) and the params
are bound into the modules, sizes of at least :data:`TASK_MIN_ROWS` rows run on IREE's
``local-task`` driver (a thread pool over the cores), smaller ones on ``local-sync`` (the calling
thread: no hand-off per dispatch). Measured on the 2-core VM, ``local-task`` / ``local-sync`` per
call: the 784-512-512-10 MLP 2.02 at 1 row, 1.70 at 8, 0.89 at 32, 0.63-0.73 at 64-256,
0.64-0.98 at 1024-2048; the CNN of ``benchmarks/onnx_models.py`` 1.48 at 1 row, 0.83 at 4, 0.81
at 16, 0.28-0.59 at 256-1024 (docs/longevity.md). Each driver has a VM instance and device of
its own; the modules of a size on ``local-task`` read the same bound params (a module packs its
own copy of them at load either way). Rows are not work, though: one row of the transformer of
``onnx_models.py`` is 128 tokens, and its sizes of 2-8 rows ran 1.5-1.9x faster on
``local-task``. So a smaller size whose call on ``local-sync`` takes at least
:data:`TRIAL_MS` is timed on both drivers at its first use (zeros of its input shapes, a warm
call and up to three timed ones on each) and runs on the faster from then on; below that, the
thread pool's hand-off per dispatch cannot pay. Both drivers run the same compiled code: the
outputs are the same bytes (``tests/iree/test_iree_static.py``).

Big batches: a padded model runs a batch of more than :data:`CHUNK_ROWS` rows as consecutive
chunks of that many (rows are proven independent, so the answer is the same; each chunk padded
as usual) and joins the outputs. IREE's code for a whole 1024-row batch ran slower per row than
for 256 rows where the intermediates outgrow the caches: on the 2-core VM the CNN of
``benchmarks/onnx_models.py`` at 1024 rows 88.7-96.0 ms whole against 46.5-47.6 ms in chunks
of 128 or 256 (chunks of 512: 94.7 ms), the MLP 5.7 against 4.7 ms, the transformer the same
(2.35-2.42 against 2.34-2.39 s). Chunks also bound the memory of a call by the chunk's.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxexp_mlflow import settings
from jaxexp_mlflow.iree import shapes
from jaxexp_mlflow.iree.model import (
    DEFAULT_DRIVER,
    TASK_DRIVER,
    IreeModel,
    Runner,
    batch_shapes,
    check_interface,
    claim_task_driver,
    task_driver_usable,
)

#: ``0``/``off``: only the models IREE cannot compile otherwise go per batch size; by default
#: (``auto``) also every model with one dimension variable whose rows are proven independent.
ENV_STATIC = "JAXEXP_IREE_STATIC"
#: Batch sizes of at least this many rows run on ``local-task`` where the driver is ours to
#: choose (module docstring).
TASK_MIN_ROWS = 32
#: A size below TASK_MIN_ROWS whose call on ``local-sync`` takes at least this many ms is timed
#: on both drivers at its first use and runs on the faster (module docstring);
#: ``JAXEXP_IREE_TRIAL_MS`` sets it (``0``: every size; ``off``: none).
TRIAL_MS = 1.0
ENV_TRIAL = "JAXEXP_IREE_TRIAL_MS"
#: ``local-task`` must be at least this much faster to be chosen (timings swing a few %).
_TASK_GAIN = 0.9
_logger = logging.getLogger(__name__)
#: A padded model runs a batch of more rows than this as consecutive chunks of this many rows
#: (module docstring); ``JAXEXP_IREE_CHUNK_ROWS`` sets it, ``0`` turns chunking off.
CHUNK_ROWS = 256
ENV_CHUNK = "JAXEXP_IREE_CHUNK_ROWS"


def chunk_rows() -> int:
    """The chunk size of big batches: ``JAXEXP_IREE_CHUNK_ROWS`` (``0``: none), else
    :data:`CHUNK_ROWS`."""
    text = settings.JAXEXP_IREE_CHUNK_ROWS.get().strip()
    if not text:
        return CHUNK_ROWS
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(
            f"{ENV_CHUNK}={text!r}: expected a number of rows (0 runs every batch whole), "
            f"found {text!r}. Set it to an integer such as {CHUNK_ROWS}, or unset it."
        )
    return value


def trial_ms() -> float | None:
    """The ``local-sync`` call time (ms) from which a small size is timed on both drivers
    (``JAXEXP_IREE_TRIAL_MS``; None: never)."""
    text = settings.JAXEXP_IREE_TRIAL_MS.get().strip()
    if not text:
        return TRIAL_MS
    if text.lower() in ("off", "never", "none"):
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(
            f"{ENV_TRIAL}={text!r}: expected milliseconds (0 times every size on both drivers) "
            "or 'off' (sizes under TASK_MIN_ROWS stay on local-sync). Fix or unset it."
        )
    return value


def rows_independent(meta: dict[str, Any]) -> bool:
    """Whether the save-time proof recorded the model's rows independent (MLmodel ``padding``)."""
    padding = meta.get("padding")
    return isinstance(padding, dict) and padding.get("rows_independent") is True


def static_wanted(meta: dict[str, Any], description: Any) -> bool:
    """Whether a model IREE compiles as it is also goes per batch size (``JAXEXP_IREE_STATIC``
    not off, rows proven independent, one dimension variable leading every input and output):
    static shapes and params bound into the module make IREE's code much faster (measured:
    MLP batch 1 ~3x), at one compile (seconds, cached) per power-of-two bucket on first use."""
    if not settings.JAXEXP_IREE_STATIC.get():
        return False
    if not rows_independent(meta):
        return False
    try:
        ins = [shapes.Aval.parse(a) for a in description.in_avals]
        outs = [shapes.Aval.parse(a) for a in description.out_avals]
    except ValueError:
        return False
    name = shapes.dim_var(ins)
    return (
        name is not None
        and leading_batch([a for a in ins if a.symbolic], name)
        and leading_batch(outs, name)
    )


def padded_size(n: int) -> int:
    """The bucket a batch of ``n`` rows is padded to: the next power of two."""
    return 1 << max(n - 1, 0).bit_length()


def leading_batch(avals: list[shapes.Aval], name: str) -> bool:
    """Whether every aval has the dimension variable ``name`` as its leading axis and nowhere
    else (what padding rows at the end of axis 0 needs)."""
    return all(
        a.dims and a.dims[0] == name and not any(isinstance(d, str) for d in a.dims[1:])
        for a in avals
    )


class StaticIreeModel(IreeModel):
    """An :class:`IreeModel` whose ``main`` is compiled once per batch size.

    ``vmfb_for(size)`` returns the ``.vmfb`` of ``main`` specialized to batch ``size``;
    ``rows_independent``: the save-time proof that padding rows changes no real row.
    """

    def __init__(
        self,
        vmfb_for: Callable[[int], Any],
        description: Any,
        metadata: dict[str, Any],
        params: list[np.ndarray],
        *,
        rows_independent: bool = False,
        **kwargs: Any,
    ) -> None:
        first = vmfb_for(1)
        super().__init__(first, description, metadata, params, **kwargs)
        self._vmfb_for = vmfb_for
        #: size -> its ``.vmfb`` until its driver is chosen (a trial loads it twice: one compile)
        self._vmfb_pending: dict[int, Any] = {1: first}
        self._lock = threading.Lock()
        self._var = shapes.dim_var(self._input_avals) or ""
        self._functions: dict[int, Runner] = {1: self._runner}
        #: size -> the driver its function runs on, once chosen (:meth:`_choose`)
        self._drivers: dict[int, str] = {}
        #: sizes from TASK_MIN_ROWS up run on the task driver (``_task``: its config, params
        #: module and platform argument, made on first use) where the driver is ours
        self.splits_drivers = self.driver_chosen is None and (self._bound or not self.has_params)
        self._task: tuple[Any, Any, Any] | None = None
        self._task_pid = 0  # the process whose worker threads run the task driver
        self._orphans: list[Any] = []  # a forked child's copies of the parent's task driver
        self.chunk_rows = chunk_rows()
        # input shapes already checked -> (rows, the bucket they are padded to)
        self._padding_seen: dict[tuple, tuple[int, int]] = {}
        self.pads = (
            rows_independent
            and bool(self._var)
            and leading_batch([a for a in self._input_avals if a.symbolic], self._var)
            and leading_batch(self.out_avals, self._var)
        )

    def sizes(self) -> list[int]:
        """The batch sizes compiled so far."""
        return sorted(self._functions)

    def driver_for(self, size: int) -> str:
        """The IREE driver that runs batches of ``size`` rows (for a size under
        TASK_MIN_ROWS, ``local-sync`` until its first use has timed both)."""
        chosen = self._drivers.get(size)
        if chosen is not None:
            return chosen
        if self.splits_drivers and size >= TASK_MIN_ROWS and task_driver_usable():
            return TASK_DRIVER
        return self.driver_chosen or DEFAULT_DRIVER

    def _task_parts(self) -> tuple[Any, Any, Any]:
        """The task driver's config, params module and platform argument (made once)."""
        if self._task is None:
            claim_task_driver()
            config = self._rt.Config(TASK_DRIVER)
            platform = None
            if self._platform_arg is not None:
                platform = self._upload(np.int32(self._platform_index), None, config.device)
            self._task = (config, self._parameters(config), platform)
            self._task_pid = os.getpid()
        return self._task

    def _after_fork(self) -> None:
        """In a forked child: forget the parent's task driver, whose worker threads did not
        come along (a call on it would wait for them forever); its sizes load again on
        ``local-sync``. Its objects are kept, not released: releasing them would wait for the
        same threads."""
        self._lock = threading.Lock()  # only this thread came along: a held lock would stay held
        with self._lock:
            if self._task is None or self._task_pid == os.getpid():
                return
            device = self._task[0].device
            stale = {k: r for k, r in self._functions.items() if r.device is device}
            self._orphans.append((self._task, stale))
            self._task = None
            self._functions = {k: r for k, r in self._functions.items() if k not in stale}
            self._drivers = {k: d for k, d in self._drivers.items() if k not in stale}
            self._shapes_seen.clear()

    def _function_for(self, key: tuple, env: dict[str, int]) -> Runner:
        size = env.get(self._var, 1)
        with self._lock:
            try:
                found = self._functions.get(size)
                if found is None:
                    self._vmfb_pending[size] = self._vmfb_for(size)
                    found = self._functions[size] = self._load(size)
                if size not in self._drivers:
                    found = self._functions[size] = self._choose(size, found)
            finally:
                self._vmfb_pending.pop(size, None)
        return found

    def _choose(self, size: int, runner: Runner) -> Runner:
        """The function that runs ``size`` from now on: ``runner`` (on :meth:`driver_for`'s
        driver), or the same module on ``local-task`` where this size is under TASK_MIN_ROWS,
        its ``local-sync`` call takes at least :func:`trial_ms` and ``local-task`` ran it
        faster (module docstring). The driver is recorded either way."""
        driver = self.driver_for(size)
        limit = trial_ms()
        usable = self.splits_drivers and driver != TASK_DRIVER and task_driver_usable()
        inputs = self._zeros(size) if usable and limit is not None else None
        if inputs is None:
            self._drivers[size] = driver
            return runner
        try:
            sync = self._timed(runner, inputs, limit)
            if sync < limit:
                self._drivers[size] = driver
                return runner
            task = self._load(size, TASK_DRIVER)
            task_ms = self._timed(task, inputs, 0.0)
        except (RuntimeError, ValueError, TypeError) as err:  # the real call will say why
            _logger.debug("jaxexp: IREE batch %d: driver trial failed: %s", size, err)
            self._drivers[size] = driver
            return runner
        won = task_ms < _TASK_GAIN * sync
        _logger.debug(
            "jaxexp: IREE batch %d: local-sync %.3f ms, local-task %.3f ms", size, sync, task_ms
        )
        self._drivers[size] = TASK_DRIVER if won else driver
        return task if won else runner

    def _zeros(self, size: int) -> list[np.ndarray] | None:
        """Zeros of every input's shape at batch ``size``, in the model's dtypes (None where
        the shapes cannot be solved for it)."""
        found = batch_shapes(self._input_avals, self.out_avals, self._constraints, size)
        if found is None:
            return None
        n = self.n_param_leaves
        return [np.zeros(s, self._dtypes[n + i]) for i, s in enumerate(found[0])]

    def _timed(self, runner: Runner, inputs: list[np.ndarray], limit: float) -> float:
        """Median ms of up to three calls of ``runner`` after a warm one; one call only where
        the warm one took under ``limit`` ms."""
        times = []
        for i in range(4):
            start = time.perf_counter()
            self._invoke(runner, inputs)
            times.append((time.perf_counter() - start) * 1e3)
            if i == 0 and times[0] < limit:
                return times[0]
        return float(np.median(times[1:]))

    def _load(self, size: int, driver: str | None = None) -> Runner:
        """What runs the module for batch ``size`` on ``driver`` (default: :meth:`driver_for`
        its driver), its interface checked against the blob's avals at that size."""
        rt = self._rt
        vmfb = self._vmfb_pending.get(size)
        if vmfb is None:
            vmfb = self._vmfb_for(size)
        config, param_module, plan = self._config, self._param_module, self._arg_plan
        if (driver or self.driver_for(size)) == TASK_DRIVER:
            config, param_module, platform = self._task_parts()
            if platform is not None:  # the platform index, uploaded to that device
                plan = [(platform.ref, -1), *plan[1:]]
        module = rt.VmModule.copy_buffer(config.vm_instance, vmfb)
        context = self._new_context(module, config, param_module)
        main = context.modules[module.name]["main"]
        found = batch_shapes(self._input_avals, self.out_avals, self._constraints, size)
        if found is not None:
            inputs, outputs = found
            n = self.n_param_leaves
            static = [shapes.Aval(a.dtype, tuple(a.dims)) for a in self.in_avals[:n]]
            pairs = zip(self._input_avals, inputs, strict=True)
            static += [shapes.Aval(a.dtype, s) for a, s in pairs]
            want = [static[i] for i in self._kept if i >= n or not self._bound]
            if self._platform_arg is not None:
                want.insert(0, shapes.Aval("int32", ()))
            outs = [shapes.Aval(a.dtype, s) for a, s in zip(self.out_avals, outputs, strict=True)]
            check_interface(main.vm_function, want, outs, self._source)
        return Runner(main._vm_context, main.vm_function, config.device, plan)

    def call_flat(self, leaves: list[Any]) -> list[np.ndarray]:
        """Run on the flat input leaves; a batch is padded to its bucket where :attr:`pads`."""
        if self._task is not None and self._task_pid != os.getpid():
            self._after_fork()
        if not self.pads or len(leaves) != len(self._input_avals):
            return super().call_flat(leaves)
        n = self.n_param_leaves
        arrays = [self._as_input(x, n + i) for i, x in enumerate(leaves)]
        key = tuple(a.shape for a in arrays)
        plan = self._padding_seen.get(key)
        if plan is None:  # checked once per input shapes, as the base class checks
            env = shapes.bind_dims(self._input_avals, key, self._input_names, self._constraints)
            rows = env[self._var]
            size = padded_size(rows)
            if batch_shapes(self._input_avals, self.out_avals, self._constraints, size) is None:
                size = rows  # the constraints refuse the bucket: this size's own module
            plan = (rows, size)
            if len(self._padding_seen) < 1024:
                self._padding_seen[key] = plan
        rows, size = plan
        chunk = self.chunk_rows
        if 0 < chunk < rows:  # rows independent: consecutive chunks, each padded as usual
            parts = [
                self.call_flat(
                    [
                        a[i : i + chunk] if aval.symbolic else a
                        for a, aval in zip(arrays, self._input_avals, strict=True)
                    ]
                )
                for i in range(0, rows, chunk)
            ]
            return [np.concatenate(outs) for outs in zip(*parts, strict=True)]
        if size == rows:
            return super().call_flat(arrays)
        padded = [
            np.concatenate([a, np.repeat(a[-1:], size - rows, axis=0)]) if aval.symbolic else a
            for a, aval in zip(arrays, self._input_avals, strict=True)
        ]
        return [out[:rows] for out in super().call_flat(padded)]
