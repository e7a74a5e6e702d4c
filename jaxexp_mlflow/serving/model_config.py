"""The keys ``mlflow.pyfunc.load_model(..., model_config=...)`` takes for a jaxexp model.

``save_model`` declares them in MLmodel (MLflow passes only declared keys);
docs/serving/pyfunc-rest.md says what each does.
"""

from __future__ import annotations

#: Keys accepted in ``mlflow.pyfunc.load_model(..., model_config=...)`` (and ``mlflow models
#: serve --model-config``); see docs/serving/pyfunc-rest.md. MLflow only passes keys the
#: MLmodel declares.
PYFUNC_CONFIG_KEYS = (
    "buckets",
    "max_batch",
    "precompile",
    "compilation_cache",
    "allow_nan",
    "max_request_bytes",
    "allow_incompatible",
    "allow_other_platform",
    "data_parallel",
    "backend",
    "iree_cache",
    "iree_driver",
    "route",
)
