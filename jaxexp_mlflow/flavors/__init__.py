"""The MLflow flavor API: ``mlflow.jaxexp`` (``jaxexp``), the save path and the logged facts.

``jaxexp`` is the flavor module MLflow knows by name (``save_model``, ``log_model``,
``load_model`` and the pyfunc ``loader_module`` saved models name); ``saving`` turns a function
or a blob into a model directory, ``readback`` loads it back before it is published, ``facts``
records the JAX facts as logged-model params, ``save_route`` saves a blob this JAX refuses
through a route, ``refresh`` re-exports an old model with the running JAX and logs it once its
outputs agree (``jaxexp_mlflow.refresh``). It stands on ``archive/``, ``serving/``,
``runtime/``, ``iree/`` and ``store/``; ``cli/`` and ``hooks`` stand on it.
"""
