"""The JAX facts of a logged model, as LoggedModel params the MLflow UI shows on its page.

``log_model`` adds, after MLflow has logged the model: ``jax.version``, ``jax.jaxlib_version``,
``jax.platforms``, ``jax.nr_devices``, ``jax.vjp_order``, ``jax.in_avals`` / ``jax.out_avals``
(the inputs and outputs after the params, ``name: dtype[shape]``), ``jax.params`` (leaf count),
``jax.blob_bytes`` and ``jax.function``. The MLmodel ``jaxexp`` section stays the full record;
these are a summary (each value cut to ``MAX_VALUE`` characters).
"""

from __future__ import annotations

import logging
from typing import Any

_logger = logging.getLogger(__name__)

MAX_VALUE = 500


def _cut(value: Any) -> str:
    text = value if isinstance(value, str) else ", ".join(map(str, value))
    return text if len(text) <= MAX_VALUE else text[: MAX_VALUE - 4] + " ..."


def facts(conf: dict[str, Any]) -> dict[str, str]:
    """The ``jax.*`` params of a model from its MLmodel ``jaxexp`` section."""
    io = conf.get("io") or {}

    def avals(side: str) -> list[str]:
        entries = io.get(side)
        if not entries:  # older models: the avals of the blob (params included)
            return list(conf.get("in_avals" if side == "inputs" else "out_avals") or [])
        return [
            f"{e['name']}: {e['dtype']}[{','.join(str(d) for d in e['shape'])}]" for e in entries
        ]

    out = {
        "jax.version": conf.get("jax_version"),
        "jax.jaxlib_version": conf.get("jaxlib_version"),
        "jax.platforms": conf.get("platforms"),
        "jax.nr_devices": conf.get("nr_devices"),
        "jax.vjp_order": conf.get("vjp_order"),
        "jax.in_avals": avals("inputs"),
        "jax.out_avals": avals("outputs"),
        "jax.params": conf.get("n_param_leaves"),
        "jax.blob_bytes": conf.get("exported_nbytes"),
        "jax.function": conf.get("fun_name"),
    }
    return {
        k: _cut(v if not isinstance(v, int) else str(v)) for k, v in out.items() if v is not None
    }


def record_on_logged_model(info: Any) -> None:
    """Log the facts as params of the LoggedModel behind ``info`` (MLflow 3; else nothing)."""
    model_id = getattr(info, "model_id", None)
    conf = (getattr(info, "flavors", None) or {}).get("jaxexp")
    if not model_id or not conf:
        return
    import mlflow

    try:
        mlflow.log_model_params(facts(conf), model_id=model_id)
    except Exception as err:  # noqa: BLE001 - a summary for the UI must not fail the logging
        _logger.warning("jaxexp: could not record the JAX facts on model %s: %s", model_id, err)
