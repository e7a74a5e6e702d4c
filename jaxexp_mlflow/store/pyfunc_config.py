"""Checks of ``python_function.config`` in an MLmodel: the keys only a loader may set, and the
bounds of the rest.

MLflow hands that mapping to the pyfunc loader as the defaults of ``model_config``, so a model
directory could otherwise set through it what the ``jaxexp`` section refuses or bounds.
:func:`validate_pyfunc_config` refuses it with the section's own bounds
(``store/section_fields.py``); ``store/section.py`` calls it on every read of a model directory
and re-exports its names. No JAX and no MLflow import.
"""

from __future__ import annotations

from typing import Any

from jaxexp_mlflow.codec.files import fail
from jaxexp_mlflow.codec.mlmodel import MLMODEL
from jaxexp_mlflow.store.section_fields import (
    MAX_BATCH,
    MAX_BUCKETS,
    MAX_REQUEST_BYTES,
    _found,
    _sizes,
)

#: ``python_function.config`` keys a model directory may not set (non-null): where compiled code
#: is loaded from (the caches), what compiles it (the backend) and whether the compatibility
#: verdict may be overruled are the choice of whoever loads the model, never of the model.
PYFUNC_LOAD_TIME_ONLY = {
    "compilation_cache": "JAXEXP_COMPILATION_CACHE",
    "iree_cache": "JAXEXP_IREE_CACHE",
    "backend": "JAXEXP_BACKEND",
    "allow_incompatible": None,
    "allow_other_platform": None,
    "route": None,
}
_FLAGS = (True, False, 0, 1, "0", "1", "true", "false", "on", "off", "yes", "no")


def validate_pyfunc_config(section: Any) -> None:
    """Check ``python_function.config`` of an MLmodel like the ``jaxexp.serving`` section.

    MLflow passes that mapping to the pyfunc loader as the defaults of ``model_config``, so a
    model directory could otherwise set through it what the flavor section refuses or bounds.
    ``save_model`` writes every key as null (the keys ``model_config`` may set at load). Refused
    with an ``ArtifactError`` naming the key: a non-null value for a key in
    ``PYFUNC_LOAD_TIME_ONLY``; ``max_batch`` / ``max_request_bytes`` / bucket lists beyond the
    flavor section's bounds; values of the wrong type.
    """
    if section is None:
        return
    if not isinstance(section, dict):
        raise _config_bad("(section)", "a mapping", section, where="python_function")
    config = section.get("config")
    if config is None:
        return
    if not isinstance(config, dict) or len(config) > MAX_BUCKETS:
        raise _config_bad("(config)", f"a mapping of at most {MAX_BUCKETS} keys", config)
    for key, value in config.items():
        if value is None:
            continue
        if key in PYFUNC_LOAD_TIME_ONLY:
            env = PYFUNC_LOAD_TIME_ONLY[key]
            raise fail(
                f"The model's {MLMODEL} python_function.config sets {key}: the model directory "
                f"tried to set {key}, which only whoever loads the model may choose. Remove it "
                f"from the model and pass it as a load option instead (model_config="
                f"{{{key!r}: ...}}{f' or {env}' if env else ''})."
            )
    _config_int(config, "max_batch", MAX_BATCH)
    _config_int(config, "max_request_bytes", MAX_REQUEST_BYTES)
    from jaxexp_mlflow.errors import ArtifactError

    for key in ("buckets", "precompile"):
        try:
            _sizes(config.get(key), key)
        except ArtifactError:
            raise _config_bad(
                key,
                f"'pow2', 'off', a bool or at most {MAX_BUCKETS} sizes in [1, {MAX_BATCH}]",
                config.get(key),
            ) from None
    for key in ("allow_nan", "data_parallel"):
        value = config.get(key)
        if value is not None and (
            not isinstance(value, bool | int | str)
            or (value.lower() if isinstance(value, str) else value) not in _FLAGS
        ):
            raise _config_bad(key, "true or false", value)
    driver = config.get("iree_driver")
    if driver is not None and (not isinstance(driver, str) or len(driver) > 64):
        raise _config_bad("iree_driver", "an IREE driver name", driver)


def _config_int(config: dict, key: str, hi: int) -> None:
    value = config.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
        raise _config_bad(key, f"an integer in [1, {hi}]", value)


def _config_bad(
    key: str, expected: str, value: Any, *, where: str = "python_function.config"
) -> Exception:
    return fail(
        f"The model's {MLMODEL} {where}.{key}: expected {expected}, found {_found(value):.80}. "
        "The model directory sets it outside the bounds the flavor section has; download the "
        "model again, or pass the setting as a load option (model_config) instead."
    )
