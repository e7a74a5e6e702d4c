"""Other JAX environments: run an archived model or blob there, and compare with its reference.

``jax_envs`` builds and caches virtualenvs holding one given jax; ``recorded_env`` re-creates
the environment a model was logged with, its requirement list written from MLmodel's facts
(``env_facts``) and built away from the model's files (``env_build``), and runs its reference
input there through ``_env_runner`` (a script run by that environment's Python, which loads the
model with ``runtime/loader.py``); ``env_routes`` are the ``bridge`` and ``recorded-env`` routes
of ``runtime/routes.py``; ``reproduce`` compares outputs with the stored reference. It stands on
``codec/``, ``store/`` and ``runtime/``; the flavor API (``flavors/save_route.py`` at save time,
``flavors/refresh.py``) and ``cli/`` stand on it.
"""
