"""Archived models in other JAX environments: re-run them there, reproduce, refresh.

``jax_envs`` builds and caches virtualenvs holding one given jax; ``recorded_env`` re-creates
the environment a model was logged with and runs its reference input there through
``_env_runner`` (a script run by that environment's Python); ``env_routes`` are the ``bridge``
and ``recorded-env`` routes of ``runtime/routes.py``; ``reproduce`` compares outputs with the
stored reference; ``reexport`` is ``refresh``: re-export an old model with the running JAX and
log it once its outputs agree. It stands on the flavor API; only ``cli/`` stands on it.
"""
