"""Formats only: readers and writers of the bytes a model directory holds.

The blob (``blob``: checks and ``jax.export`` deserialization; ``reader``: a jax-free
flatbuffer reader with ``schema``, the schema's history; ``mlir_bytecode``), MLmodel YAML
(``mlmodel``), reference arrays (``arrays``), zarr arrays (``zarr``, read only), CRC-32C,
custom pytree nodes (``pytrees``) and confined file reads (``files``). It imports nothing of the
package but ``errors`` and ``internals``.
"""
