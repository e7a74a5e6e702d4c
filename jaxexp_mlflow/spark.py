"""Score a Spark DataFrame with a jaxexp model on Spark's Arrow path (``DataFrame.mapInArrow``).

``predict(df, model_uri)`` returns ``df`` with one column per model output. Built on Spark's
public API only: the model directory is archived on the driver and shipped with
``SparkContext.addFile`` (Spark copies it to every executor), each Python worker unpacks and
loads it once (``flavors.pyfunc.load_pyfunc``: checksums, verdict, params), and every Arrow
record batch goes Arrow list column -> numpy (one reshape of the values buffer, no per-row
Python) -> the input contract (names, shapes, dtypes, lossless casts: the same ``InputError``\\ s
as every other door) -> the model -> Arrow list arrays built on the output buffers.

``mlflow.pyfunc.spark_udf`` works too (docs/serving.md); this path skips the pandas cells and
Python lists that MLflow's pandas UDF converts each result through.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import shutil
import tarfile
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from jaxexp_mlflow.errors import InputError, UnsupportedModelError

DEFAULT_OUTPUT = "prediction"
_ARROW_BATCH_CONF = "spark.sql.execution.arrow.maxRecordsPerBatch"

# numpy dtype (after the output's wire cast) -> (Spark SQL type name, numpy dtype Spark reads)
_SPARK_TYPES = {
    "bool": ("boolean", "bool"),
    "int8": ("byte", "int8"),
    "int16": ("short", "int16"),
    "int32": ("int", "int32"),
    "int64": ("long", "int64"),
    "uint8": ("short", "int16"),
    "uint16": ("int", "int32"),
    "uint32": ("long", "int64"),
    "float16": ("float", "float32"),
    "float32": ("float", "float32"),
    "float64": ("double", "float64"),
}


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What each Python worker needs: picklable, small (the model travels as a Spark file)."""

    archive: str  # the file name given to SparkContext.addFile
    names: tuple[str, ...]  # the model's input names, in order
    columns: tuple[str, ...]  # the DataFrame column of each input
    outputs: tuple[tuple[str, str], ...]  # (output column, numpy dtype Spark reads)
    model_config: tuple[tuple[str, Any], ...]
    keep: tuple[str, ...]  # input DataFrame columns passed through


def predict(
    df: Any,
    model_uri: str,
    *,
    columns: list[str] | dict[str, str] | None = None,
    output_cols: list[str] | None = None,
    model_config: dict[str, Any] | None = None,
    keep_columns: bool = True,
) -> Any:
    """``df`` scored by the jaxexp model at ``model_uri``: its columns plus one per output.

    ``columns``: the column of each input, by position (a list) or by input name (a dict);
    default: the column named like each input (a model with one input also takes a DataFrame
    of one column, whatever its name). Array inputs are Spark ``array`` columns (nested once per
    dimension after the batch one). ``output_cols``: the names of the new columns (default:
    ``prediction`` for a single output, else the output names). ``model_config``: as for
    ``mlflow.pyfunc.load_model`` (buckets: powers of two up to Spark's Arrow batch size by
    default). ``keep_columns=False`` returns the output columns only.
    """
    from jaxexp_mlflow import transfer
    from jaxexp_mlflow.flavors import signature as sig
    from jaxexp_mlflow.flavors.section import read_section

    spark = df.sparkSession
    download = transfer.download_model(model_uri, None, skip=("code",))
    local = Path(download.path)
    try:
        conf = read_section(local)
        specs = sig.specs_from_conf(conf)
        if specs is None:
            raise UnsupportedModelError(
                "This model records no input/output specs (MLmodel 'io', written by save_model "
                "since jaxexp-mlflow 0.1), which the Spark path needs to declare its columns. "
                "Run `jaxexp refresh` on it once, or use mlflow.pyfunc.spark_udf."
            )
        in_specs, out_specs = specs
        cols = _input_columns(in_specs, list(df.columns), columns)
        _check_column_types(in_specs, cols, df.schema)
        names = _output_names(out_specs, output_cols)
        keep = [c for c in df.columns] if keep_columns else []
        clash = sorted(set(keep) & set(names))
        if clash:
            raise InputError(
                f"The output columns {clash} already exist in the DataFrame: expected new "
                "names. Pass output_cols=[...] or keep_columns=False."
            )
        out_fields, out_types = [], []
        for spec, name in zip(out_specs, names, strict=True):
            spark_type, np_type = _spark_type(spec)
            out_fields.append(f"`{name}` {spark_type}")
            out_types.append((name, np_type))
        config = dict(model_config or {})
        batch_rows = int(spark.conf.get(_ARROW_BATCH_CONF, "10000") or 10000)
        if batch_rows > 0:
            config.setdefault("max_batch", batch_rows)
        archive = _archive(local)
    finally:
        if download.ours and download.tmp:
            shutil.rmtree(download.tmp, ignore_errors=True)
    spark.sparkContext.addFile(str(archive))
    plan = _Plan(
        archive=archive.name,
        names=tuple(s.name for s in in_specs),
        columns=tuple(cols),
        outputs=tuple(out_types),
        model_config=tuple(sorted(config.items())),
        keep=tuple(keep),
    )
    kept = [f"`{f.name}` {f.dataType.simpleString()}" for f in df.schema.fields if f.name in keep]
    return df.mapInArrow(functools.partial(_score_batches, plan), ", ".join([*kept, *out_fields]))


# -- the driver: columns, types, the archive -----------------------------------------------------


def _input_columns(specs: list[Any], found: list[str], columns: Any) -> list[str]:
    """The DataFrame column of each input, checked (the contract's by-name/by-position rule)."""
    from jaxexp_mlflow.flavors.inputs import InputContract

    names = [s.name for s in specs]
    expected = InputContract(specs).expected()
    if isinstance(columns, dict):
        unknown = [k for k in columns if k not in names]
        if unknown:
            raise InputError(
                f"Rule: columns maps input names to DataFrame columns. Found unknown inputs "
                f"{unknown[:8]}. Expected: {expected}."
            )
        cols = [columns.get(n, n) for n in names]
    elif columns is not None:
        cols = list(columns)
        if len(cols) != len(names):
            raise InputError(
                f"Rule: columns lists one DataFrame column per input, by position. Found "
                f"{len(cols)} for {len(names)} inputs. Expected: {expected}."
            )
    elif len(names) == 1 and names[0] not in found and len(found) == 1:
        cols = found  # one input, one column: by position
    else:
        cols = names
    missing = [c for c in cols if c not in found]
    if missing:
        raise InputError(
            f"Rule: every input by its signature name (or by position). Found missing "
            f"{missing[:8]} among the DataFrame columns {found[:12]}. Expected: {expected}. "
            "Pass columns=[...] to name them."
        )
    return cols


def _check_column_types(specs: list[Any], cols: list[str], schema: Any) -> None:
    """Refuse, before any job runs, columns whose nesting or element type cannot fit."""
    from pyspark.sql.types import ArrayType, BooleanType, NumericType

    from jaxexp_mlflow.flavors.signature import input_error

    for spec, col in zip(specs, cols, strict=True):
        dtype = schema[col].dataType
        depth = 0
        while isinstance(dtype, ArrayType):
            depth, dtype = depth + 1, dtype.elementType
        want = len(spec.shape) - 1
        if depth != want:
            raise input_error(
                spec,
                f"column '{col}' of {schema[col].dataType.simpleString()} ({depth} array levels)",
                f"Send a column with {want} array level(s) around the numbers.",
            )
        if not isinstance(dtype, NumericType | BooleanType):
            raise input_error(
                spec, f"column '{col}' of {dtype.simpleString()} values", "Send numbers."
            )


def _output_names(specs: list[Any], output_cols: list[str] | None) -> list[str]:
    if output_cols is not None:
        if len(output_cols) != len(specs) or len(set(output_cols)) != len(output_cols):
            raise InputError(
                f"output_cols: expected {len(specs)} distinct names (one per output: "
                f"{[s.name for s in specs][:8]}), found {list(output_cols)[:8]}."
            )
        return list(output_cols)
    return [DEFAULT_OUTPUT] if len(specs) == 1 else [s.name for s in specs]


def _spark_type(spec: Any) -> tuple[str, str]:
    """The Spark SQL type of an output column and the numpy dtype its values take."""
    if not spec.shape or spec.shape[0] is not None:
        raise UnsupportedModelError(
            f"Output '{spec.name}' has shape {list(spec.shape)}: expected a leading batch "
            "dimension (one row per input row). Use mlflow.pyfunc.spark_udf with a result_type "
            "for models without one."
        )
    found = _SPARK_TYPES.get(np.dtype(spec.wire_dtype).name)
    if found is None:
        raise UnsupportedModelError(
            f"Output '{spec.name}' is {spec.wire_dtype}: expected a type Spark has (bool, "
            "int8-64, uint8-32, float16-64). Use mlflow.pyfunc.spark_udf for this model."
        )
    spark_type, np_type = found
    for _ in spec.shape[1:]:
        spark_type = f"array<{spark_type}>"
    return spark_type, np_type


def _archive(model_dir: Path) -> Path:
    """A tar of the model directory (no ``code/``: jaxexp never runs a model's code)."""
    out = Path(tempfile.mkdtemp(prefix="jaxexp-spark-")) / f"jaxexp-model-{uuid.uuid4().hex}.tar"
    with tarfile.open(out, "w") as tar:
        for entry in sorted(model_dir.iterdir()):
            if entry.name != "code":
                tar.add(entry, arcname=entry.name, recursive=True)
    atexit.register(shutil.rmtree, out.parent, True)
    return out


# -- the Python workers ---------------------------------------------------------------------------

_WORKER: dict[str, Any] = {}  # archive name -> the loaded JaxExpPyfunc, once per process
_WORKER_LOCK = threading.Lock()


def _worker_model(plan: _Plan) -> Any:
    """The model of ``plan``, unpacked and loaded once in this Python worker."""
    with _WORKER_LOCK:
        impl = _WORKER.get(plan.archive)
        if impl is None:
            from pyspark import SparkFiles

            from jaxexp_mlflow.flavors.pyfunc import load_pyfunc

            target = Path(tempfile.mkdtemp(prefix="jaxexp-spark-model-"))
            atexit.register(shutil.rmtree, target, True)
            with tarfile.open(SparkFiles.get(plan.archive)) as tar:
                tar.extractall(target, filter="data")  # no links out, no devices, no absolute
            impl = load_pyfunc(target, dict(plan.model_config))
            _WORKER[plan.archive] = impl
        return impl


def _score_batches(plan: _Plan, batches: Iterator[Any]) -> Iterator[Any]:
    """mapInArrow's function: each record batch in, the same rows with the outputs out."""
    import pyarrow as pa

    impl = _worker_model(plan)
    specs = {s.name: s for s in impl.inputs}
    for batch in batches:
        if batch.num_rows == 0:
            continue
        data = {
            name: arrow_to_numpy(batch.column(col), specs[name], col)
            for name, col in zip(plan.names, plan.columns, strict=True)
        }
        outs = impl.run(impl.convert_inputs(data))
        arrays = [batch.column(c) for c in plan.keep]
        for (_, np_type), spec, out in zip(plan.outputs, impl.outputs, outs, strict=True):
            wire = out.astype(spec.wire_dtype, copy=False)
            arrays.append(numpy_to_arrow(wire.astype(np_type, copy=False)))
        names = [*plan.keep, *(name for name, _ in plan.outputs)]
        yield pa.RecordBatch.from_arrays(arrays, names=names)


def arrow_to_numpy(column: Any, spec: Any, name: str = "") -> np.ndarray:
    """An Arrow column of (nested) lists as one numpy array, without per-row Python.

    Each list level must hold the same number of values in every row (the offsets are checked
    vectorised); nulls are refused. The result keeps Arrow's dtype: the input contract casts.
    """
    import pyarrow as pa

    from jaxexp_mlflow.flavors.signature import input_error

    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    shape = [len(arr)]
    while (
        pa.types.is_list(arr.type)
        or pa.types.is_large_list(arr.type)
        or (pa.types.is_fixed_size_list(arr.type))
    ):
        if arr.null_count:
            raise input_error(spec, f"null cells in column '{name}'", "Send no nulls.")
        if pa.types.is_fixed_size_list(arr.type):
            width = arr.type.list_size
        else:
            lengths = np.diff(np.asarray(arr.offsets))
            width = int(lengths[0]) if len(lengths) else 0
            if len(lengths) and not (lengths == width).all():
                raise input_error(
                    spec,
                    f"rows of different lengths in column '{name}' (a ragged array)",
                    "Send a rectangular array of numbers.",
                )
        shape.append(width)
        arr = arr.flatten()
    if arr.null_count:
        raise input_error(spec, f"null values in column '{name}'", "Send no nulls.")
    return arr.to_numpy(zero_copy_only=False).reshape(shape)


def numpy_to_arrow(values: np.ndarray) -> Any:
    """A numpy array ``[n, ...]`` as an Arrow array of ``n`` (nested) lists, on its buffer."""
    import pyarrow as pa

    out = pa.array(np.ascontiguousarray(values).reshape(-1))
    for level in range(values.ndim - 1, 0, -1):
        count, width = int(np.prod(values.shape[:level])), values.shape[level]
        offsets = pa.array(np.arange(count + 1, dtype=np.int32) * np.int32(width))
        out = pa.ListArray.from_arrays(offsets, out, type=pa.list_(pa.field("element", out.type)))
    return out
