"""The model directory: what ``save_model`` writes and every reader checks, and its transfers.

``artifact`` is the directory's layout (file names, reference arrays, the params' tree);
``section`` the MLmodel ``jaxexp`` section as a checked schema object (every value an untrusted
model states is bounded here); ``model_files`` the directory as one load reads it (MLmodel read
and checked once, the blob read, checked and parsed once, handed down as one object);
``atomic`` builds a model in a temporary sibling and renames it into place; ``upload`` and
``download`` move model directories to and from MLflow artifact stores on the pool of
``transfer``, in parallel and checked against the manifest. Below it lie only ``codec/`` and
``params/``.
"""
