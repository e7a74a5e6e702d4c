"""Score a Spark DataFrame with a jaxexp model on Spark's Arrow path (``DataFrame.mapInArrow``).

``predict(df, model_uri)`` returns ``df`` with one column per model output. Built on Spark's
public API only: the model directory is archived on the driver and shipped with
``SparkContext.addFile`` (Spark copies it to every executor; once per application and model
content, however often ``predict`` is called), each executor unpacks it once
into its own Spark files directory (removed with the application), each Python worker loads it
once (``serving.pyfunc.load_pyfunc``: checksums, verdict, params), and every Arrow
record batch goes Arrow list column -> numpy (one reshape of the values buffer, no per-row
Python) -> the input contract (names, shapes, dtypes, lossless casts: the same
``InputError`` messages as every other door) -> the model -> Arrow list arrays built on the
output buffers.

The outputs are what ``mlflow.pyfunc.load_model(uri).predict`` returns on the same rows (a
classifier's labels included). ``mlflow.pyfunc.spark_udf`` works too (docs/serving/spark.md); this
path skips the pandas cells and Python lists that MLflow's pandas UDF converts each result through.
Classic Spark only (``SparkContext.addFile``: not Spark Connect).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import shutil
import tarfile
import tempfile
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from jaxexp_mlflow.errors import InputError, UnsupportedModelError

DEFAULT_OUTPUT = "prediction"
_ARROW_BATCH_CONF = "spark.sql.execution.arrow.maxRecordsPerBatch"

# The archive's suffix: not ``.tar``/``.tar.gz``/``.tgz``, which ``SparkContext.addFile`` untars
# (deprecated Spark behaviour) straight into the executor's shared files directory.
_ARCHIVE_SUFFIX = ".jaxexp-model"

# numpy dtype (after the output's wire cast) -> (pyspark.sql.types class, numpy dtype Spark reads)
_SPARK_TYPES = {
    "bool": ("BooleanType", "bool"),
    "int8": ("ByteType", "int8"),
    "int16": ("ShortType", "int16"),
    "int32": ("IntegerType", "int32"),
    "int64": ("LongType", "int64"),
    "uint8": ("ShortType", "int16"),
    "uint16": ("IntegerType", "int32"),
    "uint32": ("LongType", "int64"),
    "float16": ("FloatType", "float32"),
    "float32": ("FloatType", "float32"),
    "float64": ("DoubleType", "float64"),
}


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What each Python worker needs: picklable, small (the model travels as a Spark file)."""

    archive: str  # the file name given to SparkContext.addFile
    names: tuple[str, ...]  # the model's input names, in order
    columns: tuple[str, ...]  # the DataFrame column of each input
    outputs: tuple[tuple[str, str], ...]  # (output column, numpy dtype Spark reads)
    classifier: bool  # labels as pyfunc gives them (the single output's logits turned to labels)
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

    Array inputs are Spark ``array`` columns (nested once per dimension after the batch one).
    Lazy like any DataFrame transformation: a bad cell (a ragged row, a wrong width, a lossy
    cast) fails the Spark job that reads it, with the contract's ``InputError`` text in the
    ``PythonException`` Spark raises; column names and types are checked here, before any job.

    Args:
        df: the Spark DataFrame to score (classic Spark, not Spark Connect).
        model_uri: any model URI MLflow understands (``runs:/``, ``models:/``, a local path).
        columns: the column of each input, by position (a list) or by input name (a dict);
            default: the column named like each input (a model with one input also takes a
            DataFrame of one column, whatever its name).
        output_cols: the names of the new columns (default: ``prediction`` for a single
            output, else the output names; a classifier gives one column of labels).
        model_config: as for ``mlflow.pyfunc.load_model`` (buckets: powers of two up to Spark's
            Arrow batch size by default).
        keep_columns: keep ``df``'s columns beside the outputs; False returns the outputs only.

    Returns:
        A DataFrame with ``df``'s columns (unless ``keep_columns=False``) and one column per
            output, computed when a Spark action reads it.

    Raises:
        UnsupportedModelError: the model records no input/output specs, or takes no inputs.
        InputError: a column is missing, has a type the input cannot take, or an output column
            name already exists in ``df``.
    """
    from pyspark.sql.types import StructField, StructType

    from jaxexp_mlflow.serving import signature as sig
    from jaxexp_mlflow.store.download import download_model
    from jaxexp_mlflow.store.section import read_section

    spark = df.sparkSession
    download = download_model(model_uri, None, skip=("code",))
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
        if not in_specs:
            raise UnsupportedModelError(
                "This model takes no inputs (a function of its params only): there are no "
                "rows to score. Call mlflow.pyfunc.load_model(uri).predict(None) once instead."
            )
        cols = _input_columns(in_specs, list(df.columns), columns)
        _check_column_types(in_specs, cols, df.schema)
        classifier = conf.get("classifier")
        if classifier:
            out_fields = [_classifier_field(classifier, output_cols)]
            out_types = [(out_fields[0].name, "")]
        else:
            names = _output_names(out_specs, output_cols)
            out_fields, out_types = [], []
            for spec, name in zip(out_specs, names, strict=True):
                spark_type, np_type = _spark_type(spec)
                out_fields.append(StructField(name, spark_type))
                out_types.append((name, np_type))
        keep = list(df.columns) if keep_columns else []
        clash = sorted(set(keep) & {f.name for f in out_fields})
        if clash:
            raise InputError(
                f"The output columns {clash} already exist in the DataFrame: expected new "
                "names. Pass output_cols=[...] or keep_columns=False."
            )
        config = dict(model_config or {})
        batch_rows = int(spark.conf.get(_ARROW_BATCH_CONF, "10000") or 10000)
        if batch_rows > 0:
            config.setdefault("max_batch", batch_rows)
        archive = _shipped(spark.sparkContext, local)
    finally:
        if download.ours and download.tmp:
            shutil.rmtree(download.tmp, ignore_errors=True)
    plan = _Plan(
        archive=archive,
        names=tuple(s.name for s in in_specs),
        columns=tuple(cols),
        outputs=tuple(out_types),
        classifier=bool(classifier),
        model_config=tuple(sorted(config.items())),
        keep=tuple(keep),
    )
    kept = [f for f in df.schema.fields if f.name in keep]
    return df.mapInArrow(functools.partial(_score_batches, plan), StructType([*kept, *out_fields]))


# -- the driver: columns, types, the archive -----------------------------------------------------


def _input_columns(specs: list[Any], found: list[str], columns: Any) -> list[str]:
    """The DataFrame column of each input, checked (the contract's by-name/by-position rule)."""
    from jaxexp_mlflow.serving.inputs import InputContract

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
    from pyspark.sql.types import ArrayType, BooleanType, DecimalType, NumericType

    from jaxexp_mlflow.serving.signature import input_error

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
        if not isinstance(dtype, NumericType | BooleanType) or isinstance(dtype, DecimalType):
            raise input_error(
                spec,
                f"column '{col}' of {dtype.simpleString()} values",
                "Send numbers (integer, float or boolean columns; cast decimals).",
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


def _classifier_field(classifier: dict[str, Any], output_cols: list[str] | None) -> Any:
    """The one column of a classifier's labels (``long`` indices or ``string`` labels)."""
    from pyspark.sql.types import LongType, StringType, StructField

    if output_cols is not None and len(output_cols) != 1:
        raise InputError(
            f"output_cols: expected 1 name (a classifier gives one column of labels), found "
            f"{list(output_cols)[:8]}."
        )
    labels = classifier.get("labels") if isinstance(classifier, dict) else None
    if labels and not all(isinstance(v, str) for v in labels):
        if any(isinstance(v, str) for v in labels) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in labels
        ):
            raise UnsupportedModelError(
                f"This classifier's labels {list(labels)[:6]} are neither all strings nor all "
                "integers: Spark needs one column type. Use mlflow.pyfunc.spark_udf with a "
                "result_type."
            )
    kind = StringType() if labels and isinstance(labels[0], str) else LongType()
    return StructField(output_cols[0] if output_cols else DEFAULT_OUTPUT, kind)


def _spark_type(spec: Any) -> tuple[Any, str]:
    """The Spark SQL type of an output column and the numpy dtype its values take."""
    from pyspark.sql import types as T  # noqa: N812

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
    type_name, np_type = found
    spark_type = getattr(T, type_name)()
    for _ in spec.shape[1:]:
        spark_type = T.ArrayType(spark_type)
    return spark_type, np_type


# (Spark application id, model content) -> the archive name shipped with addFile: calling
# predict again on the same model ships nothing new, and the Python workers keep the model they
# loaded (and the buckets they compiled)
_SHIPPED: dict[tuple, str] = {}
_SHIPPED_LOCK = threading.Lock()


def _shipped(sc: Any, model_dir: Path) -> str:
    """The name of the archive of ``model_dir`` shipped to ``sc``'s executors (shipped now if
    this application has not received the same model content before)."""
    from jaxexp_mlflow.serving.pyfunc import model_identity

    # the sha256 of the MLmodel, of the blob and of the params manifest (which has the params'
    # checksums): not the path, a new temporary directory on every download
    key = (sc.applicationId, model_identity(model_dir, {})[1:4])
    with _SHIPPED_LOCK:
        name = _SHIPPED.get(key)
        if name is None:
            archive = _archive(model_dir)
            sc.addFile(str(archive))
            name = _SHIPPED[key] = archive.name
        return name


def _archive(model_dir: Path) -> Path:
    """The model directory as one uncompressed tar (no ``code/``: jaxexp never runs a model's
    code), under a name Spark ships as it is (see ``_ARCHIVE_SUFFIX``)."""
    out = Path(tempfile.mkdtemp(prefix="jaxexp-spark-")) / f"model-{uuid.uuid4().hex}"
    out = out.with_name(out.name + _ARCHIVE_SUFFIX)
    with tarfile.open(out, "w") as tar:
        for entry in sorted(model_dir.iterdir()):
            if entry.name != "code":
                tar.add(entry, arcname=entry.name, recursive=True)
    # the driver serves the file to executors for the application's life, which ends with
    # this process at the latest
    atexit.register(shutil.rmtree, out.parent, True)
    return out


# -- the Python workers ---------------------------------------------------------------------------

# (archive name, model_config) -> the loaded JaxExpPyfunc, once per process; a long-lived Python
# worker keeps the last few
_WORKER: OrderedDict[tuple, Any] = OrderedDict()
_WORKER_SIZE = 4
_WORKER_LOCK = threading.Lock()


def _worker_model(plan: _Plan) -> Any:
    """The model of ``plan``, unpacked once per executor and loaded once per Python worker."""
    key = (plan.archive, repr(plan.model_config))
    with _WORKER_LOCK:
        impl = _WORKER.get(key)
        if impl is None:
            from jaxexp_mlflow.serving.pyfunc import load_pyfunc

            impl = load_pyfunc(_unpacked(plan.archive), dict(plan.model_config))
            _WORKER[key] = impl
            while len(_WORKER) > _WORKER_SIZE:
                _WORKER.popitem(last=False)
        else:
            _WORKER.move_to_end(key)
        return impl


def _unpacked(archive: str) -> Path:
    """The directory of the model shipped as ``archive``, unpacked next to it.

    In the executor's Spark files directory (Spark removes it with the application; a Python
    worker ends with ``os._exit``, so nothing registered with ``atexit`` would ever run there).
    The Python workers of one executor share one copy: each unpacks into a private directory
    and renames it into place; the first rename wins, the others remove theirs.
    """
    from pyspark import SparkFiles

    source = Path(SparkFiles.get(archive))
    target = source.with_name(source.name + ".d")
    if (target / "MLmodel").is_file():
        return target
    staging = Path(tempfile.mkdtemp(prefix=f".{source.name}-", dir=source.parent))
    try:
        with tarfile.open(source) as tar:
            _extract(tar, staging)
        try:
            os.rename(staging, target)
        except OSError:  # another worker of this executor was first
            if not (target / "MLmodel").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _extract(tar: tarfile.TarFile, target: Path) -> None:
    """Extract the regular files and directories of ``tar`` into ``target``, nothing else."""
    members = tar.getmembers()
    for m in members:
        parts = Path(m.name).parts
        if not (m.isfile() or m.isdir()) or Path(m.name).is_absolute() or ".." in parts:
            raise UnsupportedModelError(
                f"The shipped model archive holds {m.name!r} ({m.type!r}): expected the "
                "regular files of a model directory. Was the file replaced after addFile?"
            )
    if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4: checked twice
        tar.extractall(target, members=members, filter="data")
    else:
        tar.extractall(target, members=members)


def _score_batches(plan: _Plan, batches: Iterator[Any]) -> Iterator[Any]:
    """mapInArrow's function: each record batch in, the same rows with the outputs out."""
    import pyarrow as pa

    impl = _worker_model(plan)
    specs = {s.name: s for s in impl.inputs}
    names = [*plan.keep, *(name for name, _ in plan.outputs)]
    for batch in batches:
        if batch.num_rows == 0:
            continue
        data = {
            name: arrow_to_numpy(batch.column(col), specs[name], col)
            for name, col in zip(plan.names, plan.columns, strict=True)
        }
        outs = impl.run(impl.convert_inputs(data))
        arrays = [batch.column(c) for c in plan.keep]
        if plan.classifier:
            from jaxexp_mlflow.serving import classifier as classifier_mod

            arrays.append(pa.array(classifier_mod.apply(impl.classifier, outs[0], None)))
        else:
            for (_, np_type), spec, out in zip(plan.outputs, impl.outputs, outs, strict=True):
                wire = out.astype(spec.wire_dtype, copy=False)
                arrays.append(numpy_to_arrow(wire.astype(np_type, copy=False)))
        yield pa.RecordBatch.from_arrays(arrays, names=names)


def arrow_to_numpy(column: Any, spec: Any, name: str = "") -> np.ndarray:
    """An Arrow column of (nested) lists as one numpy array, without per-row Python.

    Each list level must hold the same number of values in every row (the offsets are checked
    vectorised); nulls are refused. The result keeps Arrow's dtype: the input contract casts.

    Args:
        column: a ``pyarrow`` Array or ChunkedArray of numbers or of (nested) lists of them.
        spec: the input's spec, named in the error.
        name: the column's name, named in the error.

    Returns:
        An array of shape ``[rows, width, ...]``, one dimension per list level.

    Raises:
        InputError: null cells or values, or rows of different lengths (a ragged array).
    """
    import pyarrow as pa

    from jaxexp_mlflow.serving.signature import input_error

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
    """A numpy array ``[n, ...]`` as an Arrow array of ``n`` (nested) lists, on its buffer.

    Args:
        values: the array; its first dimension becomes the rows.

    Returns:
        A ``pyarrow`` array of ``n`` values (1-d input) or of ``n`` lists nested once per
            dimension after the first.
    """
    import pyarrow as pa

    out = pa.array(np.ascontiguousarray(values).reshape(-1))
    for level in range(values.ndim - 1, 0, -1):
        count, width = int(np.prod(values.shape[:level])), values.shape[level]
        offsets = pa.array(np.arange(count + 1, dtype=np.int32) * np.int32(width))
        out = pa.ListArray.from_arrays(offsets, out, type=pa.list_(pa.field("element", out.type)))
    return out
