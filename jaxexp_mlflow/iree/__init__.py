"""The IREE backend: run archived ``jax.export`` models without importing JAX.

``mlflow.jaxexp.load_model(uri, backend="iree")``, the pyfunc ``model_config`` key ``backend``
and ``jaxexp predict/verify --backend iree`` load a model through this package: the blob is read
by the jax-free codec (``codec.reader``), the params by the jax-free zarr3 reader
(``codec.zarr``), the StableHLO module is compiled by the IREE compiler (``compiler``, with a
per-user ``.vmfb`` cache) and run by the IREE runtime (``model``). Install with
``pip install 'jaxexp-mlflow[iree]'``. See docs/longevity.md.

Modules: ``files`` (every file read), ``shapes`` (the shape assertions IREE drops), ``trees``
(pytrees without JAX), ``verdict`` (what IREE cannot run), ``compiler`` (compile + cache),
``model`` (the callable), ``specialize`` (a symbolic-batch module made static, without JAX),
``rewrites`` (same-math rewrites of a static module for faster IREE code), ``static`` (the
callable compiled per batch size), ``roundings`` (narrowing float converts that keep their
rounding), ``loader`` (directory -> model), ``selfcheck`` (the stored reference reproduced at
load), ``failures`` (the runtime's errors typed), ``prepare`` (save time, with JAX).
"""
