"""Logits classifiers as MLflow classifiers: pyfunc returns labels, probabilities on request.

``save_model(..., classifier=True)`` (labels are the class indices) or
``classifier=["cat", "dog", ...]`` on a model whose single output is ``float[-1, k]`` logits
(``k >= 2``, softmax) or ``float[-1, 1]`` / ``float[-1]`` (one logit, sigmoid). ``predict`` then
returns one label per row, which is what ``mlflow.models.evaluate(model_type="classifier")``,
``spark_udf`` and serving expect. Other outputs are asked for with MLflow's ``predict_method``
param (the name ``mlflow.sklearn`` uses): ``"predict_proba"`` for the ``[n, k]`` class
probabilities (columns in label order), ``"predict_logits"`` for the raw output.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxexp_mlflow.errors import InputError, UnsupportedModelError

METHODS = ("predict", "predict_proba", "predict_logits")
LABEL_OUTPUT = "label"


def check(outputs: list, classifier: Any) -> dict[str, Any] | None:
    """The ``classifier`` entry of the flavor section, or None; refuses unfit models."""
    if classifier is None or classifier is False:
        return None
    if len(outputs) != 1 or outputs[0].dtype.kind not in "fV" or len(outputs[0].shape) > 2:
        found = [o.describe() for o in outputs][:4]
        raise UnsupportedModelError(
            "classifier= needs a model with one float output of logits [-1, k] (or [-1] for "
            f"one logit); the export returns {found}. Return the logits alone, or leave "
            "classifier unset."
        )
    spec = outputs[0]
    k = spec.shape[1] if len(spec.shape) == 2 else 1
    n_classes = 2 if k == 1 else k
    labels = None
    if classifier is not True:
        labels = [v.item() if isinstance(v, np.generic) else v for v in classifier]
        if k is not None and len(labels) != n_classes:
            raise UnsupportedModelError(
                f"classifier= has {len(labels)} labels, the logits output {spec.describe()} "
                f"has {n_classes} classes. Pass one label per class, in logit order."
            )
    return {"labels": labels, "output": spec.name}


def output_schema(conf: dict[str, Any]) -> Any:
    """The MLflow output schema of a classifier: one label column (``long`` or ``string``)."""
    from mlflow.types.schema import ColSpec, Schema

    labels = conf.get("labels")
    kind = "string" if labels and any(isinstance(v, str) for v in labels) else "long"
    return Schema([ColSpec(kind, LABEL_OUTPUT)])


def params_schema() -> Any:
    """The ``predict_method`` param MLflow passes through to ``predict``."""
    from mlflow.types.schema import ParamSchema, ParamSpec

    return ParamSchema([ParamSpec("predict_method", "string", "predict")])


def _probabilities(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    if z.ndim == 1 or z.shape[1] == 1:
        p = 1.0 / (1.0 + np.exp(-z.reshape(-1)))
        return np.stack([1.0 - p, p], axis=1)
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def apply(conf: dict[str, Any], logits: np.ndarray, params: dict[str, Any] | None) -> np.ndarray:
    """Labels, probabilities or logits from the model's logits, by ``predict_method``."""
    method = (params or {}).get("predict_method", "predict")
    if method not in METHODS:
        raise InputError(
            f"Rule: predict_method is one of {list(METHODS)}. Found {str(method)[:40]!r}."
        )
    if method == "predict_logits":
        return logits
    probs = _probabilities(logits)
    if method == "predict_proba":
        return probs
    index = probs.argmax(axis=1)
    labels = conf.get("labels")
    return index.astype(np.int64) if not labels else np.asarray(labels)[index]
