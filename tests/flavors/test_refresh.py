"""Refresh: re-export archived models with the running JAX.

Shown on every reproducible case of the shared corpus (jax 0.4.35 to 0.10.2); the sharded ones
in a subprocess with 4 devices. ``linalg`` from jax 0.4.35 calls LAPACK kernels jaxlib 0.10.2 no
longer has: refresh must refuse it, and log nothing.

jax >= 0.11.1 reads the blobs of jax 0.4.35 and 0.6.2 (serialization schema < 5) only with its
flag ``jax_export_deserialize_expired_versions``: their refresh is shown with the flag set (the
``expired_flag`` fixture), and without it the refresh must be refused naming the flag. Blobs with
old-style HLO shardings (``sharded4`` up to jax 0.8.3) it refuses whatever the flag: their refresh
must be refused with the advice of an older jax (``jaxexp verify --env-manager uv``).
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import jax
import mlflow
import numpy as np
import pytest

import jaxexp_mlflow
from jaxexp_mlflow.flavors.refresh import RefreshError
from jaxexp_mlflow.runtime import compat
from tests.conftest import (
    CORPUS,
    case_id,
    corpus_cases,
    corpus_refusals,
    load_case,
    reseal_reference,
    run_on_device_child,
    sqlite_uri,
)
from tests.models import batch, export_mlp, mlp_apply, mlp_params

REPO = Path(__file__).resolve().parents[2]
NOT_REPRODUCIBLE = {("jax-0.4.35", "linalg")}
CASES = [
    c
    for c in corpus_cases()
    if c.name != "sharded4" and (c.parent.name, c.name) not in NOT_REPRODUCIBLE
]


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory):
    """One sqlite MLflow store for the corpus cases (creating one costs seconds)."""
    tmp = tmp_path_factory.mktemp("store")
    uri = sqlite_uri(tmp / "mlflow.db")
    old = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = uri
    mlflow.set_tracking_uri(uri)
    exp_id = mlflow.create_experiment("refresh", artifact_location=(tmp / "art").as_uri())
    mlflow.set_experiment(experiment_id=exp_id)
    yield uri
    mlflow.end_run()
    mlflow.set_tracking_uri(None)
    if old is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = old


def _log_corpus_case(case: Path, *, reference: bool = True) -> tuple:
    meta, inputs, outputs = load_case(case)
    data = (case / "exported.bin").read_bytes()
    in_tree = jax.export.deserialize(bytearray(data)).in_tree
    args, _ = jax.tree.unflatten(in_tree, inputs)
    with mlflow.start_run():
        info = mlflow.jaxexp.log_model(
            data, name="source", input_example=tuple(args) if reference else None
        )
    return info, meta, args, outputs


def _close(got, want) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = 2e-2 if want.dtype.itemsize <= 2 else 1e-5
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)


def _n_logged() -> int:
    return len(mlflow.search_logged_models(output_format="list"))


def _assert_refused_without_the_flag(model_uri: str, without_expired_flag) -> None:
    """jax >= 0.11.1 without its expired-versions flag: the refresh is refused before JAX reads
    the blob, naming the flag, and logs nothing."""
    before = _n_logged()
    with without_expired_flag(), pytest.raises(RefreshError) as err:
        jaxexp_mlflow.refresh(model_uri, name="refreshed")
    msg = str(err.value)
    assert "Cannot refresh" in msg and "[expired]" in msg, msg
    assert f"{compat.EXPIRED_ENV}=1" in msg and compat.EXPIRED_FLAG in msg
    assert "run the refresh again" in msg
    assert _n_logged() == before


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_refresh_corpus_case(case, shared_store, expired_flag, without_expired_flag):
    # every case here is read by this jax, with its expired-versions flag where it has one
    assert corpus_refusals(case, expired_flag=expired_flag) == set()
    info, meta, args, outputs = _log_corpus_case(case)
    if "expired" in corpus_refusals(case):  # jax >= 0.11.1, a blob of jax <= 0.7
        _assert_refused_without_the_flag(info.model_uri, without_expired_flag)
    new = jaxexp_mlflow.refresh(info.model_uri, name="refreshed")
    assert new.model_uri != info.model_uri

    with without_expired_flag():  # the refreshed model is current: it loads without the flag
        model = mlflow.jaxexp.load_model(new.model_uri)
    conf = model.metadata
    # written by the running JAX, with what the source had kept
    assert conf["jax_version"] == jax.__version__ and conf["jaxlib_version"]
    assert (
        conf["calling_convention_version"]
        == jax.export.maximum_supported_calling_convention_version
    )
    assert conf["platforms"] == meta["platforms"]
    assert conf["nr_devices"] == meta["nr_devices"]
    assert conf["vjp_order"] == meta["vjp_order"]
    assert conf["fun_name"] == meta["fun_name"]
    assert [a.split("[")[1] for a in conf["in_avals"]] == [
        a.split("[")[1].rstrip(")") for a in meta["in_avals"]
    ]  # shapes incl. symbolic dims
    assert model.verdict.status == "ok"
    for g, w in zip(jax.tree.leaves(model(*args)), outputs, strict=True):
        _close(g, w)

    tags = mlflow.get_logged_model(new.model_id).tags
    assert tags["jaxexp.refresh.source_uri"] == info.model_uri
    assert tags["jaxexp.refresh.source_model_id"] == info.model_id
    assert tags["jaxexp.refresh.jax_version"] == jax.__version__
    assert tags["jaxexp.refresh.source_jax_version"] == "unknown (bare blob)"

    if case.name == "vjp2":  # the vjp chain survives: second-order grads still match
        with np.load(case / "grads.npz") as g:
            grad1, grad2 = g["grad1"], g["grad2"]
        x = args[0]
        f = lambda x: model(x).sum()  # noqa: E731
        np.testing.assert_allclose(jax.grad(f)(x), grad1, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            jax.grad(lambda x: jax.grad(f)(x).sum())(x), grad2, rtol=1e-4, atol=1e-4
        )


def test_refresh_live_model_with_params_and_registration(tracking_uri):
    params, x = mlp_params(), batch(4)
    with mlflow.start_run():
        src = mlflow.jaxexp.log_model(
            export_mlp(params), name="m", params=params, input_example=x, vjp_order=1
        )
    new = jaxexp_mlflow.refresh(src.model_uri, registered_model_name="mlp")
    assert new.registered_model_version == 1
    mv = mlflow.MlflowClient().get_model_version("mlp", "1")
    assert mv.tags["jaxexp.refresh.source_uri"] == src.model_uri
    assert mv.tags["jaxexp.refresh.source_jax_version"] == jax.__version__
    model = mlflow.jaxexp.load_model("models:/mlp/1")
    assert model.has_params and model.metadata["vjp_order"] == 1
    np.testing.assert_allclose(model(batch(7)), mlp_apply(params, batch(7)), rtol=1e-5)
    # the params checkpoint was carried over, not re-derived
    assert model.metadata["params"] == "params"


def test_linalg_from_0_4_35_is_refused_clearly(tracking_uri, expired_flag, without_expired_flag):
    case = CORPUS / "jax-0.4.35" / "linalg"
    if not case.is_dir():
        pytest.skip("corpus not available")
    # its reference cannot even be computed here (the kernels are gone): log it without one
    info, *_ = _log_corpus_case(case, reference=False)
    before = _n_logged()
    # read with the flag where jax needs it: still refused, its kernels are gone
    with pytest.raises(RefreshError) as err:
        jaxexp_mlflow.refresh(info.model_uri)
    msg = str(err.value)
    assert "blas_strsm" in msg and "Cannot refresh" in msg
    assert "export the function again from its Python source" in msg
    assert "[expired]" not in msg  # the flag is set (or not needed): not a reason
    assert _n_logged() == before  # nothing logged
    if "expired" in corpus_refusals(case):  # jax >= 0.11.1 without the flag: both reasons
        with without_expired_flag(), pytest.raises(RefreshError) as err:
            jaxexp_mlflow.refresh(info.model_uri)
        msg = str(err.value)
        assert "[expired]" in msg and f"{compat.EXPIRED_ENV}=1" in msg and "blas_strsm" in msg
        assert _n_logged() == before


def test_refresh_refuses_when_the_reference_is_not_reproduced(tmp_path, tracking_uri):
    params, x = mlp_params(), batch(4)
    path = tmp_path / "m"
    mlflow.jaxexp.save_model(export_mlp(params), path, params=params, input_example=x)
    ref = path / "reference" / "outputs.npz"
    with np.load(ref) as d:
        out = {k: d[k] for k in d.files}
    out["out_0"] = out["out_0"] + 1.0  # a reference the function does not compute
    np.savez(ref, **out)
    reseal_reference(path)
    with pytest.raises(RefreshError, match=r"(?s)does not reproduce.*out_0.*Nothing was logged"):
        jaxexp_mlflow.refresh(str(path))
    assert mlflow.search_logged_models(output_format="list") == []
    # a synthetic reference (saved without input example) that the blob does not reproduce
    bare = tmp_path / "bare"
    mlflow.jaxexp.save_model(export_mlp(params), bare, params=params)
    ref = bare / "reference" / "outputs.npz"
    with np.load(ref) as d:
        out = {k: d[k] * 2.0 for k in d.files}
    np.savez(ref, **out)
    reseal_reference(bare)
    with pytest.raises(RefreshError, match=r"(?s)does not reproduce.*out_0"):
        jaxexp_mlflow.refresh(str(bare))


SHARDED_WORKER = textwrap.dedent(
    """
    import json, shutil, sys, tempfile
    from pathlib import Path
    import numpy as np, jax, mlflow
    import jaxexp_mlflow
    from jaxexp_mlflow.flavors.refresh import RefreshError
    from tests.conftest import CORPUS, as_logged_by_older_jax, corpus_refusals, load_case

    flag = "jax_export_deserialize_expired_versions"
    if hasattr(jax.config, flag):  # jax >= 0.11.1 reads schema < 5 blobs only with it
        jax.config.update(flag, True)
    tmp = tempfile.mkdtemp()
    mlflow.set_tracking_uri(f"sqlite:///{tmp}/mlflow.db")
    exp_id = mlflow.create_experiment("t", artifact_location=f"file://{tmp}/artifacts")
    mlflow.set_experiment(experiment_id=exp_id)
    res = {}
    for version in sys.argv[1:]:
        case = CORPUS / f"jax-{version}" / "sharded4"
        _, ins, outs = load_case(case)
        if corpus_refusals(case, expired_flag=True):  # this jax cannot read it at all
            # as a jax that still read it saved it: the same function's model, with this blob
            src = Path(tmp) / f"old-{version}"
            newest = CORPUS / "jax-0.10.2" / "sharded4" / "exported.bin"
            mlflow.jaxexp.save_model(newest.read_bytes(), src, input_example=tuple(ins))
            as_logged_by_older_jax(src, case / "exported.bin")
            before = len(mlflow.search_logged_models(output_format="list"))
            try:
                jaxexp_mlflow.refresh(str(src))
                res[version] = {"refused": False}
            except RefreshError as err:
                after = len(mlflow.search_logged_models(output_format="list"))
                res[version] = {"refused": True, "message": str(err), "logged": after - before}
            shutil.rmtree(src)
            continue
        with mlflow.start_run():
            src = mlflow.jaxexp.log_model((case / "exported.bin").read_bytes(), name="s",
                                          input_example=tuple(ins))
        new = jaxexp_mlflow.refresh(src.model_uri)
        model = mlflow.jaxexp.load_model(new.model_uri)
        data = (mlflow.artifacts.download_artifacts(new.model_uri) + "/exported.bin")
        exp = jax.export.deserialize(bytearray(open(data, "rb").read()))
        y = model(*ins)
        res[version] = {
            "refused": False,
            "match": bool(np.allclose(np.asarray(y), outs[0], rtol=1e-5, atol=1e-6)),
            "nr_devices": exp.nr_devices,
            "named": [None if s is None else list(s.spec) for s in exp._in_named_shardings],
            "out_named": [list(s.spec) for s in exp._out_named_shardings],
            "jax_version": model.metadata["jax_version"],
            "source_uri": mlflow.get_logged_model(new.model_id).tags["jaxexp.refresh.source_uri"]
            == src.model_uri,
        }
    print("RESULT " + json.dumps(res))
    """
)


def test_refresh_sharded_corpus_cases_on_4_devices():
    cases = [c for c in corpus_cases() if c.name == "sharded4"]
    if not cases:
        pytest.skip("corpus not available")
    versions = sorted(c.parent.name.removeprefix("jax-") for c in cases)
    res = run_on_device_child(SHARDED_WORKER, 4, *versions)
    for case in cases:
        v = case.parent.name.removeprefix("jax-")
        r = res[v]
        if "hlo_sharding" in corpus_refusals(case, expired_flag=True):
            # jax >= 0.11.1 reads no old-style (HLO) sharding, flag or not: refused before
            # reading, with where it can be refreshed (an older jax, the recorded environment)
            assert r["refused"] and r["logged"] == 0, (v, r)
            msg = r["message"]
            assert "Cannot refresh" in msg and "[hlo_sharding]" in msg, msg
            assert "--env-manager uv" in msg and "==0.11.0" in msg, msg
            assert f"{compat.EXPIRED_FLAG} does not help" in msg, msg
            continue
        assert not r["refused"], (v, r)
        assert r["match"] and r["nr_devices"] == 4 and r["source_uri"], (v, r)
        assert r["jax_version"] == jax.__version__
        # blobs from jax <= 0.8 had HLO shardings only: the refresh writes NamedShardings,
        # x split over the 4 devices on its leading dimension, w replicated
        assert r["named"][0][0] is not None and not any(r["named"][1]), (v, r)
        assert r["out_named"][0][0] is not None
