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
``iree_ops``           ops IREE 3.13 cannot compile: a ``gather`` whose result has a symbolic
                       (batch) dimension, i.e. an embedding lookup of a ``batch_polymorphic``
                       export, and a ``dynamic_reshape`` (a reshape that merges or splits the
                       batch dimension: flax ``nn.scan``, ``x.reshape(-1)``). From the
                       save-time walk of the module (``iree.unsupported``); for models without
                       one, from the blob: a gather op in a module with symbolic input shapes;
                       a ``dynamic_reshape`` op always (JAX writes one only for symbolic shapes)
                       Where the inputs have exactly one dimension variable (the batch), these
                       are a warning instead: the model runs compiled per batch size, ``main``
                       specialized to static shapes first (``iree/specialize.py``,
                       ``iree/static.py``); :func:`specialized` says so
``iree_sdy``           the module carries Shardy (``sdy``), which IREE cannot parse, and the model
                       has no prepared module (saved before preparation existed or without JAX)
"""

from __future__ import annotations

import importlib.util
from typing import Any

from jaxexp_mlflow.errors import IncompatibleError
from jaxexp_mlflow.iree.model import DTYPES_HINT, unsupported_dtypes
from jaxexp_mlflow.iree.shapes import Aval, dim_var
from jaxexp_mlflow.runtime.compat import INCOMPATIBLE, OK, WARN, Reason, Verdict

#: Custom calls the IREE path handles itself: shape assertions are checked before the call.
HANDLED_TARGETS = frozenset({"shape_assertion"})

#: As ``iree.prepare.SYMBOLIC_GATHER``/``SYMBOLIC_RESHAPE`` (that module imports jax).
SYMBOLIC_GATHER = "gather with a symbolic batch dimension"
SYMBOLIC_RESHAPE = "reshape of a symbolic batch dimension"
_CONCRETE_BATCH = (
    "Save the model with batch_polymorphic=False: the module then has no symbolic {op}, and "
    "IREE compiles it for the saved batch size unless it holds other ops IREE 3.13 lacks "
    "(serve other sizes with one model per size); or load it with the JAX backend "
    "(backend='jax'), which runs it as saved."
)
#: The way out of each construct ``iree_ops`` refuses.
OPS_ACTION = {
    SYMBOLIC_GATHER: _CONCRETE_BATCH.format(op="gather"),
    SYMBOLIC_RESHAPE: _CONCRETE_BATCH.format(op="reshape"),
}


def unsupported_ops(description: Any, prepared: dict[str, Any] | None) -> list[str]:
    """The constructs of the module IREE 3.13 cannot compile (see ``iree_ops``).

    The save-time walk (``prepared["unsupported"]``) knows each op's result type; without it
    (bare blobs, models saved before it) any ``gather`` of a module with a symbolic input shape
    is taken for one: every such gather measured (embedding lookups, ``vmap``-ed takes,
    ``take_along_axis``) failed to compile.
    """
    ops = description.vhlo_ops or ()
    # JAX writes dynamic_reshape only for a symbolic shape: refused from the blob too, so that
    # a model whose walk predates this construct is refused before compiling as well
    reshapes = [SYMBOLIC_RESHAPE] if any(op.startswith("dynamic_reshape_v") for op in ops) else []
    recorded = (prepared or {}).get("unsupported")
    if isinstance(recorded, list):
        return sorted({str(x)[:200] for x in recorded} | set(reshapes))
    gathers = any(op.startswith(("gather_v", "dynamic_gather_v")) for op in ops)
    try:
        symbolic = any(Aval.parse(a).symbolic for a in description.in_avals)
    except ValueError:
        symbolic = False
    return sorted(([SYMBOLIC_GATHER] if gathers and symbolic else []) + reshapes)


#: The constructs the per-batch-size route (``iree.static``) runs, where the batch is the one
#: dimension variable.
SPECIALIZED = frozenset({SYMBOLIC_GATHER, SYMBOLIC_RESHAPE})
SPECIALIZED_MESSAGE = (
    "The module has a {construct}, which IREE 3.13 cannot compile as it is: the model runs "
    "compiled for each batch size it is called with (main specialized to static shapes; "
    "padded to powers of two where its rows are proven independent)."
)


def specializable(description: Any) -> bool:
    """Whether the inputs have exactly one dimension variable (the batch), which the
    per-batch-size route can set."""
    try:
        return dim_var([Aval.parse(a) for a in description.in_avals]) is not None
    except ValueError:
        return False


def specialized(verdict: Verdict) -> bool:
    """Whether ``verdict`` sends the model to the per-batch-size route (``iree.static``)."""
    return any(r.code == "iree_ops" and r.severity == WARN for r in verdict.reasons)


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
    constructs = unsupported_ops(description, prepared)
    static = bool(constructs) and set(constructs) <= SPECIALIZED and specializable(description)
    for construct in constructs:
        if static:
            add(
                "iree_ops",
                WARN,
                SPECIALIZED_MESSAGE.format(construct=construct),
                "Nothing to do; the first call of each new batch size compiles (seconds; "
                "cached). Save with batch_polymorphic=False for one static module.",
            )
            continue
        add(
            "iree_ops",
            INCOMPATIBLE,
            f"The module has a {construct}, which IREE 3.13 cannot compile.",
            OPS_ACTION.get(construct, use_jax),
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
