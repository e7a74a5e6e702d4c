"""The route a blob given as bytes is saved through when the running JAX refuses it.

``save_model``/``log_model`` (and ``jaxexp log``) store a blob's bytes unchanged, and never
publish a model that does not load. A blob this JAX refuses (schema < 5 of jax <= 0.7 under
jax >= 0.11.1; old-style HLO shardings; LAPACK kernels this jaxlib no longer has) still loads
here through a route (``runtime/routes.py``): :func:`take` plans the routes that work, takes one,
and gives the ``Exported`` (readable here) that the signature and the MLmodel facts are read
from; :func:`load_for_readback` is the read-back of the finished directory through the same
route (``flavors.readback``). The route taken is recorded in MLmodel (``jaxexp.route``) and
named to the user (a logged warning; ``jaxexp log`` prints it).

Which route, with ``route=None`` (the default): ``direct`` where this JAX reads (and, with an
input example, runs) the blob; else ``expired-flag`` where it applies (JAX's flag set around the
deserialization only: in this process, nothing installed). The routes that build a venv
(``bridge``: jax ``routes.BRIDGE_JAX`` re-exports the blob; ``recorded-env``: the writer's era
runs the whole model) are taken only when asked (``route="bridge"``, ``--route bridge``, or
``"auto"``: the first that works); without one, the refusal names the routes and how to ask.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxexp_mlflow.errors import IncompatibleError
from jaxexp_mlflow.runtime import compat, routes

_logger = logging.getLogger(__name__)

#: What ``route=`` accepts at save time.
CHOICES = (
    "auto",
    routes.DIRECT,
    routes.EXPIRED_FLAG,
    routes.BRIDGE,
    routes.RECORDED_ENV,
    routes.REMESH,
)
#: Verdict codes meaning this JAX cannot deserialize the blob at all.
_UNREADABLE = {"expired", "hlo_sharding", "schema"}
#: The bridge's re-export of the last blob bridged (sha256 -> bytes): a save bridges once, and
#: ``jaxexp log`` (which reads the input structure first) does not bridge twice.
_BRIDGED: dict[str, bytes] = {}


@dataclass
class Taken:
    """The route a save takes: its ``Route`` (None: ``direct``), the ``Exported`` read here
    (for a bridge, the re-export), and the bridged bytes (bridge only)."""

    route: routes.Route | None
    exported: Any
    bridged: bytes | None = None

    @property
    def name(self) -> str:
        """The route's name (``direct`` when none was needed)."""
        return self.route.name if self.route is not None else routes.DIRECT

    def stored_facts(self, description: Any) -> dict[str, Any]:
        """MLmodel facts of the stored blob where the ``Exported`` read here differs from it
        (the bridge's re-export: its calling convention and NamedShardings)."""
        if self.bridged is None:
            return {}
        return {
            "calling_convention_version": int(description.calling_convention_version),
            "in_shardings": [None if s is None else str(s) for s in description.in_shardings],
            "out_shardings": [None if s is None else str(s) for s in description.out_shardings],
        }

    def record(self) -> dict[str, Any] | None:
        """The MLmodel ``jaxexp.route`` entry (None for ``direct``: nothing to record)."""
        if self.route is None:
            return None
        import jax

        return {
            "name": self.route.name,
            "jax_version": self.route.jax_version,
            "closes_on": self.route.closes_on.isoformat() if self.route.closes_on else None,
            "source": self.route.source or None,
            "saved_with_jax": jax.__version__,
            "saved_on": dt.date.today().isoformat(),
        }


def _refused(codes: set[str], verdict: compat.Verdict) -> list[compat.Reason]:
    return [r for r in verdict.reasons if r.severity == compat.INCOMPATIBLE and r.code in codes]


def _how_to_ask(available: list[routes.Route]) -> str:
    names = [r.name for r in available if r.name in CHOICES]
    if not names:
        return ""
    first = names[0]
    return (
        f"\nAsk for one: log_model(blob, ..., route={first!r}) or save_model(..., "
        f"route={first!r}); `jaxexp log BLOB --route {first}`; route='auto' takes the first "
        "that works (bridge and recorded-env build a cached venv once, then reuse it)."
    )


def _refuse(
    why: str, reasons: list[Any], available: list[routes.Route], *, asked: str | None
) -> IncompatibleError:
    text = why + (":\n- " + "\n- ".join(str(r) for r in reasons) if reasons else ".")
    text += "\n" + routes.describe(available)
    if asked is None or asked == routes.DIRECT:
        text += _how_to_ask(available)
    return IncompatibleError(text)


def plan(description: Any, *, runs: bool) -> tuple[compat.Verdict, list[routes.Route], bool]:
    """(verdict, working routes, whether a route other than ``direct`` is needed) for a blob
    given as bytes; ``runs``: the save will run it (an input example was given)."""
    verdict = compat.assess({}, description=description)
    available = [r for r in routes.plan(verdict, {}, description) if r.name in CHOICES]
    unreadable = bool(_refused(_UNREADABLE, verdict))
    blocking = {r.code for r in verdict.reasons if r.severity == compat.INCOMPATIBLE}
    # machine reasons (platform, devices) no route fixes: refused later, as they always were
    needs = unreadable or (runs and bool(blocking - {"platform", "devices"}))
    return verdict, available, needs


def choose(
    description: Any, *, route: str | None, runs: bool, has_params: bool
) -> routes.Route | None:
    """The route a save of the described blob takes (None: ``direct``), without reading the
    blob: ``IncompatibleError`` naming the working routes and how to ask for them where none is
    taken. ``runs``: an input example was given (the read-back runs the model); ``has_params``:
    params are stored beside it (``recorded-env`` runs bare blobs only)."""
    if route is not None and route not in CHOICES:
        raise IncompatibleError(
            f"route={route!r}: expected one of {', '.join(CHOICES)} (or None: direct, else "
            f"{routes.EXPIRED_FLAG} where it applies)."
        )
    verdict, available, needs = plan(description, runs=runs)
    if not needs and route in (None, routes.DIRECT, "auto"):
        return None
    here = (verdict.environment or {}).get("jax_version")
    why = (
        f"jax {here} cannot read the given blob, so it cannot be saved from here as it is"
        if _refused(_UNREADABLE, verdict)
        else f"jax {here} cannot run the given blob to compute its reference outputs (save it "
        "without input_example, or through a route)"
    )
    blocking = [r for r in verdict.reasons if r.severity == compat.INCOMPATIBLE]
    if route is None:
        chosen = routes.find(available, routes.EXPIRED_FLAG)
    elif route == "auto":
        chosen = next((r for r in available if r.name != routes.DIRECT), None)
    elif route == routes.DIRECT:
        chosen = None
    else:
        chosen = routes.find(available, route)
        if chosen is None:
            raise _refuse(
                f"route={route!r} does not work here for the given blob ({why})",
                blocking,
                available,
                asked=route,
            )
    if chosen is None:
        raise _refuse(why, blocking, available, asked=route)
    if chosen.name == routes.RECORDED_ENV and has_params:
        raise _refuse(
            f"route={routes.RECORDED_ENV!r} runs bare blobs only, and params were given ({why})",
            blocking,
            [r for r in available if r.name != routes.RECORDED_ENV],
            asked=route,
        )
    return chosen


def take(
    data: bytes, description: Any, *, route: str | None, runs: bool, has_params: bool
) -> Taken:
    """Plan the route that loads the blob ``data`` here (:func:`choose`) and take it: the
    ``Exported`` read through it, the route named in a logged warning."""
    from jaxexp_mlflow.codec import blob as blob_codec

    chosen = choose(description, route=route, runs=runs, has_params=has_params)
    if chosen is None:
        return Taken(None, blob_codec.deserialize_checked(data, source="the given blob"))
    import jax

    taken = _enter(chosen, data, description)
    _logger.warning(
        "jaxexp: jax %s refuses the given blob as it is; it is saved unchanged and loads here "
        "through route %s. %s",
        jax.__version__,
        chosen,
        "The route is recorded in MLmodel (jaxexp.route); `jaxexp refresh` makes a current copy.",
    )
    return taken


def _enter(chosen: routes.Route, data: bytes, description: Any) -> Taken:
    """Read the blob here through ``chosen``."""
    from jaxexp_mlflow.codec import blob as blob_codec

    if chosen.name == routes.EXPIRED_FLAG:
        with routes.expired_flag():
            exp = blob_codec.deserialize_checked(data, source="the given blob")
        return Taken(chosen, routes.with_scoped_vjp(exp))
    if chosen.name == routes.REMESH:  # stored for its own devices; read back re-meshed
        return Taken(chosen, blob_codec.deserialize_checked(data, source="the given blob"))
    if chosen.name == routes.BRIDGE:
        new = bridged(data, int(description.nr_devices))
        source = f"the given blob (re-exported by jax {routes.BRIDGE_JAX})"
        exp = blob_codec.deserialize_checked(new, source=source)
        return Taken(chosen, exp, new)
    # recorded-env: the whole model runs in the writer's era; here only its structure is read
    return Taken(chosen, readable(data))


def readable(data: bytes) -> Any:
    """An ``Exported`` of ``data`` for its structure and avals: read as is, else with JAX's
    expired-versions flag in scope, else the bridge's re-export if one was made for it."""
    from jaxexp_mlflow.codec import blob as blob_codec

    try:
        return blob_codec.deserialize_checked(data, source="the given blob")
    except Exception:  # noqa: BLE001 - then with the flag
        pass
    try:
        with routes.expired_flag():
            return blob_codec.deserialize_checked(data, source="the given blob")
    except Exception as err:  # noqa: BLE001
        new = _BRIDGED.get(blob_codec.sha256(data))
        if new is None:
            raise IncompatibleError(
                f"This jax cannot read the given blob's structure, even with "
                f"{compat.EXPIRED_FLAG} set: {err}. Expected a blob this jax reads; take route "
                f"{routes.BRIDGE!r} (jax {routes.BRIDGE_JAX} re-exports it first)."
            ) from err
        return blob_codec.deserialize_checked(new, source="the given blob (bridged)")


def bridged(data: bytes, nr_devices: int) -> bytes:
    """``data`` re-exported by jax ``routes.BRIDGE_JAX`` in its cached venv (once per blob)."""
    from jaxexp_mlflow.archive import env_routes
    from jaxexp_mlflow.codec import blob as blob_codec

    key = blob_codec.sha256(data)
    if key not in _BRIDGED:
        new, _ = env_routes.reexport_in(routes.BRIDGE_JAX, data, nr_devices=nr_devices)
        _BRIDGED.clear()  # one blob at a time: a save's, and the CLI's read of its structure
        _BRIDGED[key] = new
    return _BRIDGED[key]


def recorded_name(conf: dict[str, Any]) -> str | None:
    """The route recorded in a model's MLmodel section (``jaxexp.route.name``), if any."""
    entry = conf.get("route")
    name = entry.get("name") if isinstance(entry, dict) else None
    return name if name in routes.ROUTES else None


#: Recorded routes that ``jaxexp verify``/``predict``/``refresh`` take without ``--route``: their
#: JAX is this one or ``routes.BRIDGE_JAX`` (fixed here, never read from the model directory).
TAKEN_WHEN_RECORDED = (routes.EXPIRED_FLAG, routes.BRIDGE)


def recorded_route_here(
    conf: dict[str, Any], description: Any, *, allow_other_platform: bool = False
) -> routes.Route | None:
    """The route a model's MLmodel records (``expired-flag`` or ``bridge``), where this JAX
    still refuses the model as it is and that route works here; else None (the plain load)."""
    name = recorded_name(conf)
    if name not in TAKEN_WHEN_RECORDED:
        return None
    verdict = compat.assess(
        conf, description=description, allow_other_platform=allow_other_platform
    )
    available = routes.plan(verdict, conf, description)
    if routes.find(available, routes.DIRECT) is not None:
        return None
    return routes.find(available, name)


# -- the read-back through the route -----------------------------------------------------------


class RecordedEnvModel:
    """The model run whole by the writer's era (``recorded-env``): called like a
    ``JaxExpModel`` without params; each call runs the blob in the cached venv."""

    has_params = False
    params = None

    def __init__(self, exported: Any, data: bytes, jax_version: str) -> None:
        self.exported = exported
        self._data = data
        self.jax_version = jax_version
        self.route = routes.RECORDED_ENV

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import jax

        from jaxexp_mlflow.archive import env_routes

        leaves = jax.tree.leaves((args, kwargs))
        outs, _ = env_routes.run_in(
            self.jax_version, self._data, leaves, nr_devices=int(self.exported.nr_devices)
        )
        return jax.tree.unflatten(self.exported.out_tree, outs)


def load_for_readback(path: Path, conf: dict[str, Any], bind: Any = None) -> Any:
    """The model directory at ``path`` loaded through the route its MLmodel records (bridge or
    recorded-env; the in-process ones go through ``runtime.loader.load_directory``)."""
    from jaxexp_mlflow.codec import blob as blob_codec
    from jaxexp_mlflow.runtime import devices
    from jaxexp_mlflow.store import artifact

    name = recorded_name(conf)
    data = artifact.read_blob(path, conf)  # checked against exported_sha256
    entry = conf["route"]
    if name == routes.RECORDED_ENV:
        return RecordedEnvModel(readable(data), data, str(entry.get("jax_version")))
    if name != routes.BRIDGE:
        raise IncompatibleError(
            f"route {name!r} is not one a save reads back through here; expected "
            f"{routes.BRIDGE} or {routes.RECORDED_ENV}. Report the issue."
        )
    from jaxexp_mlflow.runtime.loader import bind_model

    desc = blob_codec.describe(data, source=str(path))
    new = bridged(data, int(desc.nr_devices))
    exported = blob_codec.deserialize_checked(
        new, source=f"{path} (re-exported by jax {routes.BRIDGE_JAX})"
    )
    placement = devices.plan(exported)
    if bind is not None:
        from jaxexp_mlflow.runtime.model import JaxExpModel

        model = JaxExpModel(placement.exported, bind, conf, placement=placement)
    else:
        model = bind_model(placement.exported, path, conf, placement)
    model.route = routes.BRIDGE
    return model


def check_runs(taken: Taken, conf: dict[str, Any], description: Any) -> None:
    """Before the read-back runs the input example through ``taken``: this machine fits it
    (the refusal says why not). The venv routes run it with the devices the export needs."""
    if taken.name in (routes.BRIDGE, routes.RECORDED_ENV):
        if taken.name == routes.BRIDGE:
            from jaxexp_mlflow.codec import blob as blob_codec

            bridged_desc = blob_codec.describe(taken.bridged or b"", source="the bridged blob")
            verdict = compat.assess({}, description=bridged_desc)
        else:
            return
    elif taken.name == routes.REMESH:
        verdict = verdict_for(conf, description)
    else:
        verdict = routes.judged_with_flag(conf, description)
    if verdict.status == compat.INCOMPATIBLE:
        raise IncompatibleError(
            f"Cannot compute the reference outputs of this model here (route {taken.name}):\n- "
            + "\n- ".join(str(r) for r in verdict.reasons if r.severity == compat.INCOMPATIBLE)
            + "\nSave it without input_example, or on a machine where it runs."
        )


def verdict_for(conf: dict[str, Any], description: Any = None) -> compat.Verdict:
    """The verdict the read-back judges a directory by: with JAX's flag where the recorded
    route is ``expired-flag``, else as it is."""
    if recorded_name(conf) == routes.EXPIRED_FLAG:
        return routes.judged_with_flag(conf, description)
    if recorded_name(conf) == routes.REMESH:  # run re-meshed onto the devices here
        from jaxexp_mlflow.runtime.device_routes import judged_for_remesh

        verdict = compat.assess(conf, description=description)
        return judged_for_remesh(verdict, conf, description, "")
    return compat.assess(conf, description=description)


__all__ = [
    "CHOICES",
    "RecordedEnvModel",
    "Taken",
    "bridged",
    "check_runs",
    "choose",
    "load_for_readback",
    "plan",
    "readable",
    "recorded_name",
    "recorded_route_here",
    "take",
    "verdict_for",
]
