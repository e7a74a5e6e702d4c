"""Every private name of another library the package uses, each with its public fallback.

``jax_private``, ``mlflow_private`` and ``crc32c_private`` are the only modules that touch a
private name of jax, MLflow or google-crc32c; each name is tried, and where it is gone the
public fallback runs. See docs/internals.md.
"""
