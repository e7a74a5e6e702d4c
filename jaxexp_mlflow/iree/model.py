"""The model on the IREE runtime: the compiled module with its params uploaded once, callable.

``IreeModel(*inputs, **kwargs)`` takes the inputs after the params (like ``JaxExpModel``) and
returns the exported output pytree with numpy leaves. The calling convention is applied here:
the flat leaves in ``in_tree`` order, only those at ``module_kept_var_idx`` passed, the platform
index first for multi-platform exports, bfloat16 and the other ml_dtypes types passed by their
bits with the HAL element type set. Shapes are checked first (``shapes.bind_dims``): IREE drops
JAX's shape assertions. Nothing here imports JAX. Where the compiled module has the batch-1
function (:func:`batch1_entry`: ``main`` with the one dimension variable set to 1, static shapes,
much faster code), calls whose inputs have those shapes go to it.

What runs is checked against what the blob declares, since the module compiled (a prepared
module from the model directory, an entry of the compile cache) is not the blob itself: at load,
the compiled functions' interfaces (their ``iree.abi.declaration``: element types, ranks,
static sizes) must be the blob's avals (at batch 1 for the batch-1 function); at each call,
every result buffer's element type and shape (the runtime's buffer view, symbolic dims solved
from the inputs) must be the out aval's, and its bytes must cover them, before it is read. A
mismatch is an ``ArtifactError``; no buffer is ever read past its end.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from jaxexp_mlflow import settings
from jaxexp_mlflow.errors import ArtifactError, IncompatibleError, InputError
from jaxexp_mlflow.iree import failures, shapes, trees
from jaxexp_mlflow.iree.entries import BATCH1, _resolve, _static, batch1_shapes

# re-exported: the loader, iree/static.py, iree/verdict.py and the tests import these from here
from jaxexp_mlflow.iree.entries import batch1_entry as batch1_entry
from jaxexp_mlflow.iree.entries import batch_shapes as batch_shapes
from jaxexp_mlflow.iree.entries import sized_entry as sized_entry
from jaxexp_mlflow.iree.interface import (
    _ELEMENT_TYPES,
    DTYPES_HINT,
    MISMATCH_HINT,
    _accepted,
    check_interface,
    unsupported_dtypes,
)

#: IREE's CPU drivers: ``local-sync`` runs dispatches on the calling thread (no thread hand-off
#: per dispatch: faster for small batches), ``local-task`` on a thread pool (IREE's default: faster
#: from ~32 rows, docs/longevity.md). ``iree_driver=`` / the pyfunc key / ``JAXEXP_IREE_DRIVER``
#: choose one for every call; unset, a model compiled per batch size runs each size on the
#: faster one (``iree/static.py``), any other on ``DEFAULT_DRIVER``.
DEFAULT_DRIVER = "local-sync"
ENV_DRIVER = "JAXEXP_IREE_DRIVER"
TASK_DRIVER = "local-task"
#: The process that made IREE's ``local-task`` driver (0: none yet). IREE makes a driver once per
#: process, and its worker threads with it; a forked child inherits the driver without the
#: threads, and anything run or even made on it there waits for them forever.
_TASK_OWNER = [0]


def claim_task_driver() -> None:
    """Record that this process makes (or uses) IREE's ``local-task`` driver."""
    if _TASK_OWNER[0] == 0:
        _TASK_OWNER[0] = os.getpid()


def task_driver_usable() -> bool:
    """Whether this process may run IREE's ``local-task`` driver: False in a forked child of a
    process that made it (see ``_TASK_OWNER``)."""
    return _TASK_OWNER[0] in (0, os.getpid())


class IreeModel:
    """An archived ``jax.export`` function compiled by IREE, with its params bound.

    ``description`` is the blob's ``BlobDescription``; ``params`` the flat param leaves (numpy);
    ``platform_index`` the position of the cpu lowering for multi-platform exports (else None);
    ``constraints`` the exporter's symbolic shape constraints (``"b >= 4"``); ``source`` names
    the module that was compiled, in errors.
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
        source: str = "the compiled module",
        bound_params: bool = False,
    ) -> None:
        import iree.runtime as rt

        from jaxexp_mlflow.codec.arrays import resolve_dtype

        self.metadata = dict(metadata)
        self.description = description
        self.verdict: Any = None
        self._rt = rt
        #: the driver asked for (argument or environment); None: ours to choose
        self.driver_chosen = driver or settings.JAXEXP_IREE_DRIVER.get() or None
        if TASK_DRIVER in (self.driver_chosen or ""):
            if not task_driver_usable():
                raise IncompatibleError(
                    f"IREE's {TASK_DRIVER} driver was made by this process's parent before it "
                    "forked: its worker threads did not come along, and a model on it would "
                    "wait for them forever. Load with iree_driver='local-sync' (or leave "
                    f"{ENV_DRIVER} unset) in a forked process."
                )
            claim_task_driver()
        self._config = rt.Config(self.driver_chosen or DEFAULT_DRIVER)
        instance = self._config.vm_instance
        self._source = source
        if isinstance(vmfb, Path):
            module = rt.VmModule.mmap(instance, str(vmfb))
        else:
            module = rt.VmModule.copy_buffer(instance, vmfb)
        # params bound into the module (``specialize.bind_arguments``) come from a parameter
        # provider, read by each context's initializer once; else they are call arguments
        self._bound = bound_params and bool(params)
        self._platform_index = platform_index
        self._param_index = self._parameter_index(params, description, platform_index)
        self._param_module = self._parameters(self._config)
        self._context = self._new_context(module)
        main = self._context.modules[module.name]["main"]
        self._vm_context, self._vm_function = main._vm_context, main.vm_function
        self._device = self._config.device
        self.in_avals = [shapes.Aval.parse(a) for a in description.in_avals]
        self.out_avals = [shapes.Aval.parse(a) for a in description.out_avals]
        self._dtypes = [resolve_dtype(a.dtype) for a in self.in_avals]
        out_dtypes = [np.dtype(resolve_dtype(a.dtype)) for a in self.out_avals]
        # outputs are read by their bits where numpy's own dtype is not the stored one
        self._out_dtypes = [(_bits(d), d) for d in out_dtypes]
        # input shapes already checked -> the result shapes they imply, the function (bounded)
        self._shapes_seen: dict[tuple, tuple[list[tuple[int | None, ...]], Any]] = {}
        if unknown := unsupported_dtypes(description):
            raise IncompatibleError(f"The model uses dtypes {unknown}, {DTYPES_HINT}")
        n_params = len(params) if self._bound else 0
        passed = [self.in_avals[i] for i in description.module_kept_var_idx if i >= n_params]
        if platform_index is not None:
            passed.insert(0, shapes.Aval("int32", ()))
        check_interface(self._vm_function, passed, self.out_avals, source)
        self._out_element_types = [_accepted(rt, a.dtype) for a in self.out_avals]
        self._hal_names = {int(v): k for k, v in rt.HalElementType.__members__.items()}
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
        self._params = {
            i: self._upload(p, i)
            for i, p in enumerate(params)
            if i in self._kept and not self._bound
        }
        self.params = params
        # the argument list of a call, prepared once: the VM refs of the platform index and the
        # params (pushing a ref is cheaper than pushing its buffer view: no conversion), and the
        # input leaves by their position among the inputs
        n = self.n_param_leaves
        fixed = [] if self._platform_arg is None else [self._platform_arg.ref]
        self._arg_plan: list[tuple[Any, int]] = [(ref, -1) for ref in fixed]
        self._arg_plan += [
            (self._params[i].ref, -1) if i < n else (None, i - n)
            for i in self._kept
            if i >= n or not self._bound
        ]
        self._n_args = len(self._arg_plan)
        self._runner = Runner(self._vm_context, self._vm_function, self._device, self._arg_plan)
        self._buffer_view = rt.HalBufferView
        # the batch-1 function, where compiled in: the input shapes it takes, and it
        self._batch1 = self._batch1_function(module, passed)

    def _batch1_function(self, module: Any, passed: list[shapes.Aval]) -> tuple[tuple, Any] | None:
        """The module's batch-1 function (``batch1_entry``; its interface checked like
        ``main``'s) with the input shapes it is called for; None where not compiled in."""
        function = module.lookup_function(BATCH1)
        found = batch1_shapes(self._input_avals, self.out_avals, self._constraints)
        if function is None or found is None:
            return None
        inputs, outputs = found
        static = [_static(a) for a in self.in_avals[: self.n_param_leaves]] + list(inputs)
        shaped = [shapes.Aval(a.dtype, s) for a, s in zip(self.in_avals, static, strict=True)]
        want = [shaped[i] for i in self._kept]
        if len(passed) > len(want):  # the platform index
            want.insert(0, passed[0])
        outs = [shapes.Aval(a.dtype, s) for a, s in zip(self.out_avals, outputs, strict=True)]
        check_interface(function, want, outs, self._source)
        return inputs, function

    def _parameter_index(self, params: list, description: Any, platform_index: int | None) -> Any:
        """The parameter index of the kept params under the names
        ``specialize.bind_arguments`` gave them; None where the params are not bound."""
        if not self._bound:
            return None
        from jaxexp_mlflow.iree.specialize import parameter_name

        rt = self._rt
        index = rt.ParameterIndex()
        offset = 0 if platform_index is None else 1
        self._param_arrays = []
        for j, i in enumerate(description.module_kept_var_idx):
            if i < len(params):
                arr = np.ascontiguousarray(np.asarray(params[i])).reshape(-1)
                arr = arr.view(_bits(arr.dtype))
                self._param_arrays.append(arr)  # the index reads from it: kept alive
                index.add_buffer(parameter_name(j + offset), arr)
        return index

    def _parameters(self, config: Any) -> Any:
        """The io_parameters module serving the bound params to contexts of ``config``; None
        where the params are not bound."""
        if self._param_index is None:
            return None
        from jaxexp_mlflow.iree.specialize import SCOPE

        provider = self._param_index.create_provider(scope=SCOPE)
        return self._rt.create_io_parameters_module(config.vm_instance, provider)

    def _new_context(self, module: Any, config: Any = None, param_module: Any = None) -> Any:
        """A VM context running ``module`` on ``config`` (default: the model's own), with the
        parameter module where params are bound."""
        if config is None:
            config, param_module = self._config, self._param_module
        modules = [module] if param_module is None else [param_module, module]
        return self._rt.SystemContext(vm_modules=modules, config=config)

    def _function_for(self, key: tuple, env: dict[str, int]) -> Runner:
        """What runs inputs of shapes ``key`` (dimension variables ``env``): the batch-1
        function where compiled in and called for, else ``main``."""
        if self._batch1 is not None and key == self._batch1[0]:
            return self._runner._replace(function=self._batch1[1])
        return self._runner

    # -- conversion ------------------------------------------------------------------------------

    def _upload(self, arr: Any, index: int | None, device: Any = None) -> Any:
        rt = self._rt
        device = device or self._device
        arr = np.asarray(arr)
        arr = np.ascontiguousarray(arr).reshape(arr.shape)  # ascontiguousarray makes 0-d 1-d
        et = (
            self._element_types[index]
            if index is not None
            else getattr(rt.HalElementType, _ELEMENT_TYPES[arr.dtype.name])
        )
        arr = arr.view(_bits(arr.dtype))
        return device.allocator.allocate_buffer_copy(
            memory_type=rt.MemoryType.DEVICE_LOCAL,
            allowed_usage=rt.BufferUsage.DEFAULT,
            device=device,
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
        seen = self._shapes_seen.get(key)
        if seen is None:  # the checks (and the function) depend on the shapes only
            env = shapes.bind_dims(self._input_avals, key, self._input_names, self._constraints)
            seen = ([_resolve(a, env) for a in self.out_avals], self._function_for(key, env))
            if len(self._shapes_seen) < 1024:
                self._shapes_seen[key] = seen
        expected, runner = seen
        results = self._invoke(runner, arrays)
        if results.size != len(self._out_dtypes):
            raise ArtifactError(
                f"{self._source} returned {results.size} results, expected "
                f"{len(self._out_dtypes)} ({[str(a) for a in self.out_avals]}). {MISMATCH_HINT}"
            )
        outs = []
        for i, (bits, dtype) in enumerate(self._out_dtypes):
            view = self._checked_view(results, i, expected[i], bits)
            host = view.map().asarray(view.shape, bits)
            outs.append(np.array(host).view(dtype))  # a copy: the mapping ends with the view
        return outs

    def _invoke(self, runner: Runner, arrays: list[np.ndarray]) -> Any:
        """Run ``runner`` on the input arrays (already of the model's dtypes); its raw
        results (a ``VmVariantList``)."""
        rt, n = self._rt, self.n_param_leaves
        args = rt.VmVariantList(self._n_args)
        for ref, j in runner.plan:
            args.push_ref(ref if j < 0 else self._upload(arrays[j], n + j, runner.device))
        results = rt.VmVariantList(len(self._out_dtypes))
        try:
            runner.context.invoke(runner.function, args, results)
        except failures.RUNTIME_ERRORS as err:  # bare runtime statuses, typed here
            raise failures.runtime_failure(self._source, err) from None
        return results

    def _checked_view(self, results: Any, i: int, shape: tuple, bits: np.dtype) -> Any:
        """Result ``i`` as a buffer view whose element type, shape and size are the out aval's
        (``shape``: None for a dimension that could not be solved); else ``ArtifactError``."""
        try:
            view = results.get_as_object(i, self._buffer_view)
            element, found = int(view.element_type), tuple(view.shape)
            nbytes = int(view.byte_length)
        except (RuntimeError, ValueError, TypeError) as err:
            aval = self.out_avals[i]
            raise ArtifactError(
                f"output {i} of {self._source}: expected a buffer of {aval}, found "
                f"{type(err).__name__}: {str(err)[:200]}. {MISMATCH_HINT}"
            ) from None
        if element in self._out_element_types[i] and found == shape:  # the usual case
            if nbytes < math.prod(found) * bits.itemsize:
                self._short(i, found, bits, nbytes)
            return view
        aval = self.out_avals[i]
        want = ", ".join("?" if d is None else str(d) for d in shape)
        if element not in self._out_element_types[i]:
            expected_names = sorted(self._hal_names.get(e, "?") for e in self._out_element_types[i])
            raise ArtifactError(
                f"output {i} of {self._source}: expected {aval.dtype}[{want}] ({aval}, element "
                f"type {' or '.join(expected_names)}), found element type "
                f"{self._hal_names.get(element, f'0x{element:08x}')} with shape {list(found)}. "
                f"{MISMATCH_HINT}"
            )
        if len(found) != len(shape) or any(
            w is not None and w != f for w, f in zip(shape, found, strict=True)
        ):
            raise ArtifactError(
                f"output {i} of {self._source}: expected {aval.dtype}[{want}] ({aval}), found "
                f"{aval.dtype}{list(found)}. {MISMATCH_HINT}"
            )
        if nbytes < math.prod(found) * bits.itemsize:
            self._short(i, found, bits, nbytes)
        return view

    def _short(self, i: int, found: tuple, bits: np.dtype, nbytes: int) -> None:
        """Refuse result ``i``, whose buffer is shorter than its shape says."""
        raise ArtifactError(
            f"output {i} of {self._source}: expected {math.prod(found) * bits.itemsize} "
            f"bytes for {self.out_avals[i].dtype}{list(found)}, found a buffer of {nbytes}. "
            f"{MISMATCH_HINT}"
        )

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


class Runner(NamedTuple):
    """What runs one input shape: a VM context and function, the device its inputs are
    uploaded to, and the call's argument plan (``(ref, -1)`` fixed, ``(None, j)`` input j)."""

    context: Any
    function: Any
    device: Any
    plan: list[tuple[Any, int]]


def _bits(dtype: np.dtype) -> np.dtype:
    """``dtype`` itself when numpy and IREE agree on it, else unsigned ints of its width
    (bool, bfloat16 and the other ml_dtypes travel as their bits)."""
    if dtype.type.__module__ == "numpy" and dtype.kind != "b":
        return dtype
    return np.dtype(f"uint{dtype.itemsize * 8}")
