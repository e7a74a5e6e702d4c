"""Loading with JAX: the verdict, the route plan, the loader and the callable model.

``compat`` judges whether a blob can run here (the verdict and its reasons), ``routes`` plans
the ways to run a model this JAX refuses and ``loader`` consults both before it deserializes
the blob and binds the params into ``model.JaxExpModel``; ``devices`` places it, ``executables``
and ``buckets`` compile it per shape, ``cache`` holds compilation caches, ``isolate`` probes a
blob in a child process, ``probes`` makes synthetic inputs, ``backend`` names the engines.
"""
