"""The MLmodel YAML reader (codec/mlmodel.py): libyaml's parse against PyYAML's pure-Python
loader, on MLmodel files MLflow wrote and on generated documents, and the same budgets and typed
errors on both paths."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxexp_mlflow.codec import mlmodel
from jaxexp_mlflow.errors import ArtifactError

DATA = Path(__file__).parents[1] / "data" / "models"

pytestmark = pytest.mark.skipif(
    not getattr(yaml, "__with_libyaml__", False), reason="PyYAML without libyaml"
)


@pytest.fixture(params=["libyaml", "python"])
def path(request, monkeypatch):
    """Each test runs on both parse paths of ``load_yaml``."""
    if request.param == "python":
        monkeypatch.setattr(yaml, "__with_libyaml__", False)
    return request.param


def pure(text: bytes | str):
    return yaml.load(text, Loader=yaml.SafeLoader)  # noqa: S506


@pytest.fixture(scope="module")
def written_by_mlflow(tmp_path_factory) -> list[bytes]:
    """MLmodel files MLflow wrote: the archived jaxexp models, and a pyfunc PythonModel with a
    signature and an input example saved here by the installed MLflow."""
    import mlflow

    class Echo(mlflow.pyfunc.PythonModel):
        def predict(self, context, model_input, params=None):
            return model_input

    out = tmp_path_factory.mktemp("pyfunc") / "m"
    x = np.ones((2, 3), np.float32)
    # requirements given: MLflow infers none (a child that loads the model, seconds)
    mlflow.pyfunc.save_model(out, python_model=Echo(), input_example=x, pip_requirements=["mlflow"])
    found = sorted(DATA.glob("*/MLmodel")) + [out / "MLmodel"]
    assert len(found) >= 3
    return [p.read_bytes() for p in found]


def test_mlmodel_files_parse_the_same_on_both_paths(written_by_mlflow, path):
    for raw in written_by_mlflow:
        assert mlmodel.load_yaml(raw) == pure(raw)


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=20),
)
documents = st.recursive(
    scalars,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=30,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=documents, flow=st.booleans())
def test_generated_documents_parse_as_the_pure_loader_does(doc, flow):
    text = yaml.safe_dump(doc, default_flow_style=flow, allow_unicode=True)
    assert mlmodel.load_yaml(text) == pure(text)  # (PyYAML does not round-trip every string)


def nested(depth: int, flow: bool) -> str:
    if flow:
        return "[" * depth + "x" + "]" * depth
    return "- " * depth + "x\n"


@pytest.mark.parametrize("flow", [True, False])
def test_nesting_budget_is_the_same_on_both_paths(path, flow):
    # the pure loader counts every node, the scalar included: depth 63 + the scalar fits
    assert mlmodel.load_yaml(nested(mlmodel.MAX_DEPTH - 1, flow)) == pure(
        nested(mlmodel.MAX_DEPTH - 1, flow)
    )
    with pytest.raises(ArtifactError, match="reading budget .nesting deeper than 64"):
        mlmodel.load_yaml(nested(mlmodel.MAX_DEPTH, flow))


@pytest.mark.parametrize("flow", [True, False])
def test_very_deep_nesting_is_a_typed_error_not_a_crash(path, flow):
    with pytest.raises(ArtifactError, match="reading budget|not valid YAML"):
        mlmodel.load_yaml(nested(200_000, flow))


def test_alias_budget_is_the_same_on_both_paths(path):
    ok = "a: &a 1\nb: [" + ", ".join(["*a"] * mlmodel.MAX_ALIASES) + "]\n"
    assert mlmodel.load_yaml(ok)["b"] == [1] * mlmodel.MAX_ALIASES
    with pytest.raises(ArtifactError, match="more than 100 YAML aliases"):
        mlmodel.load_yaml(ok.replace("]", ", *a]"))


def test_alias_bomb_is_refused_on_both_paths(path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    with pytest.raises(ArtifactError, match="more than 200000 values"):
        mlmodel.load_yaml("\n".join(lines[:7]) + "\n")
    with pytest.raises(ArtifactError, match="reading budget"):
        mlmodel.load_yaml("\n".join(lines) + "\n")


@pytest.mark.parametrize(
    "text",
    [b"\xff\xfe\x00", b"a: [1, 2", b"a: !!python/object:os.system x", b"\ta: 1", b"a: *nope"],
)
def test_malformed_yaml_is_a_typed_error(path, text):
    with pytest.raises(ArtifactError, match="not valid YAML"):
        mlmodel.load_yaml(text)
