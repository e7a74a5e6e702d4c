"""Calling a loaded model from outside Python: the pyfunc face and every door that uses it.

``pyfunc`` is what ``mlflow.pyfunc.load_model`` returns (batch buckets, backends, routes);
``inputs`` the one input contract of every door (names or positions, lossless casts only);
``signature`` MLflow signatures from the exported avals; ``classifier`` logits as labels;
``server`` and ``serving_guard`` are ``jaxexp serve`` and its request limits; ``spark``
scores a Spark DataFrame on the Arrow path and ``mlserver_runtime`` is the MLServer runtime.
It stands on ``runtime/`` and ``iree/``; the flavor API in ``flavors/`` stands on it.
"""
