"""The canonical form of a model's params: a flat dict of arrays named by their attribute paths.

Whatever params tree a JAX user holds (dicts/lists/tuples, a Flax linen ``FrozenDict``, an NNX
``State`` from ``nnx.split`` or an NNX module, an Equinox module from ``eqx.partition``), the
flavor exports, stores and loads it as ``{name: array}``: ``l1.kernel``, ``layers[0].weight``,
``do.rngs.key``. The user's tree structure (Flax/Equinox classes, None leaves, static fields) is
kept inside the exported function, where the traced wrapper rebuilds it before calling the
user's function, so the blob holds only a plain dict and loading needs neither Flax nor Equinox.

Names: a dict key or attribute that is an identifier is appended as ``.key``; any other dict key
as ``[repr(key)]``; a sequence index as ``[i]``. So ``{"a.b": x, "a": {"b": y}}`` gives
``['a.b']`` and ``a.b``: the rendering is injective, and a collision (possible only through
custom pytree keys) is refused at save. The ``.value`` of a Flax variable is not part of the
name. Typed PRNG key arrays (``key<fry>``) are stored as their key data
(``jax.random.key_data``) with their implementation's name, and rebuilt with
``jax.random.wrap_key_data``. See docs/model-families.md.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxexp_mlflow.errors import ArtifactError, ParamsMismatchError, UnsupportedModelError

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
#: Name of the single array when the params are one array (no key path).
ROOT_NAME = "params"
# Flax classes that wrap one array (the ``.value`` of an NNX variable, linen's boxed metadata):
# their own key is left out of the name.
_WRAPPER_CLASSES = ("Variable", "VariableState", "AxisMetadata")


def _token(key: Any) -> str:
    tu = jax.tree_util
    if isinstance(key, tu.SequenceKey):
        return f"[{key.idx}]"
    if isinstance(key, tu.GetAttrKey):
        return f".{key.name}" if _IDENT.match(key.name) else f"[{key.name!r}]"
    if isinstance(key, tu.DictKey):
        k = key.key
        return f".{k}" if isinstance(k, str) and _IDENT.match(k) else f"[{k!r}]"
    if isinstance(key, tu.FlattenedIndexKey):
        return f"[{key.key}]"
    return f"[{str(key)!r}]"


def path_name(path: tuple) -> str:
    """The readable name of a pytree key path: ``l1.kernel``, ``layers[0].weight``."""
    name = "".join(_token(k) for k in path)
    return (name[1:] if name.startswith(".") else name) or ROOT_NAME


def _is_wrapper(x: Any) -> bool:
    return any(
        c.__module__.startswith("flax.") and c.__name__ in _WRAPPER_CLASSES for c in type(x).__mro__
    )


def _flat_dict_keys(tree: Any) -> list[str] | None:
    """The keys (in leaf order) of a dict of single leaves with str keys: already canonical."""
    if type(tree) is not dict or not all(isinstance(k, str) for k in tree):
        return None
    for v in tree.values():
        td = jax.tree.structure(v)
        if td.num_leaves != 1 or td.num_nodes != 1 or _is_wrapper(v):
            return None
    return [p[0].key for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def leaf_names(tree: Any) -> list[str]:
    """The names of ``tree``'s leaves, in ``jax.tree.leaves`` order; refuses duplicates.

    A flat dict of arrays with str keys is already canonical: its keys are the names.
    """
    flat = _flat_dict_keys(tree)
    names: list[str] = [] if flat is None else flat
    pairs = (
        []
        if flat is not None
        else jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_wrapper)[0]
    )
    for path, node in pairs:
        if _is_wrapper(node):
            inner = jax.tree_util.tree_flatten_with_path(node)[0]
            if len(inner) == 1:
                names.append(path_name(path))
                continue
            names += [path_name((*path, *sub)) for sub, _ in inner]
        else:
            names.append(path_name(path))
    seen: dict[str, int] = {}
    for name in names:
        seen[name] = seen.get(name, 0) + 1
    dups = sorted(n for n, c in seen.items() if c > 1)
    if dups:
        raise UnsupportedModelError(
            f"Two or more params leaves have the same name {dups}: expected every leaf to have "
            "its own key path. Custom pytree nodes must give their children distinct keys; "
            "rename the colliding entries (or put them in a dict with distinct keys)."
        )
    bad = [n for n in names if not safe_name(n)]
    if bad:
        raise UnsupportedModelError(
            f"params names {bad[:5]} cannot be stored: expected keys without '/' path segments "
            "that are empty, '.' or '..' (each name is a directory of the params checkpoint). "
            "Rename those dict keys."
        )
    return names


def safe_name(name: Any) -> bool:
    """Whether ``name`` can be a directory name inside the params checkpoint (no escape)."""
    if not isinstance(name, str) or not name or "\x00" in name or "\\" in name:
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


# --------------------------------------------------------------------------------------------
# PRNG keys


def is_key(x: Any) -> bool:
    """Whether ``x`` is a typed PRNG key array (dtype ``key<...>``)."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def key_impl_name(key: Any) -> str:
    """The name ``jax.random.wrap_key_data(impl=...)`` takes for ``key``'s implementation."""
    return str(jax.random.key_impl(key))


def _bad_impl(impl: Any, err: Exception) -> ArtifactError:
    return ArtifactError(
        f"MLmodel names the PRNG implementation {impl!r} for a params key, which this jax "
        f"does not know ({err}). Expected one of jax's implementations (threefry2x32, rbg, "
        "unsafe_rbg...); the MLmodel was altered or needs a newer jax."
    )


def key_data_spec(shape: tuple, impl: str) -> jax.ShapeDtypeStruct:
    """Shape and dtype of the key data of a key array of ``shape`` for the ``impl``."""
    try:
        one = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl)))
    except (ValueError, TypeError) as err:
        raise _bad_impl(impl, err) from err
    return jax.ShapeDtypeStruct((*shape, *one.shape), one.dtype)


def wrap_keys(named: dict[str, Any], impls: dict[str, str] | None) -> dict[str, Any]:
    """``named`` with the key data of each entry of ``impls`` turned back into typed keys."""
    if not impls:
        return named
    out = dict(named)
    for k, impl in impls.items():
        if k in out and not is_key(out[k]):
            try:
                out[k] = jax.random.wrap_key_data(out[k], impl=impl)
            except (ValueError, TypeError) as err:
                raise _bad_impl(impl, err) from err
    return out


def unwrap_key(x: Any) -> Any:
    """Key data for a typed key array, ``x`` itself otherwise."""
    return jax.random.key_data(x) if is_key(x) else x


# --------------------------------------------------------------------------------------------
# canonical params


@dataclass(frozen=True)
class NamedParams:
    """A params tree as the flavor stores it, plus what rebuilds the user's tree from it."""

    names: tuple[str, ...]  # in the user's leaf order
    arrays: dict[str, Any]  # name -> array as stored (typed PRNG keys as key data)
    key_impls: dict[str, str]  # name -> PRNG implementation, for the typed-key entries
    rebuild: Callable[[dict[str, Any]], Any]  # (traced) named arrays -> the user's params


def _is_nnx_module(x: Any) -> bool:
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.Module)


def _is_param_leaf(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic | bool | int | float | complex)


def python_scalar(value: bool | int | float | complex, where: str) -> np.ndarray:
    """A plain Python number among the params (an Equinox module's ``float`` field, brax's
    ``std_eps``) as the 0-d array jax computes with: its canonical dtype (float32, int32,
    complex64 unless ``jax_enable_x64`` is on), the dtype the export gives it. A value that
    dtype cannot hold is refused (:class:`ParamsMismatchError`) rather than wrapped."""
    dtype = np.dtype(jax.numpy.result_type(value))
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if not info.min <= value <= info.max:
            raise ParamsMismatchError(
                f"{where}: expected a number that {dtype} holds (jax computes Python ints in "
                f"{dtype}{'' if dtype.itemsize == 8 else ' while jax_enable_x64 is off'}), "
                f"found the Python int {value}. Make it a numpy array of a wider dtype with "
                "jax_enable_x64 on, or move it out of params."
            )
    array = np.asarray(value, dtype=dtype)
    if dtype.kind in "fc" and np.isfinite(value) and not np.all(np.isfinite(array)):
        raise ParamsMismatchError(
            f"{where}: expected a number that {dtype} holds, found the Python number {value}, "
            f"which overflows it. Enable jax_enable_x64 or move it out of params."
        )
    return array


def canonicalize(params: Any) -> NamedParams:
    """Name the array leaves of ``params`` and record how to rebuild it from them.

    An NNX module is split (``nnx.split``) and merged back inside the function; callables among
    the leaves (an Equinox module's activation functions) stay inside the function as they are.
    Any other non-array leaf is refused with :class:`ParamsMismatchError`.
    """
    merge: Callable[[Any], Any] = lambda tree: tree  # noqa: E731
    if _is_nnx_module(params):
        from flax import nnx

        graphdef, params = nnx.split(params)
        merge = lambda state: nnx.merge(graphdef, state)  # noqa: E731
    leaves, treedef = jax.tree.flatten(params)
    all_names = leaf_names(params)
    slots: list[tuple[str | None, Any]] = []  # (name, None) for a param, (None, leaf) static
    arrays: dict[str, Any] = {}
    impls: dict[str, str] = {}
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    for name, leaf, (path, _) in zip(all_names, leaves, paths, strict=True):
        if _is_param_leaf(leaf):
            if isinstance(leaf, bool | int | float | complex) and not isinstance(leaf, np.generic):
                leaf = python_scalar(leaf, f"params{jax.tree_util.keystr(path)}")
            if is_key(leaf):
                impls[name] = key_impl_name(leaf)
                leaf = jax.random.key_data(leaf)
            arrays[name] = leaf
            slots.append((name, None))
        elif callable(leaf):
            slots.append((None, leaf))
        else:
            raise ParamsMismatchError(
                f"params{jax.tree_util.keystr(path)}: expected an array (jax.Array or "
                f"numpy.ndarray), found {type(leaf).__module__}.{type(leaf).__qualname__}. "
                "Params must be a pytree whose leaves are arrays (functions are kept inside the "
                "model as they are); convert other leaves to arrays or move them out of params."
            )

    def rebuild(named: dict[str, Any]) -> Any:
        flat = [
            (jax.random.wrap_key_data(named[n], impl=impls[n]) if n in impls else named[n])
            if n is not None
            else static
            for n, static in slots
        ]
        return merge(jax.tree.unflatten(treedef, flat))

    return NamedParams(tuple(arrays), arrays, impls, rebuild)


def restore_tree(like: Any, named: dict[str, Any]) -> Any:
    """``like`` (params of the structure the model was logged with: an NNX module or state, an
    Equinox module, a dict...) rebuilt with the arrays of ``named`` (e.g. ``model.params``).

    Needs the user's classes (Flax, Equinox) since it rebuilds their objects.
    """
    template = canonicalize(like)
    missing = [n for n in template.names if n not in named]
    if missing:
        raise ParamsMismatchError(
            f"params: expected entries {missing[:8]} (of {len(template.names)}), found none "
            f"in the given dict of {len(named)}. Pass params of the structure the model was "
            "logged with."
        )
    return template.rebuild({n: unwrap_key(named[n]) for n in template.names})


def export_param_names(treedef: Any) -> list[str]:
    """The names of the leaves of an export's params argument, given its treedef."""
    return leaf_names(jax.tree.unflatten(treedef, list(range(treedef.num_leaves))))


def export_key_impls(names: list[str], avals: Any) -> dict[str, str]:
    """PRNG implementation names of the params the export takes as typed keys."""
    return {n: dtype_impl_name(a.dtype) for n, a in zip(names, avals, strict=False) if is_key(a)}


def dtype_impl_name(dtype: Any) -> str:
    """The implementation name of a key dtype (``key<fry>`` -> ``threefry2x32``)."""
    impl = dtype._impl  # no public accessor from a dtype (only from a key array)
    return str(getattr(impl, "name", impl))


def bind(fn: Callable, named: NamedParams) -> Callable:
    """``fn(params, *inputs)`` as ``g(named_arrays, *inputs)``: the export's function."""

    def with_named_params(arrays: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        return fn(named.rebuild(arrays), *args, **kwargs)

    name = getattr(fn, "__name__", None) or type(fn).__name__
    with_named_params.__name__ = with_named_params.__qualname__ = name
    return with_named_params


def export_arg(named: dict[str, Any], names: list[str], treedef: Any, avals: list[Any]) -> Any:
    """The export's params argument from a named dict: the export's tree, keys as it takes them.

    ``names`` and ``avals`` are in the export's leaf order. A typed key is passed where the
    export takes key data (the flavor's own exports) and kept where it takes typed keys.
    """
    missing = [n for n in names if n not in named]
    if missing or len(named) != len(names):
        extra = sorted(set(named) - set(names))
        raise ParamsMismatchError(
            f"params: expected the names {list(names)[:8]}{'...' if len(names) > 8 else ''}, "
            f"found {len(missing)} missing ({missing[:5]}) and {len(extra)} unexpected "
            f"({extra[:5]}). Pass a dict like model.params."
        )
    leaves = []
    for n, aval in zip(names, avals, strict=True):
        x = named[n]
        if not is_key(aval):
            x = unwrap_key(x)
        leaves.append(x)
    return jax.tree.unflatten(treedef, leaves)
