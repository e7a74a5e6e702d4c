"""``mlflow.jaxexp.load_model`` takes its options by name: the user's, none of the loader's."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import jaxexp_mlflow  # noqa: F401 - installs mlflow.jaxexp
from jaxexp_mlflow.errors import UnsupportedModelError
from jaxexp_mlflow.flavors import jaxexp as flavor
from tests.models import batch, mlp_apply, mlp_params

USER_OPTIONS = {
    "dst_path",
    "allow_incompatible",
    "backend",
    "route",
    "isolate",
    "allow_other_platform",
    "data_parallel",
    "devices",
    "iree_cache",
    "iree_driver",
}


def test_every_option_is_a_named_documented_parameter():
    sig = inspect.signature(flavor.load_model)
    kinds = {p.kind for p in sig.parameters.values()}
    assert inspect.Parameter.VAR_KEYWORD not in kinds
    assert set(sig.parameters) - {"model_uri"} == USER_OPTIONS
    doc = inspect.getdoc(flavor.load_model)
    for section in ("Args:", "Returns:", "Raises:"):
        assert section in doc
    for name in USER_OPTIONS | {"model_uri"}:
        assert f"    {name}: " in doc, name
    for fn in (flavor.save_model, flavor.log_model):
        fdoc = inspect.getdoc(fn)
        assert "Args:" in fdoc and "Raises:" in fdoc
        for name, p in inspect.signature(fn).parameters.items():
            if p.kind is not inspect.Parameter.VAR_KEYWORD:
                assert f"    {name}: " in fdoc, (fn.__name__, name)


@pytest.mark.parametrize("internal", ["bind", "mapped", "model_files"])
def test_the_loaders_internal_options_are_not_reachable(saved_mlp, internal):
    with pytest.raises(TypeError, match=internal):
        flavor.load_model(str(saved_mlp), **{internal: None})


def test_an_option_of_the_other_backend_is_refused_by_name(saved_mlp):
    with pytest.raises(UnsupportedModelError, match=r"\['iree_driver'\].*backend='iree'"):
        flavor.load_model(str(saved_mlp), iree_driver="local-sync")
    with pytest.raises(UnsupportedModelError, match=r"\['data_parallel', 'isolate'\]"):
        flavor.load_model(str(saved_mlp), backend="iree", isolate=True, data_parallel=True)


def test_named_options_still_reach_the_loader(saved_mlp):
    params, x = mlp_params(), batch()
    model = flavor.load_model(str(saved_mlp), isolate=True, data_parallel=True, route="direct")
    assert model.route == "direct"
    np.testing.assert_allclose(np.asarray(model(x)), np.asarray(mlp_apply(params, x)), rtol=1e-5)
