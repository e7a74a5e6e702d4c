"""Params trees stored as Orbax checkpoints (jaxexp_mlflow/params)."""
