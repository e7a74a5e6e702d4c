"""The blob, MLmodel and params-file readers (jaxexp_mlflow/codec)."""
