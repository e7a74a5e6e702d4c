"""The routes for a model exported for more devices than are visible here (``runtime.routes``):

``remesh``          the module's meshes resized to the devices here (``runtime.remesh``), run in
                    this process; taken only when asked
``virtual-devices`` the blob as it is, on ``nr_devices`` simulated CPU devices in a child process
                    (``archive.env_routes.run_virtual``), for a module that cannot be re-meshed

Planned from the blob's description without jax (its mesh axes from the named shardings, what
bakes in the device count from its op names); the module itself is read when the route is
taken, and refused there, before anything runs, with what it holds.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from jaxexp_mlflow.errors import IncompatibleError
from jaxexp_mlflow.runtime import compat, remesh

#: The device routes' names (``runtime/routes.py`` lists them with the others).
REMESH, VIRTUAL_DEVICES = "remesh", "virtual-devices"


def meshes(meta: Mapping[str, Any], description: Any) -> list[tuple[tuple[str, int], ...]]:
    """The distinct meshes ``((axis, size), ...)`` the blob's named shardings state (none for
    HLO ones), in order of appearance."""
    texts = list(getattr(description, "in_shardings", None) or meta.get("in_shardings") or ())
    texts += list(getattr(description, "out_shardings", None) or meta.get("out_shardings") or ())
    found: list[tuple[tuple[str, int], ...]] = []
    for text in texts:
        match = re.search(r"AbstractMesh\(([^)]*)\)", str(text or ""))
        if match:
            axes = tuple((n, int(k)) for n, k in re.findall(r"'([^']+)':\s*(\d+)", match.group(1)))
            if axes and axes not in found:
                found.append(axes)
    return found


def nr_devices(meta: Mapping[str, Any], description: Any) -> int:
    """The blob's ``nr_devices``."""
    return int(getattr(description, "nr_devices", None) or meta.get("nr_devices") or 1)


def remesh_change(meta: Mapping[str, Any], description: Any, devices: int) -> tuple[str, str]:
    """(``8 devices (data=2, model=4) -> 1 (data=1, model=1)``, "" or why it cannot)."""
    found = tuple((f"mesh{i}", axes) for i, axes in enumerate(meshes(meta, description)))
    facts = remesh.MeshFacts(nr_devices(meta, description), found, False, ())
    try:
        sizes = remesh.plan_sizes(facts, devices)
    except IncompatibleError as err:
        return remesh.change_text(facts, {}, devices), str(err)
    return remesh.change_text(facts, sizes, devices), ""


def device_routes(
    meta: Mapping[str, Any], description: Any, env: Mapping[str, Any], route_type: Any
) -> list[Any]:
    """``remesh`` (where nothing in the blob's ops bakes in the device count and the axes
    divide into the devices here) and ``virtual-devices`` (a CPU lowering), in that order."""
    n = nr_devices(meta, description)
    visible = int(env.get("device_count") or 1)
    here = env.get("jax_version")
    routes = []
    blocked = remesh.pre_judge(description)
    change, why = remesh_change(meta, description, visible)
    if not blocked and not why:
        routes.append(
            route_type(
                REMESH,
                here,
                f"load_model(uri, route={REMESH!r}, devices=M) or --route {REMESH} "
                f"[--devices M]: the module's meshes resized, {change}; outputs "
                f"{remesh.TOLERANCE}.",
                "when a jax release moves the private names the module rewrite uses "
                "(jax_private.module_tools: the route then says it is closed) or Shardy "
                "changes its mesh syntax.",
                None,
            )
        )
    platforms = [str(p) for p in (getattr(description, "platforms", None) or ())]
    if "cpu" in (platforms or [str(p) for p in meta.get("platforms") or ()]):
        routes.append(
            route_type(
                VIRTUAL_DEVICES,
                here,
                f"--route {VIRTUAL_DEVICES} (the blob as it is, on {n} simulated CPU devices "
                "in a child process of this Python; answers equal to an "
                f"{n}-device run).",
                "when this jax stops reading the blob (the route runs it unchanged).",
                None,
            )
        )
    return routes


def why_not_devices(
    name: str, blocking: list[str], machine: list[str], description: Any = None
) -> str:
    """Why ``remesh``/``virtual-devices`` is not among the routes that work here."""
    if "devices" not in machine:
        return "the model fits the devices here: take the direct route"
    if blocking:
        return f"this jax refuses the blob for {', '.join(blocking)} as well"
    if "platform" in machine:
        return "this machine lacks the model's platform"
    if name == REMESH:
        found = remesh.pre_judge(description) if description is not None else []
        if found:
            return f"the module has {'; '.join(found)}, which bake in the device count"
        return "the module bakes in its device count or its axes do not divide the devices here"
    return "the blob has no CPU lowering"


def judged_for_remesh(
    verdict: compat.Verdict, meta: Mapping[str, Any], description: Any, routes_text: str
) -> compat.Verdict:
    """The verdict with the device count the re-meshed blob needs (the devices here), after
    refusing a model the ``remesh`` route does not fit; ``routes_text`` names those that do."""
    reasons = [r for r in verdict.reasons if r.severity == compat.INCOMPATIBLE]
    codes = {r.code for r in reasons}
    if codes != {"devices"}:
        found = "\n- ".join(str(r) for r in reasons) or (
            f"a model for {nr_devices(meta, description)} device(s), which fit here"
        )
        raise IncompatibleError(
            f"route={REMESH!r} runs a model exported for more devices than are visible here; "
            f"expected that alone, found:\n- {found}\n{routes_text}"
        )
    blocked = remesh.pre_judge(description)
    if blocked:
        raise IncompatibleError(
            f"The model cannot be re-meshed: the module has {'; '.join(blocked)}. Expected "
            f"shardings that name mesh axes only. Take --route {VIRTUAL_DEVICES}."
        )
    base = compat.Environment.current()
    return compat.assess(
        meta,
        description=description,
        env=base.replace(
            device_count=max(int(base.device_count or 1), nr_devices(meta, description))
        ),
    )
