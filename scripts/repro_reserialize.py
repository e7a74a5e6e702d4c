"""Reproduce the XLA:CPU fault the executable store works around (runtime/executables.py).

An executable that JAX's persistent compilation cache hands back serializes without its kernels:
reloaded with ``jax.experimental.serialize_executable`` it fails when called (``NOT_FOUND:
Function ... not found``). Seen with jax/jaxlib 0.10.2 and 0.12.0.1 on CPU.

    python scripts/repro_reserialize.py     # runs itself twice against one fresh cache dir
"""

from __future__ import annotations

import subprocess
import sys
import tempfile


def attempt(cache_dir: str) -> str:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import serialize_executable

    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    w, x = np.ones((8, 4), np.float32), np.ones((1, 8), np.float32)
    compiled = jax.jit(lambda w, x: jnp.tanh(x @ w).reshape(-1)).lower(w, x).compile()
    payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    again = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
    try:
        return f"reloaded and ran: {np.asarray(again(w, x))}"
    except Exception as err:  # noqa: BLE001 - the fault shown
        return f"reloaded, failed when called: {err}"


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(attempt(sys.argv[1]))
        sys.exit(0)
    with tempfile.TemporaryDirectory() as cache:
        for run in ("a real compile", "a persistent-cache hit"):
            out = subprocess.run(
                [sys.executable, __file__, cache], capture_output=True, text=True, check=True
            )
            print(f"{run}: {out.stdout.strip()}")
