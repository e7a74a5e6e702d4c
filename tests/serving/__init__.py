"""pyfunc, REST servers, MLServer and Spark scoring a jaxexp model (jaxexp_mlflow/serving)."""
