"""The ``JAXEXP_*`` registry: every variable the package names is registered, only
``settings.py`` reads the environment for one, and a bad value is refused by name."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxexp_mlflow import errors, settings

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "jaxexp_mlflow"
NAME = re.compile(r"JAXEXP_[A-Z0-9_]+")
#: reads of the environment whose key is a variable the scan cannot resolve, checked by hand:
#: (module, key) -> what the key is
UNRESOLVED_OK = {("runtime/executables.py", "k"): "XLA_FLAGS, LIBTPU_INIT_ARGS"}


def _sources() -> dict[str, str]:
    return {
        str(p.relative_to(PACKAGE)): p.read_text(encoding="utf-8")
        for p in sorted(PACKAGE.rglob("*.py"))
    }


def _jaxexp_constants(sources: dict[str, str]) -> set[str]:
    """Names of module-level constants holding a ``JAXEXP_*`` name (``ENV_MAX_SHAPES``)."""
    names = set()
    for text in sources.values():
        for node in ast.parse(text).body:
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
                and node.value.value.startswith("JAXEXP_")
            ):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _is_environ(node: ast.AST) -> bool:
    """``os.environ`` or a bare ``environ``."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def environ_reads(text: str) -> list[tuple[int, ast.AST]]:
    """(line, key expression) of each read of one environment variable in ``text``:
    ``os.environ.get(k)``, ``os.getenv(k)``, ``os.environ[k]`` (not assigned), ``k in
    os.environ``."""
    reads = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if (
                isinstance(func, ast.Attribute)
                and func.attr == "get"
                and _is_environ(func.value)
                or isinstance(func, ast.Attribute)
                and func.attr == "getenv"
                or isinstance(func, ast.Name)
                and func.id == "getenv"
            ):
                reads.append((node.lineno, node.args[0]))
        elif (
            isinstance(node, ast.Subscript)
            and _is_environ(node.value)
            and isinstance(node.ctx, ast.Load)
        ):
            reads.append((node.lineno, node.slice))
        elif isinstance(node, ast.Compare) and any(
            isinstance(op, ast.In | ast.NotIn) for op in node.ops
        ):
            if any(_is_environ(c) for c in node.comparators):
                reads.append((node.lineno, node.left))
    return reads


def jaxexp_reads(module: str, text: str, constants: set[str]) -> list[str]:
    """The reads in ``text`` of a ``JAXEXP_*`` variable (or of a key the scan cannot tell)."""
    found = []
    for line, key in environ_reads(text):
        where = f"{module}:{line}"
        if isinstance(key, ast.Constant):
            if str(key.value).startswith("JAXEXP_"):
                found.append(f"{where} reads {key.value}")
        elif isinstance(key, ast.Attribute | ast.Name):
            name = key.attr if isinstance(key, ast.Attribute) else key.id
            if name in constants:
                found.append(f"{where} reads {name}")
            elif name.isupper():
                continue  # a constant holding another name (XDG_CACHE_HOME, ...)
            elif (module, name) not in UNRESOLVED_OK:
                found.append(f"{where} reads the environment with the key {name!r}")
        else:
            found.append(f"{where} reads the environment with a computed key")
    return found


def test_every_jaxexp_name_in_the_package_is_registered() -> None:
    product = {n for n, v in settings.REGISTRY.items() if v.group != "development"}
    missing = []
    for module, text in _sources().items():
        if module == "settings.py":
            continue
        for name in set(NAME.findall(text)):
            if name.endswith("_"):  # a prefix (``JAXEXP_MAX_``): some variable has it
                if not any(p.startswith(name) for p in product):
                    missing.append(f"{module}: prefix {name}")
            elif name not in product:
                missing.append(f"{module}: {name}")
    assert missing == []
    assert len(product) >= 45


def test_only_settings_reads_jaxexp_variables() -> None:
    sources = _sources()
    constants = _jaxexp_constants(sources)
    assert {"ENV_MAX_SHAPES", "ENV_BUCKETS", "ENV_MODEL_URI"} <= constants
    found = [
        hit
        for module, text in sources.items()
        if module != "settings.py"
        for hit in jaxexp_reads(module, text, constants)
    ]
    assert found == []


@pytest.mark.parametrize(
    "line",
    [
        'x = int(os.environ.get("JAXEXP_MAX_SHAPES", 64))',
        'x = os.getenv("JAXEXP_LITE")',
        "x = os.environ[ENV_MAX_SHAPES]",
        "x = ENV_BUCKETS in os.environ",
        "x = os.environ.get(serving_guard.ENV_MAX_INFLIGHT)",
        "x = os.environ.get(name)",
    ],
)
def test_the_scan_finds_a_direct_read(line: str) -> None:
    assert jaxexp_reads("m.py", line, {"ENV_MAX_SHAPES", "ENV_BUCKETS", "ENV_MAX_INFLIGHT"})


@pytest.mark.parametrize(
    "line",
    [
        'os.environ["JAXEXP_SERVE_MODEL_URI"] = "x"',
        'x = os.environ.get("XDG_CACHE_HOME")',
        "x = os.environ.get(ENV_OTHER)",
        "x = settings.JAXEXP_LITE.get()",
    ],
)
def test_the_scan_leaves_writes_and_other_variables_alone(line: str) -> None:
    assert jaxexp_reads("m.py", line, {"ENV_MAX_SHAPES"}) == []


def test_a_bad_number_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from jaxexp_mlflow.runtime import capacity

    monkeypatch.setenv("JAXEXP_MAX_SHAPES", "lots")
    with pytest.raises(errors.EnvVarError) as info:
        capacity.max_shapes()
    err = info.value
    assert (err.name, err.value, err.expected) == ("JAXEXP_MAX_SHAPES", "lots", "an integer")
    assert "JAXEXP_MAX_SHAPES='lots'" in err.message and "an integer" in err.message
    assert isinstance(err, ValueError) and isinstance(err, errors.JaxExpError)
    assert err.error_code == "INVALID_PARAMETER_VALUE"


def test_a_bad_float_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from jaxexp_mlflow.serving import serving_guard

    monkeypatch.setenv("JAXEXP_BODY_TIMEOUT_S", "1 minute")
    with pytest.raises(errors.EnvVarError, match=r"JAXEXP_BODY_TIMEOUT_S='1 minute'.*a number"):
        serving_guard.body_timeout()


def test_a_bad_limit_read_at_import_is_refused_naming_it() -> None:
    env = {**os.environ, "JAXEXP_MAX_BLOB_BYTES": "2GiB", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", "import jaxexp_mlflow.codec.files"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "EnvVarError" in proc.stderr and "JAXEXP_MAX_BLOB_BYTES='2GiB'" in proc.stderr


def test_unset_or_empty_numbers_give_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JAXEXP_MAX_SHAPES", raising=False)
    assert settings.JAXEXP_MAX_SHAPES.get() == 64
    assert not settings.JAXEXP_MAX_SHAPES.is_set()
    monkeypatch.setenv("JAXEXP_MAX_SHAPES", " ")
    assert settings.JAXEXP_MAX_SHAPES.get() == 64 and settings.JAXEXP_MAX_SHAPES.is_set()
    monkeypatch.setenv("JAXEXP_MAX_SHAPES", "3")
    assert settings.JAXEXP_MAX_SHAPES.get() == 3


def test_defaults_are_the_ones_the_modules_document() -> None:
    from jaxexp_mlflow.codec import arrays, files
    from jaxexp_mlflow.flavors import readback
    from jaxexp_mlflow.params import restore, save
    from jaxexp_mlflow.runtime import cache, capacity, lite
    from jaxexp_mlflow.serving import connections, serving_guard
    from jaxexp_mlflow.store import transfer

    s = settings
    assert s.JAXEXP_MAX_MLMODEL_BYTES.default == 1 << 20
    assert s.JAXEXP_MAX_BLOB_BYTES.default == 2 << 30
    assert s.JAXEXP_MAX_REFERENCE_BYTES.default == 1 << 30
    if not s.JAXEXP_MAX_BLOB_BYTES.is_set():
        assert files.MAX_BLOB_BYTES == 2 << 30 and arrays.MAX_REFERENCE_BYTES == 1 << 30
    expected = {
        s.JAXEXP_MAX_SHAPES: capacity.DEFAULT_MAX_SHAPES,
        s.JAXEXP_LITE_MAX_PARAM_BYTES: lite.DEFAULT_LITE_MAX_BYTES,
        s.JAXEXP_COMPILATION_CACHE_MAX_BYTES: cache.DEFAULT_MAX_BYTES,
        s.JAXEXP_FSYNC_THREADS: save.FSYNC_THREADS,
        s.JAXEXP_RESTORE_FLUSH_BYTES: restore.FLUSH_BYTES,
        s.JAXEXP_READBACK_RESTORE_MAX_BYTES: readback.RESTORE_MAX_BYTES,
        s.JAXEXP_TRANSFER_WORKERS: transfer.DEFAULT_WORKERS,
        s.JAXEXP_MAX_LIST_DEPTH: transfer.DEFAULT_MAX_LIST_DEPTH,
        s.JAXEXP_MAX_LIST_ENTRIES: transfer.DEFAULT_MAX_LIST_ENTRIES,
        s.JAXEXP_BODY_TIMEOUT_S: serving_guard.DEFAULT_BODY_TIMEOUT_S,
        s.JAXEXP_MAX_CONNECTIONS: connections.DEFAULT_MAX_CONNECTIONS,
        s.JAXEXP_HEADER_TIMEOUT_S: connections.DEFAULT_HEADER_TIMEOUT_S,
        s.JAXEXP_ISOLATE_MEMORY_BYTES: 4 << 30,
        s.JAXEXP_ISOLATE_TIMEOUT_S: 120.0,
    }
    assert {v.name: v.default for v in expected} == {v.name: d for v, d in expected.items()}
    for var, default in expected.items():
        assert type(var.default) is var.type and type(default) is var.type, var


def test_flags_keep_their_own_off_words(monkeypatch: pytest.MonkeyPatch) -> None:
    from jaxexp_mlflow.runtime import cpu_compile, lite

    for value, on in (("0", False), ("off", True), ("", True), ("1", True)):
        monkeypatch.setenv("JAXEXP_CRC32C_NATIVE", value)
        assert settings.JAXEXP_CRC32C_NATIVE.get() is on, value
    for value, on in ((" Off ", False), ("false", False), ("no", False), ("yes", True)):
        monkeypatch.setenv("JAXEXP_LITE", value)
        assert lite.enabled() is on, value
    monkeypatch.setenv("JAXEXP_CPU_YNN_CHOICE", "false")  # its off words: 0, off, no
    assert cpu_compile.enabled() is True
    monkeypatch.setenv("JAXEXP_CPU_YNN_CHOICE", "no")
    assert cpu_compile.enabled() is False


def test_every_variable_is_described_and_grouped() -> None:
    for name, var in settings.REGISTRY.items():
        assert name == var.name and name.startswith("JAXEXP_")
        assert getattr(settings, name) is var
        assert var.group in settings.GROUPS
        assert var.description.endswith(".") and "\n" not in var.description
    dev = {n for n, v in settings.REGISTRY.items() if v.group == "development"}
    assert {"JAXEXP_GPU_TESTS_ON_CPU", "JAXEXP_STAGES", "JAXEXP_PARALLEL"} <= dev


def test_settings_imports_no_third_party_module_and_refuses_without_mlflow() -> None:
    code = (
        "import sys\n"
        "sys.modules['mlflow'] = None\n"  # importing MLflow fails, as in the docs venv
        "from jaxexp_mlflow import settings\n"
        "heavy = [m for m in ('jax', 'numpy', 'mlflow', 'yaml') if sys.modules.get(m)]\n"
        "assert heavy == [], heavy\n"
        "import os\n"
        "os.environ['JAXEXP_MAX_SHAPES'] = 'x'\n"
        "try:\n"
        "    settings.JAXEXP_MAX_SHAPES.get()\n"
        "except settings.BadEnvVarError as err:\n"
        "    print(type(err).__name__, err.name)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["BadEnvVarError", "JAXEXP_MAX_SHAPES"]


def test_the_docs_hook_lists_every_variable_without_the_package() -> None:
    path = REPO / "docs" / "hooks" / "env_reference.py"
    spec = importlib.util.spec_from_file_location("env_reference", path)
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)

    class Page:
        class file:  # noqa: N801  (MkDocs' page.file.src_uri)
            src_uri = hook.PAGE

    page = (REPO / "docs" / hook.PAGE).read_text(encoding="utf-8")
    text = hook.on_page_markdown(page, Page())
    rows = re.findall(r"^\| `(JAXEXP_[A-Z0-9_]+)` \|", text, flags=re.M)
    assert rows == list(settings.REGISTRY)
    assert "| `JAXEXP_MAX_BLOB_BYTES` | int | 2 GiB (`2147483648`) | at import |" in text
