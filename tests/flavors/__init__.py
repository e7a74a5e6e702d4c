"""Save, log, load and refresh through the MLflow flavor (jaxexp_mlflow/flavors)."""
