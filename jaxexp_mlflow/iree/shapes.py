"""Shape checks IREE does not make: JAX's ``shape_assertion`` custom calls, done before the call.

``jax.export`` modules check their symbolic dimensions inside the module (``shape_assertion``
custom calls: every dimension variable >= 1, every occurrence of a variable the same size, the
exporter's explicit constraints such as ``b >= 4``). IREE compiles those calls away, so a batch
of 0 returns an empty result where JAX raises. :func:`bind_dims` makes the same checks from the
avals (``float32[b,784]``, ``float32[2*b]``) and constraint strings the blob and the save-time
preparation record, and raises :class:`InputError` with what was expected and found.

Dimension expressions are JAX's printed form (``b``, ``2*b``, ``b + 1``, ``floordiv(b, 2)``,
``mod(b, 2)``, ``max(a, b)``, ``min(a, b)``, ``non_negative(b - 2)``, ``b^2``), evaluated by a
small whitelisted interpreter: no ``eval``.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from jaxexp_mlflow.errors import InputError

_AVAL = re.compile(r"^(?P<dtype>[a-z0-9_]+)\[(?P<dims>.*)\]$")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_FUNCS = {
    "floordiv": lambda a, b: a // b,
    "mod": lambda a, b: a % b,
    "max": max,
    "min": min,
    "non_negative": lambda a: max(a, 0),
}


@dataclass(frozen=True)
class Aval:
    """An abstract value as the blob prints it: dtype name and dimensions (ints or expressions)."""

    dtype: str
    dims: tuple[int | str, ...]

    @classmethod
    def parse(cls, text: str) -> Aval:
        """``"float32[b,784]"`` -> ``Aval("float32", ("b", 784))``."""
        m = _AVAL.match(text.replace(" ", ""))
        if m is None:
            raise ValueError(f"not an aval: {text!r}")
        parts, depth, start, dims = [], 0, 0, m["dims"]
        for i, ch in enumerate(dims):  # split at the commas outside parentheses
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if ch == "," and depth == 0:
                parts.append(dims[start:i])
                start = i + 1
        if dims:
            parts.append(dims[start:])
        return cls(m["dtype"], tuple(int(d) if d.isdigit() else d for d in parts))

    @property
    def symbolic(self) -> bool:
        """True when some dimension is an expression of dimension variables."""
        return any(isinstance(d, str) for d in self.dims)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


def dim_var(avals: Sequence[Aval]) -> str | None:
    """The one dimension variable of ``avals`` (a plain name such as ``b``, the batch), or None
    when they have none, several, or only expressions of them."""
    names = {d for a in avals for d in a.dims if isinstance(d, str)}
    if len(names) != 1 or not next(iter(names)).isidentifier():
        return None
    return next(iter(names))


def _eval(node: ast.AST, env: Mapping[str, int]) -> int:
    if isinstance(node, ast.Expression):
        return _eval(node.body, env)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in env:
            raise KeyError(node.id)
        return env[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand, env)
    if isinstance(node, ast.BinOp):
        a, b = _eval(node.left, env), _eval(node.right, env)
        ops = {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b}
        if isinstance(node.op, ast.Pow) and 0 <= b <= 64:
            return a**b
        if type(node.op) in ops:
            return ops[type(node.op)]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
        fn = _FUNCS.get(node.func.id)
        if fn is not None:
            return fn(*(_eval(a, env) for a in node.args))
    raise ValueError(f"unsupported dimension expression element {ast.dump(node)[:60]}")


def _parse(expr: str) -> ast.Expression:
    return ast.parse(expr.replace("^", "**"), mode="eval")


def _names(tree: ast.AST) -> set[str]:
    funcs = {id(c.func) for c in ast.walk(tree) if isinstance(c, ast.Call)}
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and id(n) not in funcs}


def evaluate(expr: str, env: Mapping[str, int]) -> int:
    """The value of a dimension expression for the given dimension variables."""
    return _eval(_parse(expr), env)


def _solve(expr: str, size: int, env: dict[str, int]) -> bool:
    """Bind the one unknown variable of a linear ``expr`` so that it equals ``size``."""
    tree = _parse(expr)
    unknown = [n for n in _names(tree) if n not in env]
    if len(unknown) != 1:
        return False
    (name,) = unknown
    try:
        at0, at1 = _eval(tree, {**env, name: 0}), _eval(tree, {**env, name: 1})
    except (ValueError, ZeroDivisionError):
        return False
    slope = at1 - at0
    if slope == 0 or (size - at0) % slope:
        return False
    env[name] = (size - at0) // slope
    return True


def bind_dims(
    avals: Sequence[Aval],
    shapes: Sequence[tuple[int, ...]],
    names: Sequence[str],
    constraints: Sequence[str] = (),
) -> dict[str, int]:
    """Check ``shapes`` against ``avals`` as JAX's shape assertions would; return the variables.

    ``names`` label the inputs in errors. Raises :class:`InputError` on a rank or fixed-size
    mismatch, inconsistent sizes of one variable, a variable < 1 or a violated constraint.
    """
    env: dict[str, int] = {}
    pending: list[tuple[str, int, str]] = []
    for aval, shape, name in zip(avals, shapes, names, strict=True):
        if len(shape) != len(aval.dims):
            raise InputError(f"{name}: expected {aval}, found shape {list(shape)} (wrong rank).")
        for axis, (dim, size) in enumerate(zip(aval.dims, shape, strict=True)):
            where = f"{name} axis {axis}"
            if isinstance(dim, int):
                if dim != size:
                    raise InputError(f"{where}: expected size {dim} ({aval}), found {size}.")
            elif _NAME.match(dim):
                if env.setdefault(dim, size) != size:
                    raise InputError(
                        f"{where}: dimension {dim!r} is {env[dim]} elsewhere in the inputs, "
                        f"found {size} here ({aval}). Inputs sharing a dimension must agree."
                    )
            else:
                pending.append((dim, size, where))
    for expr, size, where in pending:  # expressions: bind what is still unknown, then check
        if not _solve(expr, size, env) and any(n not in env for n in _names(_parse(expr))):
            raise InputError(f"{where}: cannot solve {expr!r} = {size} for its variables.")
    for var, value in env.items():
        if value < 1:
            raise InputError(
                f"dimension {var!r} is {value}: expected >= 1 (jax.export dimension variables "
                "are positive). Send at least one row."
            )
    for expr, size, where in pending:
        if evaluate(expr, env) != size:
            raise InputError(
                f"{where}: expected {expr} = {evaluate(expr, env)} (with "
                f"{', '.join(f'{k}={v}' for k, v in sorted(env.items()))}), found {size}."
            )
    for constraint in constraints:
        _check_constraint(constraint, env)
    return env


def _check_constraint(constraint: str, env: Mapping[str, int]) -> None:
    for op, test in ((">=", int.__ge__), ("<=", int.__le__), ("==", int.__eq__)):
        if op in constraint:
            left, right = constraint.split(op, 1)
            a, b = evaluate(left.strip(), env), evaluate(right.strip(), env)
            if not test(a, b):
                raise InputError(
                    f"The inputs violate the exported shape constraint {constraint!r} "
                    f"({left.strip()} = {a}, {right.strip()} = {b})."
                )
            return
    raise ValueError(f"unsupported shape constraint {constraint!r}")
