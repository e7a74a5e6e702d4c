"""The jaxexp command line (jaxexp_mlflow/cli)."""
