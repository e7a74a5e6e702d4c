"""Which stored input schema keeps every MLflow door of a jaxexp model working.

Saves the tests' one-input MLP (``x: float32[-1,8]``) and two-input model (``ids: int32[-1]``,
``x: float32[-1,8]`` -> ``{"logits", "score"}``), then, for each candidate input schema written
into a copy's MLmodel with MLflow's public ``Model.load`` / ``Model.save``, prints what in-process
``pyfunc.predict`` and MLflow's scoring server (its per-request ``invocations`` and its error
mapping, the code ``mlflow models serve`` runs) do with the tests' bodies and bad requests, and
the in-process predict time. Re-run it when MLflow changes:

    PYTHONPATH=$PWD python scripts/signature_matrix.py /tmp/matrix [none tensor ...]

Candidates: ``none`` (what jaxexp stores: no input schema), ``tensor`` (named tensor specs, the
wire dtypes), ``tensor64`` (the same widened to int64/float64, the dtypes JSON parses to),
``cols`` / ``cols64`` (scalar columns for ``[-1]``, ``Array`` per further axis), ``any``
(``AnyType`` columns named after the inputs).
docs/serving/pyfunc-rest.md, "Why the MLflow signature declares no inputs", has the results.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import mlflow
import numpy as np
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.models import Model, ModelSignature
from mlflow.pyfunc import scoring_server
from mlflow.types.schema import AnyType, Array, ColSpec, DataType, Schema, TensorSpec

import jaxexp_mlflow  # noqa: F401
from jaxexp_mlflow.serving.signature import specs_from_conf
from tests.models import batch, export_mlp, mlp_params
from tests.serving.test_mlflow_serve import MARK, _bad_two, one_input_bodies, two_input_bodies
from tests.serving.test_pyfunc import two_input_example, two_input_fn

KINDS = ["none", "tensor", "tensor64", "cols", "cols64", "any"]
COLUMN = {"float32": DataType.float, "int32": DataType.integer}
COLUMN64 = {"float32": DataType.double, "int32": DataType.long}
WIDE = {"float32": np.float64, "int32": np.int64}


def candidate(kind: str, specs: list) -> Schema:
    """The input schema of candidate ``kind`` for the model's input leaf specs."""
    out: list[Any] = []
    for s in specs:
        shape = tuple(-1 if d is None else d for d in s.shape)
        dt = str(s.wire_dtype)
        if kind == "tensor":
            out.append(TensorSpec(s.wire_dtype, shape, s.name))
        elif kind == "tensor64":
            out.append(TensorSpec(np.dtype(WIDE.get(dt, dt)), shape, s.name))
        elif kind in ("cols", "cols64"):
            col: Any = (COLUMN if kind == "cols" else COLUMN64)[dt]
            for _ in shape[1:]:
                col = Array(col)
            out.append(ColSpec(col, s.name))
        else:
            out.append(ColSpec(AnyType(), s.name))
    return Schema(out)


def with_inputs(src: Path, dst: Path, kind: str) -> mlflow.pyfunc.PyFuncModel:
    """A copy of ``src`` whose signature declares the candidate inputs, loaded."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    if kind != "none":
        meta = Model.load(str(dst / "MLmodel"))
        inputs = candidate(kind, specs_from_conf(meta.flavors["jaxexp"])[0])
        meta.signature = ModelSignature(inputs=inputs, outputs=meta.signature.outputs)
        meta.save(str(dst / "MLmodel"))
    return mlflow.pyfunc.load_model(str(dst))


def answer(model: Any, content_type: str, body: bytes) -> tuple[int, str]:
    """Status and body ``mlflow models serve`` gives (500: an exception MLflow does not map)."""
    try:
        done = scoring_server.invocations(
            body, content_type, model, model.metadata.get_input_schema()
        )
        return done.status, done.response
    except MlflowException as e:
        return e.get_http_status_code(), e.serialize_as_json()
    except Exception as e:
        return 500, f"{type(e).__name__}: {str(e)[:200]}"


def close(got: Any, want: Any) -> bool:
    """Predictions equal within float32 rounding."""
    try:
        if isinstance(want, dict):
            return all(
                np.allclose(np.asarray(got[k], np.float32), want[k], atol=1e-5) for k in want
            )
        return bool(np.allclose(np.asarray(got, np.float32), want, atol=1e-5))
    except Exception:
        return False


def in_process(model: Any, data: Any, want: Any) -> str:
    """``ok``, ``WRONG`` or the first line of the refusal."""
    try:
        return "ok" if close(model.predict(data), want) else "WRONG"
    except Exception as e:
        return "refused: " + str(getattr(e, "message", e)).splitlines()[0][:90]


def main(tmp: Path, kinds: list[str]) -> None:
    """Print the matrix for ``kinds`` (models saved under ``tmp``)."""
    params = mlp_params()
    one, two = tmp / "one", tmp / "two"
    if not one.exists():
        mlflow.jaxexp.save_model(export_mlp(params), one, params=params, input_example=batch(2))
        mlflow.jaxexp.save_model(
            jax.jit(two_input_fn), two, params=params, input_example=two_input_example()
        )
    x, inp = batch(6, seed=3), two_input_example(6)
    want1 = np.asarray(mlflow.pyfunc.load_model(str(one)).predict(x))
    want2 = mlflow.pyfunc.load_model(str(two)).predict(inp)
    features = pd.DataFrame(x.astype(np.float64), columns=[f"f{i}" for i in range(8)])
    calls1 = {
        "ndarray f32": x,
        "ndarray f64": x.astype(np.float64),
        "list": x.tolist(),
        "dict": {"x": x},
        "feature DF": features,
        "list-cell DF": pd.DataFrame({"x": list(x)}),
    }
    calls2 = {
        "dict": inp,
        "dict ids int64": {"x": inp["x"], "ids": inp["ids"].astype(np.int64)},
        "list [ids, x]": [inp["ids"], inp["x"]],
        "DF": pd.DataFrame({"ids": inp["ids"], "x": list(inp["x"])}),
    }
    for kind in kinds:
        m = {n: with_inputs(p, tmp / f"{kind}-{n}", kind) for n, p in (("one", one), ("two", two))}
        print(f"\n=== {kind}: {m['two'].metadata.get_input_schema()}")
        for k, v in calls1.items():
            print(f"  in-process one {k:16s} {in_process(m['one'], v, want1)}")
        for k, v in calls2.items():
            print(f"  in-process two {k:16s} {in_process(m['two'], v, want2)}")
        for name, bodies, want in (
            ("one", one_input_bodies(x), want1),
            ("two", two_input_bodies(inp), want2),
        ):
            for fmt, (ctype, body) in bodies.items():
                status, text = answer(m[name], ctype, body)
                verdict = close(json.loads(text)["predictions"], want) if status == 200 else None
                shown = {True: "ok", False: "WRONG", None: text[:120]}[verdict]
                print(f"  serve {name} {fmt:30s} {status} {shown}")
        for case, (ctype, body, must) in sorted(_bad_two().items()):
            status, text = answer(m["two"], ctype, body)
            echo = str(MARK) in text or "9" * 20 in text
            good = 400 <= status < 500 and len(text) < 2048 and not echo and must in text
            print(
                f"  bad {case:32s} {status} {len(text):6d} B echo={echo} "
                f"{'ok' if good else 'FAILS: ' + text[:100]}"
            )
        xb = {"x": batch(8)}
        try:
            m["one"].predict(xb)
        except MlflowException:
            print("  predict({'x': 8x8}) refused")
            continue
        times = []
        for _ in range(300):
            t = time.perf_counter()
            m["one"].predict(xb)
            times.append(time.perf_counter() - t)
        print(f"  predict({{'x': 8x8}}) median {np.median(times) * 1e6:.0f} us")


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    main(Path(sys.argv[1]), sys.argv[2:] or KINDS)
