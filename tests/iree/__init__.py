"""The IREE backend: archived models run without JAX (jaxexp_mlflow/iree)."""
