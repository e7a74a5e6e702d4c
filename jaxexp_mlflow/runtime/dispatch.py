"""How a CPU computation is run: on the calling thread, or handed to one of XLA's workers.

JAX's CPU client hands every computation of more than ~1000 flops to a worker thread, and the
caller waits for it when it reads the result (``jax_cpu_enable_async_dispatch``, on by default).
A scoring server reads every result at once, so the handoff buys it nothing and costs two thread
switches a call: on the 2-core VM, the 784-512-512-10 MLP at batch 1 took 57-65 us a call with
the handoff and 39 us without (jax 0.10.2 and 0.12 alike; docs/serving/batching.md, "Dispatch").

The flag is public and read once, when JAX makes its CPU client. So it is set only where that
has not happened and the process is ours to configure: a scoring server (``mlflow models serve``,
``jaxexp serve``, MLServer) whose process had not imported jax before loading the model. A
process that imported jax itself keeps its own configuration. ``JAXEXP_CPU_INLINE=1`` asks for it
in any process that has not imported jax yet, ``0`` never.
"""

from __future__ import annotations

import sys

from jaxexp_mlflow import settings

#: ``1``: run CPU computations on the calling thread in any process whose load imports jax
#: first; ``0``: never; unset: in scoring servers only.
ENV_CPU_INLINE = "JAXEXP_CPU_INLINE"
_FLAG = "jax_cpu_enable_async_dispatch"


def inline_cpu_dispatch(serving: bool) -> bool:
    """Before this process's first ``import jax``: turn JAX's async CPU dispatch off for a
    scoring server (``serving``) or where ``$JAXEXP_CPU_INLINE`` asks; True when it was set.

    Does nothing once jax is imported (its CPU client may exist, and its configuration is the
    process's), or on a jax without the flag.
    """
    asked = settings.JAXEXP_CPU_INLINE.get().strip().lower()
    if asked not in ("", "0", "off", "false", "no", "1", "on", "true", "yes"):
        raise ValueError(
            f"{ENV_CPU_INLINE}={asked!r}: expected 1 or 0 (on or off), found something else. "
            "Set it to 1 to run CPU computations on the calling thread, 0 never, or unset it "
            "(scoring servers only)."
        )
    if asked in ("0", "off", "false", "no"):
        return False
    if not (serving or asked in ("1", "on", "true", "yes")) or "jax" in sys.modules:
        return False
    import jax

    try:
        jax.config.update(_FLAG, False)
    except (AttributeError, KeyError, ValueError):  # a jax without the flag: left as it is
        return False
    return True


def inline_now() -> bool:
    """Whether JAX's CPU client runs computations on the calling thread (the flag as read)."""
    if "jax" not in sys.modules:
        return False
    import jax

    return getattr(jax.config, "values", {}).get(_FLAG) is False
