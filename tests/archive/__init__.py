"""Recorded environments rebuilt and verified (jaxexp_mlflow/archive)."""
