"""Every private name of another library the package uses, each with its public fallback.

``jax_private`` and ``mlflow_private`` are the only modules that touch a private name of jax
or MLflow, ``jaxlib_private`` the names of jaxlib that run a stored executable without jax,
``crc32c_private`` google-crc32c's bundled library (a checksum without the GIL); each name is
tried, and where it is gone the public fallback runs. See docs/internals.md.
"""
