"""The model directory: what ``save_model`` writes and every reader checks, and its transfers.

``artifact`` is the directory's layout (file names, reference arrays, the params' tree);
``section`` the MLmodel ``jaxexp`` section as a checked schema object (every value an untrusted
model states is bounded here); ``atomic`` builds a model in a temporary sibling and renames it
into place; ``upload`` and ``download`` move model directories to and from MLflow artifact
stores on the pool of ``transfer``, in parallel and checked against the manifest. Below it
lie only ``codec/`` and ``params/``.
"""
