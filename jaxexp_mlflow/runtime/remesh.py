"""Re-mesh an exported function onto fewer devices than it was exported for.

A blob of ``nr_devices = N`` names its device mesh once, as Shardy ``sdy.mesh`` symbols; every
sharding in it (arguments, results, ``with_sharding_constraint``) names mesh axes, not devices.
Resizing each mesh so that its axis sizes multiply to ``M`` (each new size dividing the old one,
so every dimension the export split evenly still splits evenly) gives the same function on
``M`` devices; XLA partitions it again. For ``M = 1`` the axes all become 1; a blob with
old-style (GSPMD) shardings, which name devices, has them stripped instead.

What the module bakes the device count into is refused before anything runs, with what was
found: ``shard_map`` bodies (``sdy.manual_computation``: local shapes and axis sizes are
constants in it), collectives (their device groups), ``partition_id``/``replica_id``
(``axis_index`` arithmetic), meshes with explicit device ids, sub-axes, and a device count the
axes cannot be resized to. The ``virtual-devices`` route runs such a blob as it is.

The module is read as ``Exported.call`` reads it (Shardy's round-trip import, inlined meshes
lifted), verified after the rewrite and written with ``jax.export``'s own serializer; the new
``Exported`` has ``nr_devices = M``, its named shardings on abstract meshes of the new sizes,
and its stored VJP re-meshed the same way at every order.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jaxexp_mlflow.errors import IncompatibleError

#: StableHLO ops whose meaning depends on the device count (VHLO names without the version).
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_to_all",
    "reduce_scatter",
    "collective_permute",
    "collective_broadcast",
)
DEVICE_IDS = ("partition_id", "replica_id")
#: GSPMD custom calls of a shard_map body (old-style shardings).
_MANUAL_CALLS = ("SPMDFullToShardShape", "SPMDShardToFullShape")
#: The attributes that carry shardings (arguments, results, constraints, shard_map bodies).
_SHARDING_KEYS = frozenset(
    ("sdy.sharding", "sharding", "arg_attrs", "res_attrs", "in_shardings", "out_shardings")
    + ("mhlo.sharding",)
)
#: How close a re-meshed run is to the N-device run: the same arithmetic, with reductions over
#: a resized axis summed in another order (float32: measured within 4e-7 of the reference's
#: scale, outputs and gradients to order 2, 1 to 4 devices from 8; docs/hardware.md).
RTOL, ATOL = 1e-5, 1e-5
TOLERANCE = (
    f"equal to float rounding (rtol {RTOL:g}, atol {ATOL:g} in float32): reductions over a "
    "resized axis are summed in another order"
)


@dataclass(frozen=True)
class MeshFacts:
    """What a module says about its devices: its meshes ``(symbol, ((axis, size), ...))``,
    whether it carries old-style HLO shardings, and what keeps it from being re-meshed."""

    nr_devices: int
    meshes: tuple[tuple[str, tuple[tuple[str, int], ...]], ...]
    hlo_shardings: bool
    blockers: tuple[str, ...]

    def axes(self) -> dict[str, int]:
        """Every mesh axis with its size (the first mesh naming an axis gives its size)."""
        out: dict[str, int] = {}
        for _, axes in self.meshes:
            for name, size in axes:
                out.setdefault(name, size)
        return out


def pre_judge(description: Any) -> list[str]:
    """What keeps a blob from being re-meshed, read without jax from its op names
    (``BlobDescription.vhlo_ops``); the module read by :func:`read_facts` may find more."""
    ops = {re.sub(r"_v\d+$", "", str(op)) for op in getattr(description, "vhlo_ops", None) or ()}
    found = [f"collective stablehlo.{op} (its device groups)" for op in COLLECTIVES if op in ops]
    found += [
        f"stablehlo.{op} (axis_index arithmetic on device ids)" for op in DEVICE_IDS if op in ops
    ]
    targets = set(getattr(description, "custom_call_targets", None) or ())
    found += [f"custom call {t} (a shard_map body)" for t in _MANUAL_CALLS if t in targets]
    return found


def _walk(op: Any) -> Iterator[Any]:
    yield op
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                yield from _walk(inner.operation)


def _attr_items(op: Any) -> Iterator[tuple[str, Any]]:
    attrs = op.attributes
    for i in range(len(attrs)):
        named = attrs[i]
        yield named.name, named.attr


def _mesh_axes(text: str) -> tuple[tuple[str, int], ...]:
    return tuple((n, int(s)) for n, s in re.findall(r'"([^"]+)"\s*=\s*(\d+)', text))


def _import(module: Any, tools: Any) -> None:
    """Shardy's imports as ``Exported.call`` runs them: round-trip attributes, then inlined
    meshes lifted to symbols."""
    attrs = module.operation.attributes
    if "mhlo.frontend_attributes" in attrs and "xla.sdy.meshes" in str(
        attrs["mhlo.frontend_attributes"]
    ):
        tools.pass_manager.parse("builtin.module(xla-sdy-round-trip-import-shardy-attrs)").run(
            module.operation
        )
    tools.pass_manager.parse("builtin.module(sdy-lift-inlined-meshes)").run(module.operation)


def _facts(module: Any, nr_devices: int) -> MeshFacts:
    meshes: list[tuple[str, tuple[tuple[str, int], ...]]] = []
    blockers: list[str] = []
    hlo = False
    for op in _walk(module.operation):
        name = op.name
        if name == "sdy.mesh":
            attrs = op.attributes
            symbol = str(attrs["sym_name"]).strip('"')
            text = str(attrs["mesh"])
            meshes.append((symbol, _mesh_axes(text)))
            if "device_ids" in text:
                blockers.append(f"mesh @{symbol} lists explicit device ids ({text})")
        elif name == "sdy.manual_computation":
            manual = str(op.attributes["manual_axes"]) if "manual_axes" in op.attributes else ""
            blockers.append(
                f"a shard_map body (sdy.manual_computation, manual axes {manual}): its local "
                "shapes and axis sizes are constants in it"
            )
        elif name.startswith("stablehlo.") and name[10:] in COLLECTIVES:
            blockers.append(f"collective {name} (its device groups)")
        elif name.startswith("stablehlo.") and name[10:] in DEVICE_IDS:
            blockers.append(f"{name} (axis_index arithmetic on device ids)")
        elif name == "stablehlo.custom_call":
            target = str(op.attributes["call_target_name"]).strip('"')
            if target in _MANUAL_CALLS:
                blockers.append(f"custom call {target} (a shard_map body)")
        for key, attr in _attr_items(op):
            if key not in _SHARDING_KEYS:  # never print a constant's (maybe huge) value
                continue
            text = str(attr)
            if key == "mhlo.sharding" or "mhlo.sharding" in text:
                hlo = True
            if "#sdy.sharding" in text or key == "sharding" or "sdy.sharding" in key:
                if re.search(r'"[^"]+":\(\d+\)\d+', text):
                    blockers.append(f"a sharding over a sub-axis ({text[:120]})")
    unique = tuple(dict.fromkeys(blockers))
    return MeshFacts(int(nr_devices), tuple(meshes), hlo, unique)


def read_facts(exported: Any) -> MeshFacts:
    """The :class:`MeshFacts` of ``exported``'s module (needs the jax that deserialized it)."""
    tools = _tools()
    with tools.make_ir_context():
        module = tools.deserialize(exported.mlir_module_serialized)
        _import(module, tools)
        return _facts(module, exported.nr_devices)


def _tools() -> Any:
    from jaxexp_mlflow.internals.jax_private import module_tools

    tools, why = module_tools()
    if tools is None:
        raise IncompatibleError(
            f"The remesh route is closed on this jax: {why}. Expected the private names it "
            "rewrites modules with (docs/internals.md); take --route virtual-devices instead."
        )
    return tools


def choose_sizes(axes: Mapping[str, int], devices: int) -> dict[str, int]:
    """New axis sizes multiplying to ``devices``, each dividing the old size (the leading axes
    keep the most: ``{data: 2, model: 4}`` -> 4 is ``{data: 2, model: 2}``).

    Raises:
        IncompatibleError: no such sizes (a device count the axes do not divide).
    """
    left = int(devices)
    sizes = {}
    for name, size in axes.items():
        sizes[name] = math.gcd(left, int(size))
        left //= sizes[name]
    if left != 1 or devices < 1:
        shown = ", ".join(f"{n}={s}" for n, s in axes.items())
        raise IncompatibleError(
            f"Cannot re-mesh onto {devices} devices: expected a count whose factors divide the "
            f"mesh axes ({shown}), found a size that does not divide them. Pick a device count "
            "such as " + ", ".join(str(d) for d in _fits(axes)) + ", or take --route "
            "virtual-devices."
        )
    return sizes


def _fits(axes: Mapping[str, int]) -> list[int]:
    total = math.prod(axes.values()) if axes else 1
    return [d for d in range(1, total) if total % d == 0 and _divides(axes, d)]


def _divides(axes: Mapping[str, int], devices: int) -> bool:
    left = devices
    for size in axes.values():
        left //= math.gcd(left, size)
    return left == 1


def change_text(facts: MeshFacts, sizes: Mapping[str, int], devices: int) -> str:
    """``8 devices (data=2, model=4) -> 1 (data=1, model=1)``."""

    def shown(axes: Any) -> str:
        return ", ".join(f"{n}={s}" for n, s in axes)

    meshes = [axes for _, axes in facts.meshes if axes]
    if len(meshes) > 1:  # one group per mesh: (x1=1, x2=2; y2=2, y1=1)
        old = "; ".join(shown(axes) for axes in meshes)
        new = "; ".join(shown((n, sizes.get(n, s)) for n, s in axes) for axes in meshes)
    else:
        old, new = shown(facts.axes().items()), shown(sizes.items())
    return f"{facts.nr_devices} devices ({old}) -> {devices}" + (f" ({new})" if new else "")


def refusal(facts: MeshFacts, devices: int) -> str | None:
    """Why ``facts``'s module cannot run on ``devices`` devices by re-meshing, or None."""
    found = list(facts.blockers)
    if facts.hlo_shardings and devices != 1 and not facts.meshes:
        found.append("old-style HLO (GSPMD) shardings, which name devices (only 1 device works)")
    if not found:
        return None
    return "; ".join(found)


def _rewrite(module: Any, tools: Any, sizes: Mapping[str, int], devices: int) -> None:
    ir = tools.ir
    for op in _walk(module.operation):
        if op.name != "sdy.mesh":
            continue
        axes = _mesh_axes(str(op.attributes["mesh"]))
        new = [(n, sizes.get(n, s)) for n, s in axes]
        body = ", ".join(f'"{n}"={s}' for n, s in new)
        op.attributes["mesh"] = ir.Attribute.parse(f"#sdy.mesh<[{body}]>")
        if "stablehlo.mesh" in op.attributes:  # the mirror some writers keep
            mirror = ", ".join(f'{{name = "{n}", size = {s} : i64}}' for n, s in new)
            op.attributes["stablehlo.mesh"] = ir.Attribute.parse(f"{{axes = [{mirror}]}}")
    attrs = module.operation.attributes
    i32 = ir.IntegerType.get_signless(32)
    attrs["mhlo.num_partitions"] = ir.IntegerAttr.get(i32, int(devices))


def _strip(module: Any, tools: Any) -> None:
    """Old-style shardings removed (1 device): ``mhlo.sharding`` attributes and the
    ``Sharding`` custom calls that only carried one."""
    dead = []
    for op in _walk(module.operation):
        if op.name == "stablehlo.custom_call":
            target = str(op.attributes["call_target_name"]).strip('"')
            if target == "Sharding" and len(op.operands) == 1 and len(op.results) == 1:
                op.results[0].replace_all_uses_with(op.operands[0])
                dead.append(op)
                continue
        if "mhlo.sharding" in op.attributes:
            del op.attributes["mhlo.sharding"]
        if op.name == "func.func":
            for key in ("arg_attrs", "res_attrs"):
                if key in op.attributes:
                    op.attributes[key] = _without_sharding(op.attributes[key], tools.ir)
    for op in dead:
        op.erase()
    i32 = tools.ir.IntegerType.get_signless(32)
    module.operation.attributes["mhlo.num_partitions"] = tools.ir.IntegerAttr.get(i32, 1)


def _without_sharding(array: Any, ir: Any) -> Any:
    out = []
    for d in ir.ArrayAttr(array):
        entries = ir.DictAttr(d)
        kept = {}
        for i in range(len(entries)):
            named = entries[i]
            if named.name != "mhlo.sharding":
                kept[named.name] = named.attr
        out.append(ir.DictAttr.get(kept))
    return ir.ArrayAttr.get(out)


@dataclass(frozen=True)
class Remeshed:
    """The result of :func:`remesh`: the new ``Exported`` and what changed."""

    exported: Any
    facts: MeshFacts
    sizes: dict[str, int]
    devices: int

    @property
    def change(self) -> str:
        """``8 devices (data=2, model=4) -> 1 (data=1, model=1)``."""
        return change_text(self.facts, self.sizes, self.devices)


def plan_sizes(facts: MeshFacts, devices: int) -> dict[str, int]:
    """The new axis sizes for ``devices``, after refusing what cannot be re-meshed."""
    if devices >= facts.nr_devices:
        raise IncompatibleError(
            f"remesh onto {devices} devices: expected fewer than the {facts.nr_devices} the "
            "model was exported for; load it as it is."
        )
    why = refusal(facts, devices)
    if why is not None:
        raise IncompatibleError(
            f"The model cannot be re-meshed from {facts.nr_devices} onto {devices} device(s): "
            f"the module has {why}. Expected shardings that name mesh axes only. Take --route "
            f"virtual-devices (the blob as it is, on {facts.nr_devices} simulated CPU devices "
            "in a child process)."
        )
    if not facts.meshes:
        return {}
    sizes: dict[str, int] = {}
    for symbol, axes in facts.meshes:  # every mesh multiplies to the new device count
        for name, size in choose_sizes(dict(axes), devices).items():
            if sizes.setdefault(name, size) != size:
                raise IncompatibleError(
                    f"Cannot re-mesh onto {devices} devices: expected one size per axis name, "
                    f"found axis {name!r} of mesh @{symbol} needing {size} where another mesh "
                    f"needs {sizes[name]}. Take --route virtual-devices."
                )
    return sizes


def remesh(exported: Any, devices: int) -> Remeshed:
    """``exported`` rewritten for ``devices`` devices (fewer than its ``nr_devices``).

    Raises:
        IncompatibleError: the module bakes in its device count (see the module docstring),
            the axes do not divide into ``devices``, or this jax closes the route.
    """
    tools = _tools()
    devices = int(devices)
    with tools.make_ir_context():
        module = tools.deserialize(exported.mlir_module_serialized)
        _import(module, tools)
        facts = _facts(module, exported.nr_devices)
        sizes = plan_sizes(facts, devices)
        if facts.meshes:
            _rewrite(module, tools, sizes, devices)
        else:
            _strip(module, tools)
        if not module.operation.verify():
            raise IncompatibleError(
                "The re-meshed module does not verify: expected a valid StableHLO module "
                "after resizing its meshes. Take --route virtual-devices."
            )
        data = bytes(tools.to_bytecode(module))
    new = _replace(exported, data, sizes, devices, bool(facts.meshes), facts)
    return Remeshed(new, facts, sizes, devices)


def _resized(sharding: Any, sizes: Mapping[str, int], keep: bool) -> Any:
    mesh = getattr(sharding, "mesh", None)
    if sharding is None or mesh is None or not keep:
        return None
    from jax.sharding import AbstractMesh, NamedSharding

    names = tuple(mesh.axis_names)
    new_sizes = tuple(int(sizes.get(n, 1)) for n in names)
    types = getattr(mesh, "axis_types", None)
    try:
        abstract = AbstractMesh(new_sizes, names, axis_types=types)
    except TypeError:  # a jax whose AbstractMesh takes ((name, size), ...)
        abstract = AbstractMesh(tuple(zip(names, new_sizes, strict=True)))
    return NamedSharding(
        abstract, sharding.spec, memory_kind=getattr(sharding, "memory_kind", None)
    )


def _aval(aval: Any, sizes: Mapping[str, int], keep: bool) -> Any:
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not getattr(mesh, "axis_names", None) or not hasattr(aval, "update"):
        return aval
    if not keep or getattr(mesh, "empty", False):
        return aval
    return aval.update(sharding=_resized(sharding, sizes, True))


def _replicated(facts: MeshFacts, sizes: Mapping[str, int]) -> Any:
    """A replicated sharding on the first mesh, resized (for a blob whose ``Exported`` keeps
    HLO shardings beside a Shardy module: jax 0.8)."""
    from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

    names = tuple(n for n, _ in facts.meshes[0][1])
    new_sizes = tuple(int(sizes.get(n, 1)) for n in names)
    try:
        abstract = AbstractMesh(new_sizes, names)
    except TypeError:
        abstract = AbstractMesh(tuple(zip(names, new_sizes, strict=True)))
    return NamedSharding(abstract, PartitionSpec())


def _replace(
    exported: Any,
    data: bytes,
    sizes: Mapping[str, int],
    devices: int,
    keep: bool,
    facts: MeshFacts,
) -> Any:
    from jaxexp_mlflow.internals import jax_private as private

    changes: dict[str, Any] = {"mlir_module_serialized": data, "nr_devices": int(devices)}
    # HLO shardings (jax 0.8) name devices: the inputs replicated on the resized mesh instead
    replicate = keep and devices > 1 and not private.has_named_shardings(exported)
    if replicate:
        changes["has_named_shardings"] = True
    for side in ("in", "out"):
        n = len(getattr(exported, f"{side}_avals"))
        named = private.named_shardings(exported, side)
        if replicate:
            changes[f"{side}_named_shardings"] = (_replicated(facts, sizes),) * n
        elif named is not None:
            changes[f"{side}_named_shardings"] = tuple(_resized(s, sizes, keep) for s in named)
        changes[f"{side}_shardings_hlo"] = (None,) * n
        avals = f"{side}_avals"
        changes[avals] = tuple(_aval(a, sizes, keep) for a in getattr(exported, avals))
    inner = private.get_vjp(exported)
    changes["get_vjp"] = None if inner is None else _vjp_remeshed(exported, inner, devices)
    return private.replace_exported(exported, **changes)


def _vjp_remeshed(primal: Any, inner: Any, devices: int) -> Any:
    def get(_: Any) -> Any:
        return remesh(inner(primal), devices).exported

    return get


def visible_devices(platform: str | None = None) -> int:
    """How many devices of ``platform`` (default: the running one) this process sees."""
    from jaxexp_mlflow.runtime import platforms as names

    return len(names.devices(platform or names.running_platform()))


def target_devices(devices: Any, nr_devices: int) -> tuple[int, Sequence[Any] | None]:
    """(device count to re-mesh onto, the devices to place on or None) from a load option:
    an int, a list of devices, or None (the devices visible here)."""
    if devices is None:
        count = visible_devices()
        return min(count, nr_devices), None
    if isinstance(devices, int) and not isinstance(devices, bool):
        return devices, None
    listed = list(devices)
    return len(listed), listed


def remesh_for_load(exported: Any, options: Mapping[str, Any]) -> tuple[Remeshed, dict[str, Any]]:
    """(``exported`` re-meshed for the load option ``devices``: a count, a list of devices or
    None for those visible; the options for ``devices.plan``, ``devices`` as a list or left
    out). The axis sizes chosen are logged."""
    import logging

    opts = dict(options)
    count, listed = target_devices(opts.pop("devices", None), int(exported.nr_devices))
    done = remesh(exported, count)  # what the module allows first, then this machine
    if listed is not None:
        opts["devices"] = listed
    elif count > (visible := visible_devices()):
        raise IncompatibleError(
            f"remesh onto {count} devices: expected at most the {visible} visible here, "
            f"found {count} asked for. Pass devices={visible} or fewer (--devices)."
        )
    logging.getLogger(__name__).warning("jaxexp: route remesh: %s", done.change)
    return done, opts
