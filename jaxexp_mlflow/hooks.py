"""A training-loop hook: log metrics every step, and the model every N steps or on improvement.

Call it once per step from a Flax/Optax (or plain JAX) loop::

    hook = TrainingHook(apply, x_example, log_every=500, monitor="val_loss",
                        registered_model_name="classifier", alias="best")
    with hook:
        for step in range(steps):
            params, opt_state, metrics = train_step(params, opt_state, batch)
            hook(step, params, metrics)

Why it is cheap to call often:

- the function is exported (traced and lowered with ``jax.export``) **once**, on the first model
  log; every later log reuses that ``Exported`` (and its VJP when ``vjp_order > 0``);
- params go through an Orbax ``CheckpointManager`` (yours, or one the hook owns), written once
  per logged step; ``log_model`` then links (hardlinks when possible) that checkpoint into the
  model instead of serializing the params a second time;
- in a multi-process JAX job every process takes part in the checkpoint (Orbax saves are
  collective) but only process 0 (``jax.process_index() == 0``) talks to MLflow.

Nothing here runs at import time; jax, orbax and mlflow are imported when the hook is built.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["LoggedStep", "TrainingHook"]

_MODES = ("min", "max")
_REGISTER = ("best", "all")


@dataclass(frozen=True)
class LoggedStep:
    """One model the hook logged: at which step, why, the monitored value and its ModelInfo."""

    step: int
    reasons: tuple[str, ...]  # "every_n", "improved", "manual"
    value: float | None
    model_info: Any  # mlflow.models.model.ModelInfo (None on processes other than 0)


def _scalar(value: Any) -> float:
    """A metric as a Python float (jax/numpy scalars and 0-d/1-element arrays included)."""
    import numpy as np

    return float(np.asarray(value).reshape(()))


def _memoize_vjp(exported: Any, order: int) -> Any:
    """Make ``exported.serialize(vjp_order=order)`` lower each VJP once, not at every log."""
    from jaxexp_mlflow.internals.jax_private import get_vjp as private_get_vjp
    from jaxexp_mlflow.internals.jax_private import with_vjp

    inner = private_get_vjp(exported)
    if order <= 0 or inner is None:
        return exported
    cache: dict[str, Any] = {}

    def get_vjp(e: Any) -> Any:
        if "vjp" not in cache:
            cache["vjp"] = _memoize_vjp(inner(e), order - 1)
        return cache["vjp"]

    return with_vjp(exported, get_vjp)


class TrainingHook:
    """Log metrics every step and the model (export + params) every N steps or on improvement.

    An improvement fewer than ``log_every`` steps after the last improvement log is not logged
    at once: its params are checkpointed (locally, cheap) and logged when the spacing allows, or
    by :meth:`close`, unless a better one replaces it meanwhile. So the model is logged on
    improvement at most once per ``log_every`` steps and ``@best`` still ends on the best params
    seen. Only process 0 logs.

    Args:
        apply_fn: ``apply_fn(params, *inputs)``, the function to serve.
        input_example: its inputs after the params (a tuple for several), used to export it and
            stored with its outputs as the model's reference result (what ``jaxexp verify``
            reproduces).
        name: the logged model's name.
        log_every: log the model every N steps (``step % N == 0``, step 0 excluded); with
            ``monitor``, also the least number of steps between two logs made on improvement.
        monitor: a metric name: log the model when it beats the best logged value by more than
            ``min_delta``; the first value seen counts as an improvement.
        mode: ``"min"`` or ``"max"``: which way ``monitor`` improves.
        min_delta: the least change that counts as an improvement.
        registered_model_name: the registered model the logged models become versions of.
        register: ``"best"`` (those logged on improvement; every logged model when nothing is
            monitored) or ``"all"`` (every logged model).
        alias: the registry alias that follows the best version (with ``monitor``) or the
            latest one (without); None: no alias.
        checkpoint_manager: your Orbax ``CheckpointManager`` (a single PyTree item, or composite
            with an item named ``params``); steps it already holds are reused as they are.
        checkpoint_dir: where the hook keeps its own checkpoints when no manager is given (a
            temporary directory by default).
        max_to_keep: how many steps the hook's own checkpoint manager keeps.
        metrics_every: log metrics every N steps (1: every step).
        async_metrics: send metrics through MLflow's background queue (much cheaper per call
            than a synchronous log), flushed by :meth:`close`.
        run_id: the run to log into (default: the active run, or a new one the hook ends in
            :meth:`close`).
        vjp_order: how many times the logged model may be differentiated.
        batch_polymorphic: export with a symbolic leading (batch) dimension.
        platforms: the platforms to export for, as for ``save_model``.
        log_model_kwargs: extra arguments for ``mlflow.jaxexp.log_model`` (signature,
            pip_requirements, metadata, ...).
        polymorphic_shapes: the export's symbolic shapes, as for ``save_model`` (docs/saving.md:
            symbolic dimensions).

    Raises:
        ValueError: the hook would never log the model (neither ``log_every`` nor ``monitor``),
            or ``mode``, ``register``, ``log_every`` or ``metrics_every`` is out of range.
    """

    def __init__(
        self,
        apply_fn: Callable[..., Any],
        input_example: Any,
        *,
        name: str = "model",
        log_every: int | None = None,
        monitor: str | None = None,
        mode: str = "min",
        min_delta: float = 0.0,
        registered_model_name: str | None = None,
        register: str = "best",
        alias: str | None = "best",
        checkpoint_manager: Any = None,
        checkpoint_dir: str | os.PathLike | None = None,
        max_to_keep: int | None = 2,
        metrics_every: int = 1,
        async_metrics: bool = True,
        run_id: str | None = None,
        vjp_order: int = 0,
        batch_polymorphic: bool = True,
        platforms: Sequence[str] | None = None,
        log_model_kwargs: Mapping[str, Any] | None = None,
        polymorphic_shapes: Any = None,
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"mode={mode!r}: expected 'min' or 'max'")
        if log_every is None and monitor is None:
            raise ValueError(
                "The hook would never log the model: pass log_every=N (every N steps) and/or "
                "monitor='<metric>' (when it improves)."
            )
        if register not in _REGISTER:
            raise ValueError(f"register={register!r}: expected one of {_REGISTER}")
        if log_every is not None and log_every < 1:
            raise ValueError(f"log_every={log_every}: expected a positive number of steps")
        if metrics_every < 1:
            raise ValueError(f"metrics_every={metrics_every}: expected a positive integer")
        import jax

        self.apply_fn = apply_fn
        self.input_example = input_example
        self.name = name
        self.log_every = log_every
        self.monitor = monitor
        self.mode = mode
        self.min_delta = float(min_delta)
        self.registered_model_name = registered_model_name
        self.register = register
        self.alias = alias
        self.metrics_every = metrics_every
        self.async_metrics = async_metrics
        self.vjp_order = int(vjp_order)
        self.batch_polymorphic = batch_polymorphic
        self.platforms = platforms
        self.polymorphic_shapes = polymorphic_shapes
        self.log_model_kwargs = dict(log_model_kwargs or {})
        self.is_main = jax.process_index() == 0
        self.best: float | None = None  # the best value seen (logged, or pending)
        self.best_step: int | None = None
        self._last_improved_log: int | None = None  # step at which the last improvement logged
        self._pending: tuple[int, float] | None = None  # an improvement not logged yet
        self.logged: list[LoggedStep] = []
        self.exported: Any = None
        self._run_id = run_id
        self._started_run = False
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._own_manager = checkpoint_manager is None
        self._manager = checkpoint_manager
        self._checkpoint_dir = checkpoint_dir
        self._max_to_keep = max_to_keep

    # -- public API -----------------------------------------------------------------------------

    def __call__(self, step: int, params: Any, metrics: Mapping[str, Any] | None = None) -> Any:
        """Record one training step: log its metrics, and the model when the schedule says so.

        Args:
            step: the training step.
            params: the params at this step.
            metrics: scalar metrics of this step (``monitor`` among them when it is set).

        Returns:
            The ``ModelInfo`` when a model was logged at this step, else None.
        """
        step = int(step)
        values = {k: _scalar(v) for k, v in (metrics or {}).items()}
        reasons = []
        if self.log_every and step > 0 and step % self.log_every == 0:
            reasons.append("every_n")
        value = values.get(self.monitor) if self.monitor else None
        info = None
        if value is not None and math.isfinite(value) and self._improves(value):
            self.best, self.best_step = value, step
            if reasons or self._spaced(step):
                reasons.append("improved")
                self._pending = None  # superseded by this better one
            else:  # too soon after the last improvement log: keep it for later
                self._checkpoint(step, params)
                self._pending = (step, value)
        else:
            info = self._flush_pending(step)
        if reasons:
            info = self._log(step, params, tuple(reasons), value)
        if self.is_main and values and (info is not None or step % self.metrics_every == 0):
            import mlflow

            # the metrics of a step that logged a model are linked to that model too
            mlflow.log_metrics(
                values,
                step=step,
                run_id=self.run_id,
                model_id=None if info is None else info.model_id,
                synchronous=not self.async_metrics,
            )
        return info

    def log_now(self, step: int, params: Any, metrics: Mapping[str, Any] | None = None) -> Any:
        """Log the model for ``params`` now (e.g. at the end of training), whatever the schedule.

        Args:
            step: the training step.
            params: the params to log.
            metrics: metrics of this step (the ``monitor`` value is recorded with the model).

        Returns:
            The ``ModelInfo`` of the logged model (None on processes other than 0).
        """
        values = {k: _scalar(v) for k, v in (metrics or {}).items()}
        return self._log(int(step), params, ("manual",), values.get(self.monitor or ""))

    @property
    def run_id(self) -> str | None:
        """The MLflow run the hook logs into (started on first use on process 0)."""
        if self._run_id is None and self.is_main:
            import mlflow

            run = mlflow.active_run()
            if run is None:
                run = mlflow.start_run()
                self._started_run = True
            self._run_id = run.info.run_id
        return self._run_id

    @property
    def best_model_info(self) -> Any:
        """ModelInfo of the model logged at the best monitored value (None before that)."""
        for entry in reversed(self.logged):
            if "improved" in entry.reasons:
                return entry.model_info
        return None

    def close(self, status: str = "FINISHED") -> None:
        """Log a pending improvement, finish checkpoint writes, end the hook's run, drop temps.

        A pending improvement is logged on a failure too: the best model seen before the
        failure is not lost.

        Args:
            status: the status the hook's own run ends with (``FAILED`` when the ``with`` block
                raised, as ``mlflow.start_run`` does).
        """
        if self._pending is not None:
            self._flush_pending(None)
        if self._manager is not None:
            self._manager.wait_until_finished()
            if self._own_manager:
                self._manager.close()
                self._manager = None
        if self.is_main and self._run_id is not None and self.async_metrics:
            import mlflow

            mlflow.flush_async_logging()
        if self._started_run:
            import mlflow

            active = mlflow.active_run()
            if active is not None and active.info.run_id == self._run_id:
                mlflow.end_run(status=status)
            self._started_run = False
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> TrainingHook:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.close()
        else:  # the run the hook started ends as mlflow.start_run ends one on an error
            self.close(status="KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED")

    # -- internals ------------------------------------------------------------------------------

    def _spaced(self, step: int) -> bool:
        """Whether an improvement at ``step`` may be logged now (``log_every`` spacing)."""
        last = self._last_improved_log
        return self.log_every is None or last is None or step - last >= self.log_every

    def _flush_pending(self, step: int | None) -> Any:
        """Log the pending improvement from its checkpoint once spacing allows (always on close)."""
        if self._pending is None or (step is not None and not self._spaced(step)):
            return None
        pending_step, value = self._pending
        self._pending = None
        item_dir = self._checkpoint(pending_step, None)
        info = None
        if self.is_main:
            info = self._log_model(pending_step, self.exported, item_dir, ("improved",), value)
        self._last_improved_log = pending_step if step is None else step
        self.logged.append(LoggedStep(pending_step, ("improved",), value, info))
        return info

    def _improves(self, value: float) -> bool:
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def _export(self, params: Any) -> Any:
        """Export once (first log); later logs reuse the same Exported."""
        if self.exported is None:
            import jax

            from jaxexp_mlflow.export import export_function

            fn = self.apply_fn if hasattr(self.apply_fn, "trace") else jax.jit(self.apply_fn)
            exported = export_function(
                fn,
                params,
                self.input_example,
                batch_polymorphic=self.batch_polymorphic,
                platforms=self.platforms,
                polymorphic_shapes=self.polymorphic_shapes,
            )
            self.exported = _memoize_vjp(exported, self.vjp_order)
        return self.exported

    def _checkpoint_manager(self) -> Any:
        if self._manager is None:
            import orbax.checkpoint as ocp

            from jaxexp_mlflow import params as params_codec

            directory = self._checkpoint_dir
            if directory is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="jaxexp-hook-")
                directory = self._tmp.name
            self._manager = ocp.CheckpointManager(
                Path(directory).absolute(),
                options=ocp.CheckpointManagerOptions(
                    max_to_keep=self._max_to_keep, enable_async_checkpointing=False
                ),
                item_handlers=params_codec.checkpoint_handler(),
            )
        return self._manager

    def _checkpoint(self, step: int, params: Any) -> Path:
        """Save ``params`` at ``step`` (all processes) unless the manager has it; its item dir.

        ``params=None`` only looks the step up (a pending improvement saved earlier).
        """
        import orbax.checkpoint as ocp

        from jaxexp_mlflow.params import quiet_ocdbt_merge

        manager = self._checkpoint_manager()
        if step not in manager.all_steps():
            if params is None:
                raise ValueError(
                    f"The checkpoint of step {step} is gone from {manager.directory} (max_to_keep"
                    "?). Keep at least 2 steps so that a pending best model can be logged."
                )
            with quiet_ocdbt_merge():
                manager.save(step, args=ocp.args.PyTreeSave(params), force=True)
        manager.wait_until_finished()
        root = Path(manager.directory)
        step_dir = root / str(step)
        if not step_dir.is_dir():  # a step_prefix / fixed-length name format
            pattern = re.compile(rf"(^|_)0*{step}$")
            found = [p for p in root.iterdir() if p.is_dir() and pattern.search(p.name)]
            if len(found) != 1:
                raise ValueError(
                    f"Cannot find the directory of step {step} under {root} (found "
                    f"{[p.name for p in found]}). Use Orbax's default step names."
                )
            step_dir = found[0]
        items = [p for p in step_dir.iterdir() if (p / "_METADATA").is_file()]
        named = [p for p in items if p.name == "params"]
        if len(items) == 1 or named:
            return (named or items)[0]
        raise ValueError(
            f"The checkpoint at {step_dir} holds items {[p.name for p in items]}; expected one "
            "PyTree item, or one named 'params'. Save the params as their own item."
        )

    def _log(self, step: int, params: Any, reasons: tuple[str, ...], value: float | None) -> Any:
        exported = self._export(params)
        item_dir = self._checkpoint(step, params)  # collective: every process takes part
        info = None
        if self.is_main:
            info = self._log_model(step, exported, item_dir, reasons, value)
        if "improved" in reasons:
            self._last_improved_log = step
        self.logged.append(LoggedStep(step, reasons, value, info))
        return info

    def _registers(self, reasons: tuple[str, ...]) -> bool:
        """Whether a model logged for ``reasons`` becomes a registry version."""
        if not self.registered_model_name:
            return False
        if self.register == "all" or not self.monitor:
            return True
        return "improved" in reasons or "manual" in reasons

    def _log_model(
        self, step: int, exported: Any, item_dir: Path, reasons: tuple[str, ...], value: Any
    ) -> Any:
        import mlflow

        from jaxexp_mlflow.flavors import jaxexp as flavor

        tags = {"jaxexp.step": str(step), "jaxexp.reason": ",".join(reasons)}
        if self.monitor and value is not None:
            tags[f"jaxexp.{self.monitor}"] = repr(value)
        kwargs = dict(self.log_model_kwargs)
        kwargs["tags"] = {**tags, **(kwargs.get("tags") or {})}
        info = flavor.log_model(
            exported,
            name=self.name,
            params=str(item_dir),
            input_example=self.input_example,
            vjp_order=self.vjp_order,
            registered_model_name=self.registered_model_name if self._registers(reasons) else None,
            step=step,
            run_id=self.run_id,
            **kwargs,
        )
        version = info.registered_model_version
        if self.registered_model_name and self.alias and version is not None:
            if "improved" in reasons or not self.monitor:
                mlflow.MlflowClient().set_registered_model_alias(
                    self.registered_model_name, self.alias, version
                )
        return info
