"""The model on the IREE runtime: the compiled module with its params uploaded once, callable.

``IreeModel(*inputs, **kwargs)`` takes the inputs after the params (like ``JaxExpModel``) and
returns the exported output pytree with numpy leaves. The calling convention is applied here:
the flat leaves in ``in_tree`` order, only those at ``module_kept_var_idx`` passed, the platform
index first for multi-platform exports, bfloat16 and the other ml_dtypes types passed by their
bits with the HAL element type set. Shapes are checked first (``shapes.bind_dims``): IREE drops
JAX's shape assertions. Nothing here imports JAX.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from jaxexp_mlflow.errors import IncompatibleError, InputError
from jaxexp_mlflow.iree import shapes, trees

#: IREE's CPU drivers: ``local-task`` runs dispatches on a thread pool (IREE's default),
#: ``local-sync`` on the calling thread (no thread hand-off: steadier small-batch latency on a
#: busy machine). ``iree_driver=`` / the pyfunc key / ``JAXEXP_IREE_DRIVER`` choose.
DEFAULT_DRIVER = "local-task"
ENV_DRIVER = "JAXEXP_IREE_DRIVER"

#: numpy dtype name -> IREE HAL element type name (the runtime's own map lacks the ml_dtypes).
_ELEMENT_TYPES = {
    "bool": "BOOL_8",
    "int8": "SINT_8",
    "int16": "SINT_16",
    "int32": "SINT_32",
    "int64": "SINT_64",
    "uint8": "UINT_8",
    "uint16": "UINT_16",
    "uint32": "UINT_32",
    "uint64": "UINT_64",
    "float16": "FLOAT_16",
    "bfloat16": "BFLOAT_16",
    "float32": "FLOAT_32",
    "float64": "FLOAT_64",
    "complex64": "COMPLEX_64",
    "complex128": "COMPLEX_128",
    "float8_e4m3fn": "FLOAT_8_E4M3_FN",
    "float8_e4m3fnuz": "FLOAT_8_E4M3_FNUZ",
    "float8_e5m2": "FLOAT_8_E5M2",
    "float8_e5m2fnuz": "FLOAT_8_E5M2_FNUZ",
}


DTYPES_HINT = (
    f"which the IREE backend does not pass: expected some of {sorted(_ELEMENT_TYPES)}. Load it "
    "with the JAX backend."
)


def unsupported_dtypes(description: Any) -> list[str]:
    """The dtypes of the blob's inputs and outputs IREE's runtime cannot take or return."""
    avals = (*description.in_avals, *description.out_avals)
    return sorted({a.split("[", 1)[0] for a in avals} - set(_ELEMENT_TYPES))


class IreeModel:
    """An archived ``jax.export`` function compiled by IREE, with its params bound.

    ``description`` is the blob's ``BlobDescription``; ``params`` the flat param leaves (numpy);
    ``platform_index`` the position of the cpu lowering for multi-platform exports (else None);
    ``constraints`` the exporter's symbolic shape constraints (``"b >= 4"``).
    """

    backend = "iree"

    def __init__(
        self,
        vmfb: bytes | Path,
        description: Any,
        metadata: dict[str, Any],
        params: list[np.ndarray],
        *,
        platform_index: int | None = None,
        constraints: tuple[str, ...] = (),
        driver: str | None = None,
    ) -> None:
        import iree.runtime as rt

        from jaxexp_mlflow.codec.arrays import resolve_dtype

        self.metadata = dict(metadata)
        self.description = description
        self.verdict: Any = None
        self._rt = rt
        self._config = rt.Config(driver or os.environ.get(ENV_DRIVER) or DEFAULT_DRIVER)
        instance = self._config.vm_instance
        if isinstance(vmfb, Path):
            module = rt.VmModule.mmap(instance, str(vmfb))
        else:
            module = rt.VmModule.copy_buffer(instance, vmfb)
        self._context = rt.SystemContext(vm_modules=[module], config=self._config)
        main = self._context.modules[module.name]["main"]
        self._vm_context, self._vm_function = main._vm_context, main.vm_function
        self._device = self._config.device
        self.in_avals = [shapes.Aval.parse(a) for a in description.in_avals]
        self.out_avals = [shapes.Aval.parse(a) for a in description.out_avals]
        self._dtypes = [resolve_dtype(a.dtype) for a in self.in_avals]
        out_dtypes = [np.dtype(resolve_dtype(a.dtype)) for a in self.out_avals]
        # outputs are read by their bits where numpy's own dtype is not the stored one
        self._out_dtypes = [(_bits(d), d) for d in out_dtypes]
        self._shapes_seen: set[tuple] = set()  # input shapes already checked (bounded)
        if unknown := unsupported_dtypes(description):
            raise IncompatibleError(f"The model uses dtypes {unknown}, {DTYPES_HINT}")
        self._element_types = [
            getattr(rt.HalElementType, _ELEMENT_TYPES[a.dtype]) for a in self.in_avals
        ]
        self.n_param_leaves = len(params)
        self.has_params = bool(params)
        self._n_param_leaves = self.n_param_leaves  # the JaxExpModel attribute the CLI reads
        self._kept = tuple(description.module_kept_var_idx)
        self._constraints = tuple(constraints)
        self._input_avals = self.in_avals[self.n_param_leaves :]
        self._input_names = [f"input {i}" for i in range(len(self._input_avals))]
        self._platform_arg = (
            None if platform_index is None else self._upload(np.int32(platform_index), None)
        )
        # params go to the device once; kept ones only
        self._params = {i: self._upload(p, i) for i, p in enumerate(params) if i in self._kept}
        self.params = params

    # -- conversion ------------------------------------------------------------------------------

    def _upload(self, arr: Any, index: int | None) -> Any:
        rt = self._rt
        arr = np.ascontiguousarray(arr)
        et = (
            self._element_types[index]
            if index is not None
            else getattr(rt.HalElementType, _ELEMENT_TYPES[arr.dtype.name])
        )
        arr = arr.view(_bits(arr.dtype))
        return self._device.allocator.allocate_buffer_copy(
            memory_type=rt.MemoryType.DEVICE_LOCAL,
            allowed_usage=rt.BufferUsage.DEFAULT,
            device=self._device,
            buffer=arr,
            element_type=et,
        )

    def _as_input(self, value: Any, index: int) -> np.ndarray:
        want = self._dtypes[index]
        arr = value if isinstance(value, np.ndarray) else np.asarray(value)
        if arr.dtype != want:
            if arr.dtype.kind != want.kind and not (
                arr.dtype.kind in "iub" and want.kind in "f" or want.type.__module__ != "numpy"
            ):
                raise InputError(
                    f"input {index - self.n_param_leaves}: expected {self.in_avals[index]}, "
                    f"found {arr.dtype}{list(arr.shape)}. Pass an array of that dtype."
                )
            arr = arr.astype(want)
        return arr

    # -- calling ---------------------------------------------------------------------------------

    def call_flat(self, leaves: list[Any]) -> list[np.ndarray]:
        """Run on the flat input leaves (after the params); return the flat output leaves."""
        n = self.n_param_leaves
        if len(leaves) != len(self._input_avals):
            raise InputError(
                f"expected {len(self._input_avals)} input leaves "
                f"({[str(a) for a in self._input_avals]}), found {len(leaves)}."
            )
        arrays = [self._as_input(x, n + i) for i, x in enumerate(leaves)]
        key = tuple(a.shape for a in arrays)
        if key not in self._shapes_seen:  # the checks depend on the shapes only
            shapes.bind_dims(self._input_avals, key, self._input_names, self._constraints)
            if len(self._shapes_seen) < 1024:
                self._shapes_seen.add(key)
        rt = self._rt
        args = rt.VmVariantList(len(self._kept) + 1)
        if self._platform_arg is not None:
            args.push_ref(self._platform_arg)
        for i in self._kept:
            args.push_ref(self._params[i] if i < n else self._upload(arrays[i - n], i))
        results = rt.VmVariantList(len(self._out_dtypes))
        self._vm_context.invoke(self._vm_function, args, results)
        outs = []
        for i, (bits, dtype) in enumerate(self._out_dtypes):
            view = results.get_as_object(i, rt.HalBufferView)
            host = view.map().asarray(view.shape, bits)
            outs.append(np.array(host).view(dtype))  # a copy: the mapping ends with the view
        return outs

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the model on ``inputs`` with the bound params; returns the exported out pytree."""
        args_node, kwargs_node = self.description.in_tree.children
        nodes = args_node.children[1:] if self.has_params else args_node.children
        if len(inputs) != len(nodes):
            raise InputError(
                f"expected {len(nodes)} positional input(s) after the params, found {len(inputs)}."
            )
        leaves: list[Any] = []
        for i, (node, value) in enumerate(zip(nodes, inputs, strict=True)):
            leaves += trees.flatten(node, value, f"input {i}")
        leaves += trees.flatten(kwargs_node, kwargs, "kwargs")
        return trees.unflatten(self.description.out_tree, self.call_flat(leaves))

    def __repr__(self) -> str:
        d = self.description
        return f"IreeModel({d.fun_name!r}, in={list(d.in_avals)}, out={list(d.out_avals)})"


def _bits(dtype: np.dtype) -> np.dtype:
    """``dtype`` itself when numpy and IREE agree on it, else unsigned ints of its width
    (bool, bfloat16 and the other ml_dtypes travel as their bits)."""
    if dtype.type.__module__ == "numpy" and dtype.kind != "b":
        return dtype
    return np.dtype(f"uint{dtype.itemsize * 8}")
