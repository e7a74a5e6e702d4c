"""Private jax, jaxlib, MLflow and google-crc32c names and their fallbacks (internals)."""
