"""Models exported for 8 devices, for the remesh and virtual-devices routes.

``export_all(out)`` runs in a child that sees 8 CPU devices: it exports each case, saves it as a
model (``mlflow.jaxexp.save_model`` of the blob) and stores the 8-device outputs and gradients
(``reference.npz``); ``run_all(out, devices)`` loads each model by the remesh route on the devices
of its own process and returns the largest differences from that reference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

#: name -> vjp order the case is serialized with
#: (explicit axes: outputs only; jax 0.10.2 cannot differentiate an explicit-axes export)
CASES = {"mlp": 2, "explicit": 0, "rng": 1, "poly": 1}
SHARD_MAP = "shard_map"


def _inputs() -> tuple[dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(0)
    w = {
        "w1": rng.standard_normal((6, 16), dtype=np.float32),
        "w2": rng.standard_normal((16, 3), dtype=np.float32),
    }
    return w, rng.standard_normal((8, 6), dtype=np.float32)


def _functions() -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    auto = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    explicit = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)

    def mlp(w, x):  # noqa: ANN001, ANN202
        h = jnp.tanh(x @ w["w1"])
        h = jax.lax.with_sharding_constraint(h, NamedSharding(auto, P("data", "model")))
        return h @ w["w2"]

    def rng(w, x):  # noqa: ANN001, ANN202
        noise = jax.random.normal(jax.random.key(7), x.shape, x.dtype)
        h = jnp.tanh((x + 0.1 * noise) @ w["w1"])
        keep = jax.random.bernoulli(jax.random.key(3), 0.8, h.shape)
        return (jnp.where(keep, h, 0.0) @ w["w2"]).sum(axis=1)

    def plain(w, x):  # noqa: ANN001, ANN202 - explicit axes: no contraction over a sharded dim
        return jnp.tanh(x @ w["w1"]).sum(axis=1) * w["w2"].sum()

    def shardings(mesh: Any) -> tuple[Any, Any]:
        ws = {"w1": NamedSharding(mesh, P(None, "model")), "w2": NamedSharding(mesh, P("model"))}
        return ws, NamedSharding(mesh, P("data", None))

    return {
        "mlp": (mlp, shardings(auto)),
        "explicit": (plain, shardings(explicit)),
        "rng": (rng, shardings(auto)),
        "poly": (mlp, shardings(auto)),
        SHARD_MAP: (None, auto),
    }


def _shard_map_input() -> np.ndarray:
    return np.arange(64, dtype=np.float32).reshape(8, 8) / 7


def _shard_map_fn(mesh: Any) -> Any:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    try:
        from jax import shard_map
    except ImportError:  # jax < 0.7
        from jax.experimental.shard_map import shard_map

    def body(a):  # noqa: ANN001, ANN202
        return jax.lax.psum(a, "model") * jax.lax.axis_index("data")

    def f(x):  # noqa: ANN001, ANN202
        return shard_map(body, mesh=mesh, in_specs=P("data", "model"), out_specs=P("data", None))(x)

    ins = NamedSharding(mesh, P("data", "model"))
    return jax.jit(f, in_shardings=ins, out_shardings=NamedSharding(mesh, P("data", None)))


def _grads(call: Any, w: Any, x: Any) -> tuple[Any, Any]:
    import jax

    def loss(w: Any) -> Any:
        return call(w, x).sum()

    g1 = jax.grad(loss)(w)
    g2 = jax.grad(lambda w: sum(v.sum() for v in jax.tree.leaves(jax.grad(loss)(w))))(w)
    return g1, g2


def export_all(out: str) -> dict[str, Any]:
    """Export, save and run every case on this process's 8 devices (see the module doc)."""
    import jax
    import mlflow
    from jax import export

    import jaxexp_mlflow  # noqa: F401  (installs mlflow.jaxexp)

    root = Path(out)
    w, x = _inputs()
    ref: dict[str, np.ndarray] = {}
    axis_types = {}
    for name, (fn, (ws, xs)) in ((k, v) for k, v in _functions().items() if k != SHARD_MAP):
        with _mesh_context(xs.mesh):
            ref.update(_export_case(root, name, fn, ws, xs, w, x))
        axis_types[name] = str(getattr(xs.mesh, "axis_types", ""))
    mesh = _functions()[SHARD_MAP][1]
    xsm = _shard_map_input()
    sm = export.export(_shard_map_fn(mesh))(xsm)
    (root / f"{SHARD_MAP}.bin").write_bytes(bytes(sm.serialize()))
    np.savez(root / f"{SHARD_MAP}_in.npz", in_0=xsm)
    # and as a model with its 8-device run stored as the reference (verify --route ...)
    mlflow.jaxexp.save_model(bytes(sm.serialize()), root / SHARD_MAP, input_example=(xsm,))
    placed = jax.device_put(xsm, sm.in_shardings_jax(mesh)[0])
    ref[f"{SHARD_MAP}/out"] = np.asarray(jax.jit(sm.call)(placed))
    np.savez(root / "reference.npz", **ref)
    return {"axis_types": axis_types}


def _mesh_context(mesh: Any) -> Any:
    """``jax.set_mesh`` (explicit axes need the mesh in context), or ``use_mesh`` before it."""
    import jax

    setter = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh
    return setter(mesh)


def _export_case(root: Path, name: str, fn: Any, ws: Any, xs: Any, w: Any, x: Any) -> dict:
    import jax
    import mlflow
    from jax import export

    ref = {}
    if True:
        jitted = jax.jit(fn, in_shardings=(ws, xs))
        if name == "poly":
            (b,) = export.symbolic_shape("b")
            spec = (w, jax.ShapeDtypeStruct((2 * b, 6), np.float32))
            exp = export.export(jitted)(*spec)
        else:
            exp = export.export(jitted)(w, x)
        blob = exp.serialize(vjp_order=CASES[name])
        # mlp carries its 8-device run as the stored reference (what a refresh is proved on)
        example = {"input_example": (w, x)} if name == "mlp" else {}
        mlflow.jaxexp.save_model(bytes(blob), root / name, **example)
        wp, xp = jax.device_put(w, ws), jax.device_put(x, xs)  # the calls span the 8 devices
        ref[f"{name}/out"] = np.asarray(jax.jit(exp.call)(wp, xp))
        if not CASES[name]:
            return ref
        two = CASES[name] >= 2
        g1, g2 = _grads(exp.call, wp, xp) if two else (_grads1(exp.call, wp, xp), None)
        for k in ("w1", "w2"):
            ref[f"{name}/g1/{k}"] = np.asarray(g1[k])
            if CASES[name] >= 2:
                ref[f"{name}/g2/{k}"] = np.asarray(g2[k])
    return ref


def run_all(out: str, devices: int) -> dict[str, Any]:
    """Each case loaded with ``route="remesh", devices=devices`` here; max abs differences."""
    import jax
    import mlflow

    import jaxexp_mlflow  # noqa: F401

    root = Path(out)
    w, x = _inputs()
    ref = np.load(root / "reference.npz")
    diffs: dict[str, float] = {}
    changes = {}
    for name, order in CASES.items():
        model = mlflow.jaxexp.load_model(str(root / name), route="remesh", devices=devices)
        changes[name] = [model.remeshed, model.placement.n_devices]

        def call(w: Any, x: Any, model: Any = model) -> Any:
            return model(w, x)

        diffs[f"{name}/out"] = _diff(call(w, x), ref[f"{name}/out"])
        if not order:
            continue
        g1, g2 = _grads(call, w, x) if order >= 2 else (_grads1(call, w, x), None)
        for k in ("w1", "w2"):
            diffs[f"{name}/g1/{k}"] = _diff(g1[k], ref[f"{name}/g1/{k}"])
            if g2 is not None:
                diffs[f"{name}/g2/{k}"] = _diff(g2[k], ref[f"{name}/g2/{k}"])
    return {"diffs": diffs, "changes": changes, "n": len(jax.devices())}


def corpus_by_remesh(devices: int, tmp: str) -> dict[str, list]:
    """Each readable ``sharded4`` corpus blob run by ``jaxexp predict --route remesh`` on
    ``devices``: ``[max abs difference from the 4-device outputs, what it printed]`` or
    ``[None, the refusal]``."""
    from click.testing import CliRunner

    from jaxexp_mlflow.cli import main
    from tests.conftest import CORPUS, corpus_refusals

    found: dict[str, list] = {}
    for case in sorted(CORPUS.glob("jax-*/sharded4")):
        if corpus_refusals(case):
            continue
        out = Path(tmp, f"{case.parent.name}.npy")
        args = ["predict", str(case / "exported.bin"), "--input", str(case / "inputs.npz")]
        args += ["--route", "remesh", "--devices", str(devices), "--output", str(out)]
        result = CliRunner().invoke(main, args)
        if result.exit_code:
            found[case.parent.name] = [None, " ".join(result.output.split())]
            continue
        want = np.load(case / "outputs.npz")["out_0"]
        found[case.parent.name] = [float(np.abs(np.load(out) - want).max()), result.output]
    return found


def _grads1(call: Any, w: Any, x: Any) -> Any:
    import jax

    return jax.grad(lambda w: call(w, x).sum())(w)


def _diff(a: Any, b: Any) -> float:
    """The largest difference, relative to the reference's scale where that exceeds 1."""
    b = np.asarray(b, np.float64)
    scale = max(1.0, float(np.abs(b).max()))
    return float(np.abs(np.asarray(a, np.float64) - b).max()) / scale


if __name__ == "__main__":
    import sys

    fn = export_all if sys.argv[1] == "export" else run_all
    args = [sys.argv[2]] + [int(a) for a in sys.argv[3:]]
    print("RESULT " + json.dumps(fn(*args)))
