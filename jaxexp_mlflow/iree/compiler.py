"""Compile a StableHLO module with the IREE compiler, through a per-user cache of ``.vmfb`` files.

The cache key is the sha256 of (module sha256, IREE compiler and runtime versions, target,
flags, host CPU): a ``.vmfb`` is only valid for the IREE release that wrote it and, with
``--iree-llvmcpu-target-cpu=host``, for this kind of CPU. A hit costs reading the file and a
sha256 of it; the compiler is imported only on a miss.

Each entry (``<key>.entry``) is a header line, a JSON line ``{"key", "sha256", "size"}`` and the
``.vmfb`` bytes. It is verified before the runtime sees it: its key must be the one looked up
(an entry copied or renamed from another module is refused), its size and the sha256 of its bytes
those it records. A damaged or truncated entry is discarded with a warning and the module
recompiled; it is never run (damaged ``.vmfb`` files made IREE produce wrong outputs, SIGILL,
SIGSEGV). Entries are written to a temporary file, synced, then renamed into place, so a crash
never leaves a partial entry under a key; the verified bytes are loaded from memory (never
mapped: a file rewritten under a mapping ends the process with SIGBUS).

Settings, first match wins (as ``runtime.cache`` for JAX's cache):

1. ``iree_cache`` in the pyfunc ``model_config`` / the ``iree_cache=`` load option (``false``
   or a directory);
2. the environment variable ``JAXEXP_IREE_CACHE`` (``0``/``off`` turns it off, else a directory);
3. ``$XDG_CACHE_HOME/jaxexp-mlflow/iree`` (``~/.cache/jaxexp-mlflow/iree``).

A directory must be absolute (a relative one is refused, never resolved against the working
directory). Every entry carries an HMAC under this user's secret (``runtime/cache_auth.py``):
one planted, renamed or copied from another machine is discarded and compiled again.

Flags: ``--iree-input-demote-f64-to-f32=false`` keeps float64 (IREE demotes it by default);
``--iree-llvmcpu-target-cpu=host`` uses the CPU's vector units; by default also ``SPEED_FLAGS``
(matmul operands packed to the CPU's tile layout, IREE's mmt4d kernels: large batches ~2x
faster), plus those of ``JAXEXP_IREE_FLAGS``. A module with one symbolic dimension (the batch)
also gets an :class:`Entry`: a second exported function, ``main`` with that dimension set to 1,
which IREE compiles with static shapes (a batch-1 call ~2x faster; ``model.batch1_entry``).
An entry named ``specialize.STATIC`` instead replaces ``main``: the module is specialized to the
entry's static shapes before it is compiled (``specialize``: the route of symbolic-batch
modules IREE cannot compile as they are), and has no fallback without it.

Fallback: iree-compile runs as a subprocess (``iree.compiler.compile_str``), so a crash of it is
an error here. The attempts, in order: speed flags with the entry; base flags with the entry;
base flags alone (the module as it was always compiled). A failed attempt other than the last is
logged and recorded in the cache (``<key>.failed``, keyed like an entry), so it is not retried at
every load; clearing the cache retries it. ``JAXEXP_IREE_SPEED=0`` compiles with the base flags
alone. All flags and the entry are part of the cache key: entries compiled otherwise are not read.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxexp_mlflow import settings
from jaxexp_mlflow.errors import IncompatibleError
from jaxexp_mlflow.iree import roundings, specialize
from jaxexp_mlflow.runtime import cache as cache_settings
from jaxexp_mlflow.runtime import cache_auth

_logger = logging.getLogger(__name__)

ENV_VAR = "JAXEXP_IREE_CACHE"
#: Extra compiler flags, space-separated (e.g. ``--iree-opt-level=O3``: see docs/longevity.md).
ENV_FLAGS = "JAXEXP_IREE_FLAGS"
#: ``0``/``off``: no speed flags and no batch-1 entry (the base flags alone).
ENV_SPEED = "JAXEXP_IREE_SPEED"
TARGET = "llvm-cpu"
FLAGS = ("--iree-input-demote-f64-to-f32=false", "--iree-llvmcpu-target-cpu=host")
#: On by default, with a fallback: a batch-1024 MLP call ~2x faster, but iree-compile 3.13
#: crashes (SIGSEGV) on some models with them (eqx_attention of tests/models_real.py).
SPEED_FLAGS = ("--iree-opt-data-tiling", "--iree-llvmcpu-enable-ukernels=all")


@dataclass(frozen=True)
class Entry:
    """An extra exported function ``name``: ``main`` called with the static argument shapes
    ``inputs`` (one per argument of ``main``), returning ``outputs``."""

    name: str
    inputs: tuple[tuple[int, ...], ...]
    outputs: tuple[tuple[int, ...], ...]
    #: for a ``specialize.STATIC`` entry: the positions of ``main``'s arguments made module
    #: parameters (``specialize.bind_arguments``: the params, packed once at load)
    bound: tuple[int, ...] = ()


class EntryError(Exception):
    """The module's ``main`` does not take the arguments an :class:`Entry` describes."""


def _extra_flags() -> tuple[str, ...]:
    return tuple(settings.JAXEXP_IREE_FLAGS.get().split())


def speed_on() -> bool:
    """Whether the speed flags and the batch-1 entry are tried (``JAXEXP_IREE_SPEED``)."""
    return settings.JAXEXP_IREE_SPEED.get()


def active_flags() -> tuple[str, ...]:
    """The compiler flags tried first: :data:`FLAGS`, :data:`SPEED_FLAGS` (unless
    ``JAXEXP_IREE_SPEED=0``), those of ``JAXEXP_IREE_FLAGS``."""
    return FLAGS + (SPEED_FLAGS if speed_on() else ()) + _extra_flags()


def base_flags() -> tuple[str, ...]:
    """The fallback flags: :data:`FLAGS` plus those of ``JAXEXP_IREE_FLAGS``."""
    return FLAGS + _extra_flags()


def attempts(
    flags: tuple[str, ...] | None, entry: Entry | None
) -> list[tuple[tuple[str, ...], Entry | None]]:
    """The compiles to try in order, as ``(flags, entry)``: with explicit ``flags`` those (with,
    then without the entry); else speed flags, then base flags, with, then without the entry. A
    ``specialize.STATIC`` entry is never dropped (the module does not compile without it)."""
    if entry is not None and entry.name == specialize.STATIC:  # no module without the entry
        chosen = [flags] if flags is not None else [active_flags(), base_flags()]
        plans = [(f, entry) for f in chosen]
    elif flags is not None:
        plans = [(flags, entry), (flags, None)]
    elif not speed_on():
        plans = [(base_flags(), None)]
    else:
        plans = [(active_flags(), entry), (base_flags(), entry), (base_flags(), None)]
    out: list[tuple[tuple[str, ...], Entry | None]] = []
    for plan in plans:
        if plan not in out:
            out.append(plan)
    return out


def versions() -> dict[str, str | None]:
    """Installed versions of the IREE compiler and runtime packages."""
    out: dict[str, str | None] = {}
    for name in ("iree-base-compiler", "iree-base-runtime"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def cache_key(module: bytes, flags: tuple[str, ...] = FLAGS, entry: Entry | None = None) -> str:
    """The cache key of ``module`` compiled with ``flags`` (and ``entry``) by the IREE here."""
    facts: dict[str, Any] = {
        "module_sha256": hashlib.sha256(module).hexdigest(),
        "iree": versions(),
        "target": TARGET,
        "flags": list(flags),
        "host": cache_settings.host_cpu(),
        "roundings": roundings.VERSION,
    }
    if entry is not None:
        facts["entry"] = [
            entry.name,
            [list(s) for s in entry.inputs],
            [list(s) for s in entry.outputs],
        ]
        if entry.bound:
            facts["entry"].append(list(entry.bound))
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def compile_module(
    module: bytes, flags: tuple[str, ...] = FLAGS, entry: Entry | None = None
) -> bytes:
    """Compile StableHLO (portable artifact or MLIR bytecode/text) to an IREE ``.vmfb``; with
    ``entry``, one that also exports it. A failure of the compiler is an ``IncompatibleError``."""
    import iree.compiler as ic

    try:
        return _compile(module, flags, entry)
    except (ic.CompilerToolError, EntryError, specialize.SpecializeError) as err:
        raise IncompatibleError(
            "The IREE compiler could not compile this model's StableHLO module: expected a "
            f"module IREE {versions()['iree-base-compiler']} supports, it said:\n"
            f"{str(err)[:2000]}\nLoad it with the JAX backend (backend='jax')."
        ) from None


def _compile(module: bytes, flags: tuple[str, ...], entry: Entry | None) -> bytes:
    """iree-compile (a subprocess) on ``module``; with ``entry``, in two runs: to IREE's input
    dialects, then, with the entry added, from there to the ``.vmfb``."""
    import iree.compiler as ic

    options = {"target_backends": [TARGET], "input_type": "stablehlo"}
    if entry is not None and entry.name == specialize.STATIC:
        text = specialize.static_main(module, entry.inputs, entry.outputs, entry.bound)
        return bytes(ic.compile_str(text, **options, extra_args=list(flags)))
    source = specialize.rounded_text(module)  # narrowing converts keep their rounding
    if entry is None:
        return bytes(ic.compile_str(source, **options, extra_args=list(flags)))
    text = ic.compile_str(source, **options, extra_args=[*flags, "--compile-to=input"])
    try:
        text = add_entry(bytes(text).decode(), entry)
    except EntryError:
        raise
    except Exception as err:  # the MLIR bindings' errors: the entry is dropped, not the model
        raise EntryError(f"adding the entry {entry.name}: {type(err).__name__}: {err}") from None
    return bytes(ic.compile_str(text, **options, extra_args=[*flags, "--compile-from=input"]))


def add_entry(text: str, entry: Entry) -> str:
    """The module ``text`` (IREE's input dialects, as ``--compile-to=input`` prints it) with
    ``entry`` added: a public function casting its static arguments to ``main``'s types, calling
    ``main`` and casting the results back; IREE inlines the call and specializes the shapes."""
    from iree.compiler import ir

    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(text)
        main = _function(module, "main")
        ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
        ins = _static_types(list(ftype.inputs), entry.inputs, "argument")
        outs = _static_types(list(ftype.results), entry.outputs, "result")
        arg_attrs = _attr_list(main, "arg_attrs", len(ins))
        res_attrs = _attr_list(main, "res_attrs", len(outs))
    params = ", ".join(
        f"%a{i}: {s}{a}" for i, ((_, s), a) in enumerate(zip(ins, arg_attrs, strict=True))
    )
    results = ", ".join(f"{s}{a}" for (_, s), a in zip(outs, res_attrs, strict=True))
    lines = [f"util.func public @{entry.name}({params}) -> ({results}) {{"]
    args = []
    for i, (t, s) in enumerate(ins):
        args.append(f"%c{i}")
        lines.append(f"  %c{i} = tensor.cast %a{i} : {s} to {t}")
    n = len(outs)
    call = f"util.call @main({', '.join(args)}) : ({', '.join(t for t, _ in ins)}) -> "
    lines.append(f"  %r{f':{n}' if n > 1 else ''} = {call}({', '.join(t for t, _ in outs)})")
    for i, (t, s) in enumerate(outs):
        lines.append(f"  %s{i} = tensor.cast %r{f'#{i}' if n > 1 else ''} : {t} to {s}")
    lines.append(
        f"  util.return {', '.join(f'%s{i}' for i in range(n))} : {', '.join(s for _, s in outs)}"
    )
    lines.append("}")
    end = text.rstrip().rfind("}")
    out = text[:end] + "\n".join(lines) + "\n}\n"
    with ir.Context():
        try:
            ir.Module.parse(out)  # verified here: an error names the entry, not iree-compile
        except Exception as err:  # MLIRError
            raise EntryError(f"the entry {entry.name} does not verify: {str(err)[:500]}") from None
    return out


def _function(module: Any, name: str) -> Any:
    """The ``util.func`` op ``name`` of ``module``; else ``EntryError``."""
    from iree.compiler import ir

    for op in module.body.operations:
        op = op.operation
        if op.name == "util.func" and ir.StringAttr(op.attributes["sym_name"]).value == name:
            return op
    raise EntryError(f"no function {name} in the module")


def _static_types(types: list[Any], shapes: tuple[tuple[int, ...], ...], side: str) -> list:
    """``(type, static type)`` strings of each tensor type with the shape of ``shapes``."""
    from iree.compiler import ir

    if len(types) != len(shapes):
        raise EntryError(f"main has {len(types)} {side}s, the entry {len(shapes)}")
    out = []
    dynamic = ir.ShapedType.get_dynamic_size()
    for t, shape in zip(types, shapes, strict=True):
        try:
            ranked = ir.RankedTensorType(t)
        except ValueError:
            raise EntryError(f"main's {side} type {t} is not a ranked tensor") from None
        dims = list(ranked.shape)
        if len(dims) != len(shape) or any(
            d not in (dynamic, s) for d, s in zip(dims, shape, strict=True)
        ):
            raise EntryError(f"main's {side} type {t} does not fit the shape {list(shape)}")
        static = ir.RankedTensorType.get(list(shape), ranked.element_type, ranked.encoding)
        out.append((str(t), str(static)))
    return out


def _attr_list(op: Any, name: str, n: int) -> list[str]:
    """The argument (or result) attribute dictionaries of ``op`` as `` {...}`` suffixes."""
    if name not in op.attributes:
        return [""] * n
    attrs = [str(a) for a in op.attributes[name]]
    if len(attrs) != n:
        raise EntryError(f"main's {name} has {len(attrs)} items, expected {n}")
    return ["" if a == "{}" else f" {a}" for a in attrs]


#: First line of every cache entry; a new format gets a new line (old entries are not read).
ENTRY_MAGIC = b"jaxexp-mlflow iree cache entry 2\n"
ENTRY_SUFFIX = ".entry"
_MAX_HEADER = 4096


class _Damaged(Exception):
    """A cache entry that does not verify (the message says how)."""


def pack_entry(key: str, vmfb: bytes) -> bytes:
    """The bytes of the cache entry of ``vmfb`` under ``key`` (header, then the ``.vmfb``).

    A ``.vmfb`` holds native code that the IREE runtime loads: the header records an HMAC of
    the entry's file name and module under this user's secret (``runtime/cache_auth.py``), so
    only an entry this user's process wrote for this key is ever loaded. ``OSError`` without a
    usable secret."""
    mac = cache_auth.tag(f"{key}{ENTRY_SUFFIX}", bytes(vmfb))
    if mac is None:
        raise PermissionError(f"no usable cache key ({cache_auth.key_path()})")
    header = {
        "key": key,
        "sha256": hashlib.sha256(vmfb).hexdigest(),
        "size": len(vmfb),
        "hmac": mac,
    }
    return ENTRY_MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + bytes(vmfb)


def unpack_entry(raw: bytes, key: str) -> memoryview:
    """The ``.vmfb`` inside the cache entry ``raw``, verified; ``_Damaged`` says what is wrong."""
    if not raw.startswith(ENTRY_MAGIC):
        raise _Damaged(f"no entry header ({len(raw)} bytes)")
    end = raw.find(b"\n", len(ENTRY_MAGIC), len(ENTRY_MAGIC) + _MAX_HEADER)
    if end < 0:
        raise _Damaged("header cut short")
    try:
        header = json.loads(raw[len(ENTRY_MAGIC) : end])
    except (ValueError, RecursionError):
        raise _Damaged("unreadable header") from None
    if not isinstance(header, dict):
        raise _Damaged("unreadable header")
    if header.get("key") != key:
        raise _Damaged(f"it records the key {str(header.get('key'))[:16]}..., another module's")
    payload = memoryview(raw)[end + 1 :]
    if header.get("size") != len(payload):
        raise _Damaged(f"expected {header.get('size')} bytes of module, found {len(payload)}")
    found = hashlib.sha256(payload).hexdigest()
    if header.get("sha256") != found:
        raise _Damaged(f"expected sha256 {header.get('sha256')}, found {found}")
    mac = cache_auth.signer(f"{key}{ENTRY_SUFFIX}")
    if mac is not None:
        mac.update(payload)
    if not isinstance(header.get("hmac"), str) or not cache_auth.matches(mac, header["hmac"]):
        raise _Damaged("no valid HMAC of this user's cache key: not written here for this key")
    return payload


def _read_entry(path: Path, key: str) -> memoryview | None:
    """The verified ``.vmfb`` stored at ``path``, or None (absent; damaged: removed, warned)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        _logger.warning("jaxexp: IREE cache entry %s unreadable (%s): recompiling", path, err)
        return None
    try:
        return unpack_entry(raw, key)
    except _Damaged as why:
        _logger.warning(
            "jaxexp: IREE cache entry %s is damaged (%s): discarded, recompiling the module",
            path,
            why,
        )
        try:
            path.unlink()
        except OSError:
            pass
        return None


def _write_entry(directory: Path, path: Path, key: str, vmfb: bytes) -> None:
    """Store ``vmfb`` at ``path`` atomically (:func:`_write_atomic`)."""
    _write_atomic(directory, path, pack_entry(key, vmfb))


def _write_atomic(directory: Path, path: Path, data: bytes) -> None:
    """Store ``data`` at ``path`` atomically: temporary file, fsync, rename."""
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: a concurrent reader sees the whole entry or none
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


#: First line of a failure marker: the compile under its key failed (not retried).
FAILED_MAGIC = b"jaxexp-mlflow iree compile failure 1\n"
FAILED_SUFFIX = ".failed"


def _failed_before(path: Path | None, key: str) -> bool:
    """Whether ``path`` is a failure marker recording ``key``."""
    if path is None:
        return False
    try:
        raw = path.read_bytes()[:_MAX_HEADER]
    except OSError:
        return False
    return raw.startswith(FAILED_MAGIC) and raw[len(FAILED_MAGIC) :].startswith(
        json.dumps({"key": key})[:-1].encode()
    )


def _record_failure(directory: Path | None, path: Path | None, key: str, why: str) -> None:
    """Record that the compile under ``key`` failed (a marker at ``path``), if there is a cache."""
    if directory is None or path is None:
        return
    body = json.dumps({"key": key, "error": why[:1000]}).encode()
    try:
        _write_atomic(directory, path, FAILED_MAGIC + body + b"\n")
    except OSError as err:
        _logger.warning("jaxexp: IREE cache disabled, cannot write %s: %s", directory, err)


def _cause(text: str) -> str:
    """The compiler's first diagnostic (``error:`` line, or a crash's signal) in ``text``."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for line in lines:
        if "error:" in line or "Segmentation fault" in line or "signal" in line.lower():
            return line[:300]
    return " / ".join(lines[1:3])[:300]


def compiled(
    module: bytes,
    *,
    cache: Any = None,
    flags: tuple[str, ...] | None = None,
    entry: Entry | None = None,
) -> bytes | memoryview:
    """The ``.vmfb`` for ``module``: from a verified cache entry, else compiled (and stored).

    ``cache`` is the setting described in the module docstring (None: env var, then default);
    ``flags`` default to :func:`active_flags` with the fallback to :func:`base_flags`;
    ``entry`` an extra function to export (dropped if its compile fails). The first of
    :func:`attempts` found in the cache or compiled is returned; failures are recorded, the
    last one raised (``IncompatibleError``).
    """
    directory = cache_settings.resolve(cache, env_var=ENV_VAR, kind="iree")
    if directory is not None and cache_auth.secret() is None:
        directory = None  # entries could be neither authenticated nor signed: no cache
    plans = attempts(flags, entry)
    for n, (plan_flags, plan_entry) in enumerate(plans, 1):
        key = cache_key(module, plan_flags, plan_entry)
        path = None if directory is None else directory / f"{key}{ENTRY_SUFFIX}"
        failed = None if directory is None else directory / f"{key}{FAILED_SUFFIX}"
        if path is not None:
            hit = _read_entry(path, key)
            if hit is not None:
                return hit
        if n < len(plans) and _failed_before(failed, key):
            continue
        try:
            vmfb = compile_module(module, plan_flags, plan_entry)
        except IncompatibleError as err:
            if n == len(plans):
                raise
            _logger.warning(
                "jaxexp: iree-compile failed on module sha256 %s with %s%s (%s); recorded, "
                "trying the next setting",
                hashlib.sha256(module).hexdigest()[:12],
                " ".join(plan_flags),
                f" and the entry {plan_entry.name}" if plan_entry else "",
                _cause(str(err)),
            )
            _record_failure(directory, failed, key, str(err))
            continue
        if path is not None:
            try:
                _write_entry(directory, path, key, vmfb)
            except OSError as err:
                _logger.warning("jaxexp: IREE cache disabled, cannot write %s: %s", directory, err)
        return vmfb
    raise AssertionError("unreachable: the last attempt returns or raises")
