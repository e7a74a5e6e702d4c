"""Synthetic probe inputs for a model that carries no reference input.

A model saved without an input example (every bare blob saved with ``save_model(bytes)``) has
nothing to reproduce, yet its blob may still run today. The probes here are made from the
exported input avals alone: each symbolic dimension is instantiated at a small size (a different
one per probe, so a shape-dependent bug shows), and values are dtype-aware (normal floats and
complexes, small signed/unsigned integers, random booleans), drawn from a fixed seed so that the
same model always gets the same probes. They serve two purposes:

* ``save_model`` stores the first probe and its outputs as the model's reference, marked
  ``reference_synthetic`` in MLmodel, so ``jaxexp verify`` always has something to reproduce;
* ``refresh`` runs the old blob and the re-exported one on several probes and compares them,
  then tags the refreshed model with the fact that the proof used synthetic probes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxexp_mlflow.errors import JaxExpError

_logger = logging.getLogger(__name__)

#: Sizes tried for symbolic dimensions, in order; probe ``i`` starts at position ``i``.
DIM_SIZES = (2, 3, 5, 4, 8, 1, 16)
N_PROBES = 3
SEED = 20240601
#: Refuse to synthesize probes of more elements than this (all inputs of one probe).
MAX_ELEMENTS = 1 << 24


class ProbeError(JaxExpError):
    """No probe input can be made (or run) for this model."""


@dataclass(frozen=True)
class Probe:
    """One synthetic input: flat leaves (after the params) and the dimension sizes used."""

    leaves: list[np.ndarray]
    dims: dict[str, int]
    seed: int

    def describe(self) -> str:
        """``"b=2, n=3; seed 20240601"``-like summary (for MLmodel and tags)."""
        sizes = ", ".join(f"{k}={v}" for k, v in sorted(self.dims.items())) or "static shapes"
        return f"{sizes}; seed {self.seed}"


def dim_vars(avals: Sequence[Any]) -> list[str]:
    """The symbolic dimension variables appearing in ``avals`` (sorted)."""
    from jaxexp_mlflow.internals import jax_private

    return jax_private.dim_vars(avals)


def instantiate(avals: Sequence[Any], sizes: dict[str, int]) -> list[tuple[int, ...]] | None:
    """Concrete shapes of ``avals`` with each variable set to ``sizes[var]``; None if a
    dimension comes out below 1."""
    from jaxexp_mlflow.internals.jax_private import eval_dim, is_constant_dim

    shapes = []
    for aval in avals:
        shape = []
        for d in aval.shape:
            n = eval_dim(d, sizes)
            if n < 0 or (n == 0 and not is_constant_dim(d)):
                return None
            shape.append(n)
        shapes.append(tuple(shape))
    return shapes


def values(shape: tuple[int, ...], dtype: Any, rng: np.random.Generator) -> np.ndarray:
    """Dtype-aware values: small integers, random booleans, unit-normal floats/complexes."""
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return rng.random(shape) < 0.5
    if dt.kind == "i":
        return rng.integers(-3, 4, size=shape).astype(dt)
    if dt.kind == "u":
        return rng.integers(0, 5, size=shape).astype(dt)
    if dt.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    if dt.kind == "f" or dt.kind == "V" or "float" in dt.name:
        return (0.5 * rng.standard_normal(shape)).astype(np.float32).astype(dt)
    raise ProbeError(
        f"cannot synthesize values of dtype {dt} (extended dtypes such as PRNG keys need a "
        "real input example)"
    )


def make(avals: Sequence[Any], index: int = 0, attempt: int = 0) -> Probe:
    """Probe number ``index`` for ``avals`` (``attempt`` moves on to the next sizes)."""
    names = dim_vars(avals)
    for shift in range(len(DIM_SIZES)):
        k = index + attempt + shift
        sizes = {n: DIM_SIZES[(k + j) % len(DIM_SIZES)] for j, n in enumerate(names)}
        shapes = instantiate(avals, sizes)
        if shapes is not None:
            break
    else:
        raise ProbeError(f"no small sizes for the symbolic dimensions {names} give valid shapes")
    total = sum(math.prod(s) for s in shapes)
    if total > MAX_ELEMENTS:
        raise ProbeError(f"a probe would hold {total} elements (more than {MAX_ELEMENTS})")
    seed = SEED + index
    rng = np.random.default_rng(seed)
    leaves = [values(s, a.dtype, rng) for s, a in zip(shapes, avals, strict=True)]
    return Probe(leaves, sizes, seed)


def run_probes(
    avals: Sequence[Any], call: Callable[[list[np.ndarray]], Any], n: int = N_PROBES
) -> list[tuple[Probe, Any]]:
    """``n`` probes and what ``call(leaves)`` returns on each.

    A probe whose sizes violate the model's shape constraints (the call raises) is retried with
    the next sizes; after as many attempts as there are sizes, the last error is raised as a
    :class:`ProbeError`.
    """
    out = []
    for i in range(n):
        last: Exception | None = None
        for attempt in range(len(DIM_SIZES)):
            probe = make(avals, i, attempt)
            try:
                out.append((probe, call(probe.leaves)))
                break
            except ProbeError:
                raise
            except Exception as err:  # noqa: BLE001 - shape constraints: try other sizes
                last = err
                if not dim_vars(avals):
                    break
        else:
            last = last or ProbeError("no attempt made")
        if len(out) <= i:
            raise ProbeError(f"the model does not run on synthetic probe {i}: {last}") from last
    return out


def call_flat(model: Any, leaves: Sequence[Any]) -> list[Any]:
    """Run a loaded ``JaxExpModel`` on flat input leaves (those after the params); flat outputs."""
    import jax

    filled = [None] * model._n_param_leaves + list(leaves)
    args, kwargs = jax.tree.unflatten(model.exported.in_tree, filled)
    if model.has_params:
        args = args[1:]
    return [np.asarray(x) for x in jax.tree.leaves(model(*args, **kwargs))]


def store_reference(
    path: Any,
    exported: Any,
    conf: dict[str, Any],
    description: Any,
    params: Any = None,
    model: Any = None,
) -> dict[str, Any]:
    """MLmodel entries for a synthetic reference stored under ``path``, or ``{}``.

    Used by ``save_model`` when no input example is given: if the blob runs here (verdict not
    ``incompatible``), the first probe and the outputs it gives are written as the model's
    reference, marked ``reference_synthetic`` (probe sizes, seed). Never raises: a model that
    cannot be probed here is saved without a reference, as before (the reason is logged).
    ``model`` is the model already loaded from ``path`` (``save_model``'s read-back): it is run
    as it is, with the params as stored, instead of binding ``params`` to ``exported`` again.
    """
    import os
    import shutil
    from pathlib import Path

    from jaxexp_mlflow.runtime import compat
    from jaxexp_mlflow.runtime.model import JaxExpModel
    from jaxexp_mlflow.store import artifact

    verdict = compat.assess(conf, description=description)
    if verdict.status == compat.INCOMPATIBLE:
        _logger.info("No synthetic reference: the model does not run here (%s).", verdict)
        return {}
    try:
        if model is None:
            if isinstance(params, str | os.PathLike):
                from jaxexp_mlflow.params import restore_params

                target = artifact.params_target(exported, (), conf)
                params = restore_params(Path(path, conf["params"]), target=target)
            model = JaxExpModel(exported, params, conf)
        avals = list(exported.in_avals)[int(conf.get("n_param_leaves") or 0) :]
        ((probe, outputs),) = run_probes(avals, lambda leaves: call_flat(model, leaves), n=1)
        reference = artifact.write_reference(
            path, tuple(probe.leaves), outputs, getattr(model, "platform", None)
        )
    except Exception as err:  # noqa: BLE001 - a reference is a bonus, never a reason to fail
        _logger.warning("No synthetic reference stored: %s", err)
        shutil.rmtree(Path(path, "reference"), ignore_errors=True)
        return {}
    return {
        "reference": reference,
        "reference_synthetic": {"dims": dict(probe.dims), "seed": probe.seed},
    }
