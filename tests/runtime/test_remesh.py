"""The remesh and virtual-devices routes: a model exported for more devices than are visible.

Models are exported on 8 simulated CPU devices (mesh ``('data', 'model') = (2, 4)``) in a
child (``tests/remesh_cases.py``); the route runs them on 1 (this process), 2 and 4 devices (a
child each: the session's child of that device count, ``tests.conftest.device_child``) and every
output and gradient is compared with the 8-device run. Stated tolerance:
``remesh.RTOL`` (1e-5) of the reference's scale for outputs and first-order gradients (sums over
a resized axis in another order), 1e-4 for second-order gradients.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import mlflow
import numpy as np
import pytest
from click.testing import CliRunner

import jaxexp_mlflow  # noqa: F401  (installs mlflow.jaxexp)
from jaxexp_mlflow.cli import main
from jaxexp_mlflow.errors import IncompatibleError
from jaxexp_mlflow.runtime import remesh
from tests import remesh_cases
from tests.conftest import CORPUS, run_on_device_child
from tests.remesh_cases import corpus_by_remesh

pytestmark = pytest.mark.skipif(len(jax.devices()) != 1, reason="runs the 1-device case here")

#: the children keep any tracking store MLflow opens in their own temporary directory
EXPORT = """
import json, sys
import mlflow
mlflow.set_tracking_uri(f"sqlite:///{sys.argv[1]}/mlflow.db")
from tests.remesh_cases import export_all
print("RESULT " + json.dumps(export_all(sys.argv[1])))
"""
#: on M devices: every case by the remesh route, and the corpus's sharded4 blobs by the CLI
RUN = """
import json, sys
import mlflow
mlflow.set_tracking_uri(f"sqlite:///{sys.argv[1]}/mlflow.db")
from tests.remesh_cases import run_all
from tests.remesh_cases import corpus_by_remesh
res = run_all(sys.argv[1], int(sys.argv[2]))
res["corpus"] = corpus_by_remesh(int(sys.argv[2]), sys.argv[1])
print("RESULT " + json.dumps(res))
"""
SECOND_ORDER = 1e-4


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch, tracking_uri):
    """Each test runs in its own directory with its own MLflow store: nothing it opens or logs
    lands in the source tree."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def exported8(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("remesh8")
    res = run_on_device_child(EXPORT, 8, str(out))
    assert "Explicit" in res["axis_types"]["explicit"]
    return out


def _check_run(res: dict, devices: int) -> None:
    assert res["n"] == devices
    sizes = {1: "data=1, model=1", 2: "data=2, model=1", 4: "data=2, model=2"}[devices]
    for name, (change, placed) in res["changes"].items():
        assert change == f"8 devices (data=2, model=4) -> {devices} ({sizes})", name
        assert placed == devices
    for key, diff in res["diffs"].items():
        limit = SECOND_ORDER if "/g2/" in key else remesh.RTOL
        assert diff <= limit, (key, diff)
    assert any("/g2/" in k for k in res["diffs"])  # vjp order 2 went through the route


def test_remesh_runs_the_8_device_models_on_1_2_and_4_devices(exported8):
    _check_run(remesh_cases.run_all(str(exported8), 1), 1)
    for devices in (2, 4):
        res = run_on_device_child(RUN, devices, str(exported8), str(devices))
        _check_run(res, devices)
        if devices == 2 and CORPUS.is_dir():
            for version, (diff, said) in res["corpus"].items():
                if diff is None:  # old-style shardings name devices: 1 device only
                    assert "GSPMD" in said and "virtual-devices" in said, said
                else:
                    assert diff <= remesh.ATOL and "(x=4) -> 2 (x=2)" in said, version


@pytest.mark.skipif(not CORPUS.is_dir(), reason="no shared corpus")
def test_corpus_sharded4_blobs_on_one_device(tmp_path):
    found = corpus_by_remesh(1, str(tmp_path))
    assert found, "no sharded4 blob this jax reads"
    for version, (diff, said) in found.items():
        assert diff is not None and diff <= remesh.ATOL, (version, said)
        assert "4 devices" in said and "-> 1" in said


def test_check_names_the_routes_and_without_one_the_load_is_refused(exported8):
    path = str(exported8 / "mlp")
    result = CliRunner().invoke(main, ["check", path])
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    assert "remesh" in text and "8 devices (data=2, model=4) -> 1 (data=1, model=1)" in text
    assert "virtual-devices" in text and "rtol 1e-05" in text
    routes = json.loads(CliRunner().invoke(main, ["check", "--json", path]).output)["routes"]
    assert [r["name"] for r in routes] == ["remesh", "virtual-devices"]
    with pytest.raises(IncompatibleError, match="8 devices"):
        mlflow.jaxexp.load_model(path)  # taken only when asked
    with pytest.raises(IncompatibleError, match="does not divide"):
        mlflow.jaxexp.load_model(path, route="remesh", devices=3)


def test_shard_map_is_refused_by_remesh_and_run_by_virtual_devices(exported8, tmp_path):
    blob = str(exported8 / f"{remesh_cases.SHARD_MAP}.bin")
    inputs = str(exported8 / f"{remesh_cases.SHARD_MAP}_in.npz")
    checked = json.loads(CliRunner().invoke(main, ["check", "--json", blob]).output)
    assert [r["name"] for r in checked["routes"]] == ["virtual-devices"]  # remesh not offered
    refused = CliRunner().invoke(main, ["predict", blob, "--input", inputs, "--route", "remesh"])
    assert refused.exit_code != 0
    said = " ".join(refused.output.split())
    assert "stablehlo.all_reduce" in said and "partition_id" in said and "virtual-devices" in said
    # the module itself, read by this jax: the shard_map body is named too
    exported = jax.export.deserialize(bytearray(Path(blob).read_bytes()))
    with pytest.raises(IncompatibleError, match="sdy.manual_computation"):
        remesh.remesh(exported, 1)
    out = tmp_path / "out.npy"
    args = ["predict", blob, "--input", inputs, "--route", "virtual-devices", "--output", str(out)]
    ran = CliRunner().invoke(main, args)
    assert ran.exit_code == 0, ran.output
    want = np.load(exported8 / "reference.npz")[f"{remesh_cases.SHARD_MAP}/out"]
    np.testing.assert_array_equal(np.load(out), want)  # the same blob on 8 devices: exact
    model = str(exported8 / remesh_cases.SHARD_MAP)
    args = ["verify", model, "--route", "virtual-devices", "--json"]
    verified = CliRunner().invoke(main, args)
    assert verified.exit_code == 0, verified.output
    report = json.loads(verified.output[verified.output.index("{") :])
    assert report["route"]["name"] == "virtual-devices" and report["ok"]
    assert [o["max_abs_err"] for o in report["outputs"]] == [0.0]  # the 8-device reference


def test_module_facts_name_device_ids_and_sub_axes():
    from jaxexp_mlflow.internals.jax_private import module_tools

    tools, _ = module_tools()
    text = """
    module @m attributes {mhlo.num_partitions = 4 : i32} {
      sdy.mesh @mesh = <["a"=4], device_ids=[3, 2, 1, 0]>
      func.func public @main(%arg0: tensor<8xf32> {sdy.sharding = #sdy.sharding<@mesh,
          [{"a":(1)2}]>}) -> tensor<8xf32> {
        return %arg0 : tensor<8xf32>
      }
    }"""
    with tools.make_ir_context():
        module = tools.ir.Module.parse(text)
        facts = remesh._facts(module, 4)
    assert facts.meshes == (("mesh", (("a", 4),)),)
    why = remesh.refusal(facts, 1)
    assert "explicit device ids" in why and "sub-axis" in why
    with pytest.raises(IncompatibleError, match="device ids"):
        remesh.plan_sizes(facts, 2)


def test_axis_sizes_chosen_for_a_device_count():
    axes = {"data": 2, "model": 4}
    assert remesh.choose_sizes(axes, 4) == {"data": 2, "model": 2}
    assert remesh.choose_sizes(axes, 2) == {"data": 2, "model": 1}
    assert remesh.choose_sizes(axes, 1) == {"data": 1, "model": 1}
    with pytest.raises(IncompatibleError, match="such as 1, 2, 4"):
        remesh.choose_sizes(axes, 3)


def test_remesh_is_closed_where_jax_moves_its_serializer(exported8, monkeypatch):
    from jax._src.export import _export

    monkeypatch.delattr(_export, "_module_to_bytecode")  # as a release that renames it
    exported = jax.export.deserialize(bytearray((exported8 / "mlp" / "exported.bin").read_bytes()))
    with pytest.raises(IncompatibleError, match="remesh route is closed.*_module_to_bytecode"):
        remesh.remesh(exported, 1)


def test_multi_mesh_archive_on_one_device(tmp_path):
    from tests.backcompat import multi_mesh_blob

    path = tmp_path / "m"
    mlflow.jaxexp.save_model(multi_mesh_blob(), path)
    model = mlflow.jaxexp.load_model(str(path), route="remesh")
    assert model.remeshed == "2 devices (x1=1, x2=2; y2=2, y1=1) -> 1 (x1=1, x2=1; y2=1, y1=1)"
    rng = np.random.default_rng(0)
    xs = tuple(rng.random((4, 8), dtype=np.float32) for _ in range(4))
    ws = tuple(rng.random((8, 2), dtype=np.float32) for _ in range(4))
    for out, x, w in zip(model(xs, ws), xs, ws, strict=True):
        np.testing.assert_allclose(np.asarray(out), x @ w, rtol=remesh.RTOL, atol=remesh.ATOL)


def test_refresh_by_remesh_logs_a_model_for_fewer_devices(exported8):
    args = ["refresh", str(exported8 / "mlp"), "--route", "remesh", "--devices", "1", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    info = json.loads(result.output[result.output.index("{") :])
    model = mlflow.jaxexp.load_model(info["model_uri"])  # no route: it is a 1-device model now
    assert model.exported.nr_devices == 1 and model.route == "direct"
    tags = mlflow.get_logged_model(info["model_id"]).tags
    assert tags["jaxexp.refresh.route"] == (
        "remesh: 8 devices (data=2, model=4) -> 1 (data=1, model=1)"
    )
    assert tags["jaxexp.refresh.tolerance"] == "cross-device: rtol 1e-05, atol 1e-05"
    assert float(tags["jaxexp.refresh.max_abs_err"]) <= remesh.ATOL
    ref = np.load(exported8 / "reference.npz")
    w, x = remesh_cases._inputs()
    np.testing.assert_allclose(model(w, x), ref["mlp/out"], rtol=remesh.RTOL, atol=remesh.ATOL)
    refused = CliRunner().invoke(main, ["refresh", str(exported8 / "rng"), "--route", "remesh"])
    assert refused.exit_code != 0 and "no stored reference" in " ".join(refused.output.split())


def test_log_model_of_a_blob_through_remesh_records_the_route(exported8, tmp_path):
    blob = (exported8 / "mlp" / "exported.bin").read_bytes()
    w, x = remesh_cases._inputs()
    with pytest.raises(IncompatibleError, match="8 devices"):  # no route: its reference cannot run
        mlflow.jaxexp.save_model(blob, tmp_path / "refused", input_example=(w, x))
    with mlflow.start_run():
        info = mlflow.jaxexp.log_model(blob, name="m", input_example=(w, x), route="remesh")
    assert info.flavors["jaxexp"]["route"]["name"] == "remesh"
    assert info.flavors["jaxexp"]["nr_devices"] == 8  # the blob is stored as it is
    with pytest.raises(IncompatibleError, match="8 devices"):
        mlflow.jaxexp.load_model(info.model_uri)  # taken only when asked
    model = mlflow.jaxexp.load_model(info.model_uri, route="remesh")
    want = np.load(exported8 / "reference.npz")["mlp/out"]
    np.testing.assert_allclose(model(w, x), want, rtol=remesh.RTOL, atol=remesh.ATOL)


def test_pyfunc_takes_remesh_from_model_config(exported8):
    path = str(exported8 / "mlp")
    with pytest.raises(IncompatibleError, match="8 devices"):
        mlflow.pyfunc.load_model(path)
    loaded = mlflow.pyfunc.load_model(path, model_config={"route": "remesh"})
    assert loaded.metadata.flavors["jaxexp"]["nr_devices"] == 8


def test_serve_takes_one_route(exported8):
    args = ["serve", "-m", str(exported8 / "mlp"), "--route", "remesh"]
    clash = CliRunner().invoke(main, [*args, "--model-config", '{"route": "direct"}'])
    assert clash.exit_code == 2 and "expected one route" in clash.output
