"""Custom calls: targets the running jaxlib does not register (``custom_calls``) and
registered kernels called with a signature the running jax no longer runs
(``kernel_abi``), each judged on the platform the model would run on.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping, Sequence
from typing import Any

from jaxexp_mlflow.runtime.compat.environment import Environment
from jaxexp_mlflow.runtime.compat.releases import kernel_signatures, version_key
from jaxexp_mlflow.runtime.compat.verdict import INCOMPATIBLE, WARN

#: Custom-call targets handled by JAX/XLA themselves (never in a runtime registry).
BUILTIN_TARGETS = frozenset(
    {
        "shape_assertion",
        "Sharding",
        "SPMDFullToShardShape",
        "SPMDShardToFullShape",
        "annotate_device_placement",
        "AllocateBuffer",
        "ApproxTopK",
        "Eigh",
        "Qr",
        "LuDecomposition",
        "ProductOfElementaryHouseholderReflectors",
        "MoveToHost",
        "MoveToDevice",
        "LayoutConstraint",
        "PartialReduce",
        "TopK",
        "X64Combine",
        "X64SplitLow",
        "X64SplitHigh",
        "dce_sink",
        "local_sharding",
    }
)


_BUILTIN_PREFIXES = ("stablehlo.", "mhlo.", "xla.", "sdy.", "chlo.")


#: Which platform a custom-call target belongs to, by name (the kernels jaxlib ships).
_PLATFORM_PREFIXES = (
    ("cpu", ("lapack_", "blas_", "ducc_", "cpu_", "xla_python_cpu", "xla_ffi_python_cpu")),
    ("cuda", ("cu_", "cusolver", "cusparse", "cublas", "cudnn", "cuda_", "mosaic_gpu")),
    ("rocm", ("hip_", "hipsolver", "hipsparse", "hipblas", "rocm_")),
    ("tpu", ("tpu_custom_call",)),
    ("gpu", ("triton_kernel_call", "xla_python_gpu", "xla_ffi_python_gpu", "gpu_")),
)


def target_platform(target: str) -> str | None:
    """The platform a custom-call target belongs to, from its name; None if it is generic."""
    for platform, prefixes in _PLATFORM_PREFIXES:
        if target.startswith(prefixes):
            return platform
    return None


def _is_builtin(target: str) -> bool:
    return target in BUILTIN_TARGETS or target.startswith(_BUILTIN_PREFIXES)


def module_targets(meta: Mapping[str, Any], description: Any) -> Sequence[str] | None:
    """The module's custom-call targets: the MLmodel section's, else the blob's; ``None`` when
    neither states them."""
    targets = meta.get("custom_call_targets")
    if targets is None and description is not None:
        targets = description.custom_call_targets
    return None if targets is None else list(targets)


def _is_polymorphic(description: Any) -> bool:
    """Whether the blob's avals have a symbolic dimension (``float32[b,4]``)."""
    avals = (
        *(getattr(description, "in_avals", None) or ()),
        *(getattr(description, "out_avals", None) or ()),
    )
    return any(re.search(r"\[[^\]]*[A-Za-z_]", str(a)) for a in avals)


def judge_custom_calls(
    targets: Sequence[str] | None,
    platform: str | None,
    env: Environment,
    meta: Mapping[str, Any],
    exporter: dict,
    add: Any,
) -> None:
    """``custom_calls``: targets neither JAX handles itself nor the running jaxlib registers for
    ``platform`` (another platform's kernels are not compiled here)."""
    if not targets or env.custom_call_targets is None or platform is None:
        return
    registered = env.custom_call_targets
    missing = []
    for t in targets:
        if _is_builtin(t) or t in registered:
            continue
        owner = target_platform(t)
        if (
            owner is not None
            and owner != platform
            and not (
                owner == "gpu"
                and platform
                in {
                    "cuda",
                    "rocm",
                }
            )
        ):
            continue  # the lowering for another platform: not compiled here
        missing.append(t)
    if not missing:
        return
    exporter_lib = meta.get("jaxlib_version") or exporter.get("jaxlib_version")
    kernels = [t for t in missing if target_platform(t)]
    if kernels:
        where = (
            f"the exporter's jaxlib {exporter_lib}"
            if exporter_lib
            else "a jaxlib of the exporter's era"
            + (
                f" (built on or before {exporter['build_date_latest']})"
                if exporter.get("build_date_latest")
                else ""
            )
        )
        action = (
            f"Run it with {where}, which has these kernels; to move to this jaxlib, export the "
            "function again from its Python source (a refresh keeps the old kernel calls)."
        )
    else:
        action = (
            "Register them before loading (jax.ffi.register_ffi_target, e.g. by importing the "
            "library that provides them), or pass allow_incompatible=True to try anyway."
        )
    add(
        "custom_calls",
        INCOMPATIBLE,
        f"The module calls custom-call targets {missing} that jaxlib {env.jaxlib_version} does "
        f"not register on {platform}; calling it would fail with NOT_FOUND.",
        action,
    )


def _calls(meta: Mapping[str, Any], description: Any) -> list[tuple[str, int, int]] | None:
    calls = getattr(description, "custom_calls", None)
    if calls is None:
        calls = meta.get("custom_calls")
    return None if calls is None else [(str(t), int(o), int(r)) for t, o, r in calls]


def judge_kernel_abi(
    meta: Mapping[str, Any],
    description: Any,
    platform: str | None,
    env: Environment,
    exporter: dict,
    add: Any,
) -> None:
    """Registered kernels called with a signature the running jax no longer runs.

    With the module's own calls (operand/result counts read from the bytecode) the signature is
    compared directly (a mismatch is ``incompatible``); without them, a module whose exporter
    predates every signature this jax runs only warns (JAX's dates are those of its tests).
    """
    if env.jax_version is None or platform is None:
        return
    registered = env.custom_call_targets
    calls = _calls(meta, description)
    if calls is None:
        latest = exporter.get("build_date_latest")
        targets = module_targets(meta, description) or []
        calls = [(t, -1, -1) for t in targets]
    else:
        latest = None
    seen: set[str] = set()
    # Under a symbolic dimension JAX's FFI lowering appends one shape operand per result when a
    # result shape is dynamic (recorded in the op's ``indices_of_shape_operands``), so a
    # shape-polymorphic module may call a kernel with ``operands + results`` operands.
    polymorphic = _is_polymorphic(description)
    for target, n_ops, n_res in sorted(calls):
        if _is_builtin(target) or (registered is not None and target not in registered):
            continue  # builtins are variadic; unregistered targets are reported by custom_calls
        owner = target_platform(target)
        if (
            owner is not None
            and owner != platform
            and not (owner == "gpu" and platform in {"cuda", "rocm"})
        ):
            continue
        sigs = kernel_signatures(target, env.jax_version)
        running = [s for s in (sigs or []) if s["runs"]]
        if not running or target in seen:
            continue
        if n_ops >= 0:
            counts = {(n_ops, n_res)} | ({(n_ops - n_res, n_res)} if polymorphic else set())
            if any((s["operands"], s["results"]) in counts for s in running):
                continue
            old = [s for s in sigs if (s["operands"], s["results"]) == (n_ops, n_res)]
            called = f"with {n_ops} operand(s) and {n_res} result(s)"
        else:
            first = min(dt.date.fromisoformat(s["written"]) for s in running if s["written"])
            if latest is None or dt.date.fromisoformat(latest) >= first:
                continue
            old = [s for s in sigs if not s["runs"]]
            called = f"as a jaxlib built on or before {latest} wrote it"
        seen.add(target)
        if n_ops < 0:  # dated, not counted: JAX's dates are when its tests were rewritten
            add(
                "kernel_abi",
                WARN,
                f"The module's calls could not be read, and it calls kernel {target}, whose "
                f"signature in jax {env.jax_version} JAX's archive dates after the exporter "
                f"(built on or before {latest}); it may fail at execution with "
                "INVALID_ARGUMENT (wrong number of arguments).",
                "Run `jaxexp verify` to find out; if it fails, export the function again from "
                "its Python source.",
            )
            continue
        now = ", ".join(
            f"{s['operands']} operand(s)/{s['results']} result(s) (written {s['written']}, "
            f"since jax {s['jax_from']})"
            for s in running
        )
        history = ""
        last_ok = None
        if old:
            last_ok = max((s["jax_until"] for s in old), key=version_key)
            history = (
                f"; that signature was written {old[0]['written']} and last run by jax {last_ok}"
            )
        add(
            "kernel_abi",
            INCOMPATIBLE,
            f"The module calls kernel {target} {called}{history}; the kernel in jax "
            f"{env.jax_version} takes {now}: calling it would fail at execution "
            "(INVALID_ARGUMENT: wrong number of arguments).",
            (
                f"Run it with jax/jaxlib {last_ok}, which still runs this signature; "
                if last_ok
                else "Run it with a jaxlib of the exporter's era; "
            )
            + "to move to this jaxlib, export the function again from its Python source "
            "(a refresh keeps the old kernel call).",
        )
