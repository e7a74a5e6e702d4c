"""``jaxexp inspect``: everything the blob and MLmodel say about a model, without importing jax."""

from __future__ import annotations

import json
from typing import Any

import click

from jaxexp_mlflow.cli._common import (
    Command,
    InputProblem,
    common_options,
    emit_json,
    human_bytes,
    safe_text,
    setup_logging,
    table,
)
from jaxexp_mlflow.cli.uri import Target, resolve


def _custom_keys(node: Any) -> list | None:
    """The child keys of a dict-like custom node (Flax ``FrozenDict``, ``nnx.State``): its
    auxiliary data when that is a JSON list of one str/int key per child."""
    try:
        keys = json.loads(node.custom_auxdata or b"")
    except ValueError:
        return None
    if (
        isinstance(keys, list)
        and len(keys) == len(node.children)
        and all(isinstance(k, str | int) for k in keys)
    ):
        return keys
    return None


def leaf_paths(node: Any, prefix: str = "") -> list[str]:
    """Key paths of the leaves of a reader ``TreeNode`` (``[0]['w1']``), in flattening order.

    Dict-like custom nodes (keys in their auxiliary data) read like dicts, one-child wrappers
    (Flax variables) are left out of the path; other custom nodes show their class name.
    """
    kind = node.kind
    if kind == "leaf":
        return [prefix]
    if kind == "none":
        return []
    custom_keys = _custom_keys(node) if kind == "custom" else None
    out: list[str] = []
    for i, child in enumerate(node.children):
        if kind == "dict":
            key = (node.keys or ())[i] if i < len(node.keys or ()) else i
            out += leaf_paths(child, f"{prefix}[{key!r}]")
        elif custom_keys is not None:
            out += leaf_paths(child, f"{prefix}[{custom_keys[i]!r}]")
        elif kind == "custom" and len(node.children) == 1:
            out += leaf_paths(child, prefix)
        elif kind == "custom":
            short = str(node.custom_name).rpartition(".")[2]
            out += leaf_paths(child, f"{prefix}.<{short}>[{i}]")
        else:
            out += leaf_paths(child, f"{prefix}[{i}]")
    return out


def _io_names(flavor: dict[str, Any], side: str) -> list[str]:
    """The leaf names the MLmodel stores (``jaxexp.io``: the signature's names), else []."""
    io = flavor.get("io") or {}
    return [str(e.get("name")) for e in io.get(side) or []]


def param_path(name: str) -> str:
    """How a named param reads in the inputs table: ``params.l1.kernel``, ``params[0].w``."""
    return "params" + ("" if name.startswith("[") else ".") + name


def input_rows(
    desc: Any,
    n_param_leaves: int,
    names: list[str] | None = None,
    param_names: list[str] | None = None,
) -> list[dict[str, Any]]:
    """One row per flat input leaf: role (param/input/kwarg), signature name, key path, aval,
    sharding. ``param_names`` are the params names MLmodel records (models saved since named
    params): they make the params' paths."""
    root = desc.in_tree
    if root.kind == "tuple" and len(root.children) == 2:
        args, kwargs = root.children
        paths = leaf_paths(args, "args") + leaf_paths(kwargs, "kwargs")
    else:  # pragma: no cover - every writer stores (args, kwargs)
        paths = leaf_paths(root, "in")
    if not isinstance(param_names, list) or len(param_names) != n_param_leaves:
        param_names = None
    rows = []
    for i, aval in enumerate(desc.in_avals):
        path = paths[i] if i < len(paths) else f"in[{i}]"
        role = (
            "param" if i < n_param_leaves else ("kwarg" if path.startswith("kwargs") else "input")
        )
        if role == "param" and param_names is not None:
            path = param_path(str(param_names[i]))
        elif n_param_leaves and role == "param" and path.startswith("args[0]"):
            path = "params" + path[len("args[0]") :]
        shard = desc.in_shardings[i] if i < len(desc.in_shardings) else None
        k = i - n_param_leaves
        name = names[k] if names and 0 <= k < len(names) else None
        rows.append(
            {"index": i, "role": role, "name": name, "path": path, "aval": aval, "sharding": shard}
        )
    return rows


def output_rows(desc: Any, names: list[str] | None = None) -> list[dict[str, Any]]:
    """One row per flat output leaf: signature name, key path, aval, sharding."""
    paths = leaf_paths(desc.out_tree, "out")
    rows = []
    for i, aval in enumerate(desc.out_avals):
        shard = desc.out_shardings[i] if i < len(desc.out_shardings) else None
        path = paths[i] if i < len(paths) else f"out[{i}]"
        name = names[i] if names and i < len(names) else None
        rows.append({"index": i, "name": name, "path": path, "aval": aval, "sharding": shard})
    return rows


def signature_rows(mlmodel: dict[str, Any]) -> dict[str, list[dict[str, Any]]] | None:
    """The MLmodel signature as rows (name, type, shape) per side, or None when absent."""
    sig = mlmodel.get("signature")
    if not sig:
        return None
    out: dict[str, list[dict[str, Any]]] = {}
    for side in ("inputs", "outputs", "params"):
        raw = sig.get(side)
        if not raw:
            continue
        specs = json.loads(raw) if isinstance(raw, str) else raw
        rows = []
        for spec in specs:
            tensor = spec.get("tensor-spec") or {}
            rows.append(
                {
                    "name": spec.get("name"),
                    "type": tensor.get("dtype") or spec.get("type"),
                    "shape": tensor.get("shape", spec.get("shape")),
                    "default": spec.get("default"),
                }
            )
        out[side] = rows
    return out


def describe(target: Target) -> dict[str, Any]:
    """The JSON-able report of ``jaxexp inspect`` (also used by ``check``)."""
    from jaxexp_mlflow.codec.reader import BlobFormatError

    blob_path = target.blob_path
    try:
        desc = target.description  # read and parsed once for the command
    except FileNotFoundError as err:
        raise InputProblem(f"the model's blob {blob_path} is missing") from err
    except (BlobFormatError, OSError) as err:
        recorded = target.flavor.get("exported_sha256") if target.kind != "blob" else None
        damaged = ""
        if recorded and "blob_data" in target.__dict__:
            import hashlib

            if hashlib.sha256(target.blob_data).hexdigest() != recorded:
                damaged = (
                    " and does not match the sha256 recorded in MLmodel (truncated or altered): "
                    "download the model again or restore it from a backup"
                )
        raise InputProblem(
            f"{blob_path} is not a valid jax.export serialization ({err}){damaged}; expected "
            "the bytes of Exported.serialize()"
        ) from err
    flavor = target.flavor
    recorded = flavor.get("exported_sha256")
    n_params = int(flavor.get("n_param_leaves") or 0)
    params_format = flavor.get("params_format") or {}
    mlmodel_info = {
        k: target.mlmodel.get(k)
        for k in ("run_id", "model_id", "utc_time_created", "mlflow_version", "model_size_bytes")
        if target.mlmodel.get(k) is not None
    }
    return {
        "uri": target.uri,
        "kind": target.kind,
        "path": str(target.path),
        "remote": target.remote,
        "mlmodel": mlmodel_info,
        "flavor": flavor,
        "blob": desc.to_dict(),
        "checksum": {
            "recorded": recorded,
            "found": desc.sha256,
            "ok": None if not recorded else recorded == desc.sha256,
        },
        "params": (
            None
            if not flavor.get("params")
            else {"path": flavor.get("params"), "n_leaves": n_params, **params_format}
        ),
        "inputs": input_rows(
            desc, n_params, _io_names(flavor, "inputs"), flavor.get("param_names")
        ),
        "outputs": output_rows(desc, _io_names(flavor, "outputs")),
        "signature": signature_rows(target.mlmodel),
        "reference": flavor.get("reference"),
    }


def _kv(rows: list[tuple[str, Any]]) -> str:
    """``key  value`` lines; each value on one line (model strings: :func:`safe_text`)."""
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {safe_text(v)}" for k, v in rows)


def render(report: dict[str, Any]) -> str:
    """The human-readable summary."""
    blob, flavor = report["blob"], report["flavor"]
    jax_v = flavor.get("jax_version")
    if jax_v:
        exporter = f"jax {jax_v}, jaxlib {flavor.get('jaxlib_version')}"
    elif report["kind"] == "model":
        exporter = "unknown (logged as bytes; a blob does not record the jax version)"
    else:
        exporter = "unknown (a blob does not record the jax version)"
    order = blob["vjp_order"]
    vjp = f"{order} (" + (
        f"can be differentiated up to {order} time(s) after loading)"
        if order
        else "not differentiable after loading)"
    )
    cc = blob.get("custom_call_targets")
    custom = (
        "unknown: " + str(blob.get("module_error")) if cc is None else (", ".join(cc) or "none")
    )
    sizes = (
        f"blob {human_bytes(blob['size'])} (StableHLO module {human_bytes(blob['module_size'])})"
    )
    if report["params"]:
        p = report["params"]
        sizes += (
            f", params {human_bytes(p.get('nbytes'))} in {p.get('num_arrays', p['n_leaves'])} "
            f"arrays ({p.get('format', 'orbax')}, compression {p.get('compression', '?')})"
        )
    if report["mlmodel"].get("model_size_bytes"):
        sizes += f", model {human_bytes(report['mlmodel']['model_size_bytes'])}"
    check = report["checksum"]
    sha = blob["sha256"][:16] + "..."
    if check["ok"] is True:
        sha += " (matches MLmodel)"
    elif check["ok"] is False:
        sha += f" MISMATCH: MLmodel records {check['recorded'][:16]}... (file altered)"
    rows: list[tuple[str, Any]] = [
        ("Source", report["uri"] + ("" if report["kind"] == "model" else "  (bare blob)")),
    ]
    m = report["mlmodel"]
    if m.get("run_id"):
        rows.append(("Run", m["run_id"]))
    if m.get("model_id"):
        rows.append(("Logged model", f"{m['model_id']}  (models:/{m['model_id']})"))
    if m.get("utc_time_created"):
        rows.append(
            ("Created", f"{m['utc_time_created']} UTC, mlflow {m.get('mlflow_version', '?')}")
        )
    rows += [
        ("Function", blob["fun_name"]),
        ("Exported by", exporter),
        ("StableHLO", f"{blob.get('stablehlo_producer') or '?'}"),
        (
            "Format",
            f"serialization v{blob['serialization_version']} (schema gen "
            f"{blob['schema_generation']}), calling convention "
            f"v{blob['calling_convention_version']}",
        ),
        ("Platforms", ", ".join(blob["platforms"])),
        ("Devices", blob["nr_devices"]),
        ("VJP order", vjp),
        ("Custom calls", custom),
        ("Sizes", sizes),
        ("sha256", sha),
    ]
    effects = list(blob.get("ordered_effects") or []) + list(blob.get("unordered_effects") or [])
    if effects:
        rows.append(("Effects", ", ".join(effects)))
    if blob.get("disabled_safety_checks"):
        rows.append(("Disabled checks", ", ".join(blob["disabled_safety_checks"])))
    ref = report["reference"]
    if report["kind"] == "model":
        rows.append(
            (
                "Reference",
                f"{len(ref['input_dtypes'])} input(s), {len(ref['output_dtypes'])} output(s) "
                "stored: `jaxexp verify` can reproduce them"
                if ref
                else "none (logged without input_example: nothing for `jaxexp verify`)",
            )
        )
    parts = [_kv(rows), ""]
    sharded = any(r["sharding"] for r in report["inputs"] + report["outputs"])
    headers = ["#", "role", "name", "path", "aval"] + (["sharding"] if sharded else [])
    parts.append("Inputs (from the blob)")
    parts.append(
        table(
            headers,
            [
                [r["index"], r["role"], r["name"] or "", r["path"], r["aval"]]
                + ([r["sharding"]] if sharded else [])
                for r in report["inputs"]
            ],
        )
    )
    parts.append("")
    parts.append("Outputs (from the blob)")
    parts.append(
        table(
            ["#", "name", "path", "aval"] + (["sharding"] if sharded else []),
            [
                [r["index"], r["name"] or "", r["path"], r["aval"]]
                + ([r["sharding"]] if sharded else [])
                for r in report["outputs"]
            ],
        )
    )
    sig = report["signature"]
    if sig:
        for side in ("inputs", "outputs", "params"):
            if side in sig:
                parts.append("")
                parts.append(f"Signature {side} (MLmodel)")
                parts.append(
                    table(
                        ["name", "type", "shape"],
                        [[r["name"] or "-", r["type"], r["shape"]] for r in sig[side]],
                    )
                )
    elif report["kind"] == "model":
        parts.append("")
        parts.append("Signature: none in MLmodel (the avals above are the contract)")
    return "\n".join(parts)


@click.command(
    cls=Command,
    epilog="""\b
Examples:
  jaxexp inspect runs:/0f3c.../model
  jaxexp inspect models:/classifier@best --json
  jaxexp inspect path/to/exported.bin
""",
)
@click.argument("uri")
@common_options
def inspect(uri: str, as_json: bool, debug: bool) -> None:
    """Describe a jaxexp model or a bare jax.export blob, without loading JAX.

    URI is a model URI (runs:/, models:/name/version, models:/name@alias, models:/<model_id>),
    a local model directory or a serialized blob file. Only MLmodel and the blob are downloaded.
    """
    setup_logging(debug)
    target = resolve(uri, parts=())
    report = describe(target)
    if as_json:
        emit_json(report)
    else:
        click.echo(render(report))
    if report["checksum"]["ok"] is False:
        raise InputProblem(
            f"{target.blob_path} does not match the sha256 recorded in MLmodel; the file was "
            "altered or truncated: download the model again or restore it from a backup"
        )


def output_labels(target: Any, n: int) -> list[str]:
    """The labels of ``n`` output leaves, as ``predict`` shows them: the signature's output
    names where MLmodel stores them, else the leaf paths of the blob's output tree, else
    ``out[i]``."""
    from jaxexp_mlflow.serving.signature import specs_from_conf

    try:
        stored = specs_from_conf(target.flavor or {}) if target.kind != "blob" else None
        if stored is not None:
            paths = [s.name for s in stored[1]]
        else:
            paths = leaf_paths(target.description.out_tree, "out")
    except Exception:  # noqa: BLE001 - labels only
        paths = []
    return paths if len(paths) == n else [f"out[{i}]" for i in range(n)]
