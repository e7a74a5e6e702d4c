"""The IREE backend's verdict: what it cannot run is refused up front, with the reason.

Judged from the blob's own description (jax-free reader) and the save-time preparation, before
anything is compiled. Reasons (codes):

``iree_missing``       the IREE compiler or runtime is not installed
``iree_platform``      the export has no ``cpu`` lowering (a warning with allow_other_platform)
``iree_devices``       exported for several devices (shardings): IREE runs one CPU device here
``iree_effects``       ordered/unordered effects (tokens, callbacks) JAX's runtime implements
``iree_custom_calls``  custom calls other than ``shape_assertion`` (LAPACK, host callbacks...)
``iree_module``        the module cannot be read as MLIR bytecode
``iree_dtypes``        dtypes the IREE runtime cannot pass (e.g. int4, float4)
``iree_sdy``           the module carries Shardy (``sdy``), which IREE cannot parse, and the model
                       has no prepared module (saved before preparation existed or without JAX)
"""

from __future__ import annotations

import importlib.util
from typing import Any

from jaxexp_mlflow.errors import IncompatibleError
from jaxexp_mlflow.iree.model import DTYPES_HINT, unsupported_dtypes
from jaxexp_mlflow.runtime.compat import INCOMPATIBLE, OK, WARN, Reason, Verdict

#: Custom calls the IREE path handles itself: shape assertions are checked before the call.
HANDLED_TARGETS = frozenset({"shape_assertion"})


def iree_installed() -> bool:
    """True when both ``iree.compiler`` and ``iree.runtime`` can be imported."""
    try:
        return all(
            importlib.util.find_spec(m) is not None for m in ("iree.compiler", "iree.runtime")
        )
    except ModuleNotFoundError:
        return False


def assess(
    description: Any,
    *,
    dialects: tuple[str, ...] | None,
    prepared: dict[str, Any] | None,
    allow_other_platform: bool = False,
    need_compiler: bool = True,
) -> Verdict:
    """Judge whether the IREE backend can run the blob ``description`` (a ``BlobDescription``).

    ``dialects`` are the module's dialects (``codec.mlir_bytecode.module_dialects``), ``prepared``
    the MLmodel ``iree`` section written at save time (None for bare or older models).
    """
    reasons: list[Reason] = []

    def add(code: str, severity: str, message: str, action: str) -> None:
        reasons.append(Reason(code, severity, message, action))

    use_jax = "Load it with the JAX backend (backend='jax')."
    if need_compiler and not iree_installed():
        add(
            "iree_missing",
            INCOMPATIBLE,
            "The IREE compiler and runtime are not installed.",
            "pip install 'jaxexp-mlflow[iree]' (iree-base-compiler, iree-base-runtime 3.13).",
        )
    platforms = list(description.platforms)
    if "cpu" not in platforms:
        msg = f"The model was exported for {platforms}, without a cpu lowering."
        if allow_other_platform:
            add(
                "iree_platform",
                WARN,
                msg + " Compiling the first lowering for the CPU anyway.",
                "Re-export it including 'cpu' to make this supported.",
            )
        else:
            add(
                "iree_platform",
                INCOMPATIBLE,
                msg,
                "Re-export it including 'cpu', or pass allow_other_platform=True to try.",
            )
    if description.nr_devices > 1:
        add(
            "iree_devices",
            INCOMPATIBLE,
            f"The model was exported for {description.nr_devices} devices (sharded); the IREE "
            "backend runs single-device exports only.",
            use_jax,
        )
    effects = [*description.ordered_effects, *description.unordered_effects]
    if effects:
        add(
            "iree_effects",
            INCOMPATIBLE,
            f"The module has effects {effects}, which JAX's runtime implements.",
            use_jax,
        )
    targets = description.custom_call_targets
    if targets is None:
        add(
            "iree_module",
            INCOMPATIBLE,
            f"The module cannot be read ({description.module_error}).",
            use_jax,
        )
    else:
        foreign = sorted(set(targets) - HANDLED_TARGETS)
        if foreign:
            add(
                "iree_custom_calls",
                INCOMPATIBLE,
                f"The module calls {foreign}, kernels that exist only inside jaxlib.",
                use_jax + " Or export the function without them (e.g. no jnp.linalg).",
            )
    if unknown := unsupported_dtypes(description):
        add("iree_dtypes", INCOMPATIBLE, f"The model uses dtypes {unknown},", DTYPES_HINT)
    if dialects and "sdy" in dialects and not (prepared and prepared.get("module")):
        add(
            "iree_sdy",
            INCOMPATIBLE,
            "The module carries the Shardy (sdy) dialect, which IREE cannot parse, and the model "
            "has no prepared module.",
            "Run `jaxexp refresh` (or save_model) once where JAX is installed: it stores the "
            "module with sdy stripped beside the original blob.",
        )
    status = max((r.severity for r in reasons), key=[OK, WARN, INCOMPATIBLE].index, default=OK)
    return Verdict(status, tuple(reasons), {"backend": "iree"}, {})


def enforce(verdict: Verdict, *, allow_incompatible: bool = False) -> None:
    """Raise ``IncompatibleError`` listing the reasons of an incompatible verdict."""
    if verdict.status != INCOMPATIBLE or allow_incompatible:
        return
    raise IncompatibleError(
        "The IREE backend cannot run this model:\n- "
        + "\n- ".join(str(r) for r in verdict.reasons if r.severity == INCOMPATIBLE)
    )
