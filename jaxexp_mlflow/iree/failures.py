"""The IREE runtime's failures as the package's typed errors, with what failed and the way out.

The IREE runtime raises bare Python exceptions from a call (``IndexError`` for an
``OUT_OF_RANGE`` status, ``RuntimeError``/``ValueError`` for the others) whose text speaks of
its own internals (``hal.command_buffer.copy_buffer``). A call of a compiled model that fails
there is a module IREE compiled but cannot run: an ``IncompatibleError`` naming the module, the
runtime's status and the ways out.
"""

from __future__ import annotations

from jaxexp_mlflow.errors import IncompatibleError

#: What the IREE runtime raises when a call fails (a status converted by its bindings).
RUNTIME_ERRORS = (IndexError, RuntimeError, ValueError, OSError, TypeError)


def runtime_failure(source: str, err: BaseException) -> IncompatibleError:
    """The typed error of a call of ``source`` (the module compiled) that the IREE runtime
    refused with ``err``."""
    text = " ".join(str(err).split())[:600]
    return IncompatibleError(
        f"The IREE runtime failed running {source}: expected the compiled module to run, "
        f"found {type(err).__name__}: {text}. IREE compiled this module but cannot run it; "
        "load the model with the JAX backend (backend='jax'), or, if it was saved with a "
        "symbolic batch, save it with batch_polymorphic=False and load it on IREE again."
    )
