"""The private MLflow names jaxexp uses (``jaxexp_mlflow.internals.mlflow_private``).

(a) Each name of ``PRIVATE_NAMES`` is either in the installed MLflow or reported missing by
name; with ``JAXEXP_STRICT_PRIVATE=1`` a missing one fails, naming it. Either way its fallback
is taken once the name is gone (removed here with monkeypatch). (b) Each fallback gives what
the private path gives, including a ``models:/`` model logged and loaded through a real
``mlflow server`` with the private names of the transfer removed.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import mlflow
import numpy as np
import pytest

import jaxexp_mlflow
from jaxexp_mlflow.internals import mlflow_private as mp

STRICT = os.environ.get("JAXEXP_STRICT_PRIVATE") == "1"
#: names a release removed and whose fallback was checked against that release: expected absent
#: from that version on (strict mode does not fail for them)
GONE_SINCE = {
    "mlflow.store.artifact.models_artifact_repo:"
    "ModelsArtifactRepository._add_registered_model_meta_file": "3.18.0",
}


def _vkey(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


PACKAGE = Path(jaxexp_mlflow.__file__).parent
#: Files that still use a private MLflow name directly (owned elsewhere; to be routed through
#: mlflow_private). A new direct use anywhere else fails test_no_private_name_outside_module.
NOT_YET_ROUTED: set[str] = set()


@pytest.fixture(autouse=True)
def _fresh_record(monkeypatch):
    """Each test sees only the fallbacks it took itself."""
    monkeypatch.setattr(mp, "_taken", set())


def _owner_and_attr(name: str) -> tuple[object, str]:
    module, _, qual = name.partition(":")
    owner_path, _, attr = qual.rpartition(".")
    owner = mp.lookup(f"{module}:{owner_path}") if owner_path else sys.modules.get(module)
    if owner is None:
        import importlib

        owner = importlib.import_module(module)
    return owner, attr


def remove(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Make ``name`` vanish from MLflow for this test (no-op if it already has)."""
    owner, attr = _owner_and_attr(name)
    if attr in vars(owner):
        monkeypatch.delattr(owner, attr)


def hide(monkeypatch: pytest.MonkeyPatch, names: list[str]) -> None:
    """Make ``names`` invisible to mlflow_private only, as in an MLflow release that renamed
    them: MLflow's own code (which calls them) keeps working."""
    private, member = mp._private, mp._member

    def _private(name):
        return mp._fallback(name) if name in names else private(name)

    def _member(obj, name):
        return mp._fallback(name) if name in names else member(obj, name)

    monkeypatch.setattr(mp, "_private", _private)
    monkeypatch.setattr(mp, "_member", _member)


class PublicOnly:
    """An artifact repository reduced to its public methods (no ``_download_file``)."""

    def __init__(self, repo):
        self.inner = repo
        self.artifact_uri = repo.artifact_uri

    def list_artifacts(self, path=None):
        return self.inner.list_artifacts(path)

    def download_artifacts(self, artifact_path, dst_path=None):
        return self.inner.download_artifacts(artifact_path, dst_path)


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _local_repo(tmp_path: Path):
    from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository

    store = tmp_path / "store"
    (store / "m" / "sub").mkdir(parents=True)
    (store / "m" / "MLmodel").write_text("flavors: {}\n")
    (store / "m" / "sub" / "c.0.0").write_bytes(os.urandom(5000))
    return LocalArtifactRepository(str(store))


def _http_repo():
    from mlflow.store.artifact.http_artifact_repo import HttpArtifactRepository

    return HttpArtifactRepository("http://127.0.0.1:9/api/2.0/mlflow-artifacts/artifacts/1/x")


def _models_repo():
    """A ``ModelsArtifactRepository`` for ``models:/m/1`` (not connected to a registry)."""
    from mlflow.store.artifact.models_artifact_repo import ModelsArtifactRepository

    repo = ModelsArtifactRepository.__new__(ModelsArtifactRepository)
    repo.model_name, repo.model_version = "m", "1"
    return repo


DOWNLOAD_FILE = "mlflow.store.artifact.artifact_repo:ArtifactRepository._download_file"
META = (
    "mlflow.store.artifact.models_artifact_repo:ModelsArtifactRepository."
    "_add_registered_model_meta_file"
)


def _example() -> dict[str, np.ndarray]:
    f = np.array([[1.5, np.nan], [0.1, -2.0]], np.float32)
    return {"x": f, "n": np.array([1, 2, 3], np.int32), "mask": np.array([True, False])}


#: One call of each name's wrapper (small, local), for the "fallback taken" check.
EXERCISE = {
    DOWNLOAD_FILE: lambda t: mp.download_file(
        _local_repo(t) if mp.present(DOWNLOAD_FILE) else PublicOnly(_local_repo(t)),
        "m/MLmodel",
        t / "MLmodel",
    ),
    META: lambda t: mp.add_registered_model_meta(_models_repo(), t),
    f"{mp._HTTP_REPO}._host_creds": lambda t: mp.host_creds(_http_repo()),
    "mlflow.tracking.artifact_utils:_get_root_uri_and_artifact_path": lambda t: (
        mp.root_uri_and_artifact_path("models:/m/1")
    ),
    "mlflow.tracking._model_registry:DEFAULT_AWAIT_MAX_SLEEP_SECONDS": lambda t: (
        mp.await_registration_default()
    ),
    "mlflow.utils.requirements_utils:_get_pinned_requirement": lambda t: mp.pinned_requirement(
        "numpy"
    ),
    f"{mp._ENV}:_mlflow_conda_env": lambda t: mp.mlflow_conda_env(["numpy"]),
    f"{mp._ENV}:_process_pip_requirements": lambda t: mp.process_pip_requirements(["numpy"]),
    f"{mp._ENV}:_process_conda_env": lambda t: mp.process_conda_env(
        {"dependencies": [{"pip": ["numpy"]}]}
    ),
    f"{mp._ENV}:_validate_env_arguments": lambda t: mp.validate_env_arguments(None, None, None),
    f"{mp._ENV}:_PythonEnv": lambda t: mp.write_python_env(t / "python_env.yaml"),
    f"{mp._ENV}:_CONDA_ENV_FILE_NAME": lambda t: mp.env_file_names(),
    f"{mp._ENV}:_REQUIREMENTS_FILE_NAME": lambda t: mp.env_file_names(),
    f"{mp._ENV}:_CONSTRAINTS_FILE_NAME": lambda t: mp.env_file_names(),
    f"{mp._ENV}:_PYTHON_ENV_FILE_NAME": lambda t: mp.env_file_names(),
    f"{mp._MODEL_UTILS}:_validate_and_copy_code_paths": lambda t: mp.copy_code_paths(
        [str(Path(mp.__file__))], str(t)
    ),
    "mlflow.models.utils:_save_example": lambda t: mp.save_input_example(
        mlflow.models.Model(), _example(), t
    ),
}


def test_every_name_has_an_exercise():
    assert set(EXERCISE) == set(mp.PRIVATE_NAMES)
    for name, entry in mp.PRIVATE_NAMES.items():
        assert all(entry), name
        assert re.fullmatch(r"mlflow[\w.]*:[\w.]+", name), name


@pytest.mark.parametrize("name", sorted(mp.PRIVATE_NAMES))
def test_private_name_in_installed_mlflow(name, monkeypatch, tmp_path):
    """(a) present, or reported missing by name (a failure with JAXEXP_STRICT_PRIVATE=1); the
    fallback is taken once the name is gone."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    here = mp.present(name)
    assert (name in mp.missing()) is (not here)
    known_gone = name in GONE_SINCE and _vkey(mlflow.__version__) >= _vkey(GONE_SINCE[name])
    if not here and STRICT and not known_gone:
        pytest.fail(
            f"MLflow {mlflow.__version__} no longer has {name}: jaxexp now takes its fallback "
            f"({mp.PRIVATE_NAMES[name].fallback}). Check that the fallback still does the job "
            "and update docs/internals.md."
        )
    if here:
        (tmp_path / "private").mkdir()
        EXERCISE[name](tmp_path / "private")
        assert name not in mp.fallbacks_taken()
    remove(monkeypatch, name)
    assert not mp.present(name)
    assert name in mp.missing()
    (tmp_path / "fallback").mkdir()
    EXERCISE[name](tmp_path / "fallback")
    assert name in mp.fallbacks_taken()


def _both(monkeypatch, names, fn):
    """``fn()`` with the private names, then with them removed: both results."""
    with_private = fn()
    with monkeypatch.context() as m:
        for name in names:
            remove(m, name)
        without = fn()
        assert set(names) <= mp.fallbacks_taken()
    return with_private, without


# --------------------------------------------------------------------------------------------
# (b) each fallback gives what the private path gives


def test_root_uri_and_artifact_path_fallback(monkeypatch):
    uris = [
        "models:/m/1",
        "models:/m/1/sub/dir",
        "models:/m@champion",
        "models:/m-abc123",
        "runs:/abc/model",
        "s3://bucket/a/b/model",
        "gs://bucket/p",
        "mlflow-artifacts://host:5000/1/abc/artifacts/model",
        "mlflow-artifacts:/1/abc/artifacts/model",
        "http://h:5000/api/2.0/mlflow-artifacts/artifacts/x/model",
        "file:///nonexistent/x/y",
    ]
    name = "mlflow.tracking.artifact_utils:_get_root_uri_and_artifact_path"
    a, b = _both(monkeypatch, [name], lambda: [mp.root_uri_and_artifact_path(u) for u in uris])
    assert a == b


def test_download_file_fallback(tmp_path):
    repo = _local_repo(tmp_path)
    for i, target in enumerate((repo, PublicOnly(repo))):
        out = tmp_path / f"out{i}"
        out.mkdir()
        mp.download_file(target, "m/sub/c.0.0", out / "c.0.0")
        mp.download_file(target, "m/MLmodel", out / "MLmodel")
    assert _tree(tmp_path / "out0") == _tree(tmp_path / "out1")
    assert sorted(_tree(tmp_path / "out1")) == ["MLmodel", "c.0.0"]  # no temp dir left


def test_host_creds_fallback(monkeypatch):
    name = f"{mp._HTTP_REPO}._host_creds"
    a, b = _both(monkeypatch, [name], lambda: vars(mp.host_creds(_http_repo())))
    assert a == b


def test_flavor_helpers_fallback(monkeypatch):
    names = [
        "mlflow.tracking._model_registry:DEFAULT_AWAIT_MAX_SLEEP_SECONDS",
        "mlflow.utils.requirements_utils:_get_pinned_requirement",
        f"{mp._ENV}:_mlflow_conda_env",
        f"{mp._ENV}:_CONDA_ENV_FILE_NAME",
        f"{mp._ENV}:_REQUIREMENTS_FILE_NAME",
        f"{mp._ENV}:_CONSTRAINTS_FILE_NAME",
        f"{mp._ENV}:_PYTHON_ENV_FILE_NAME",
    ]
    pkgs = ["jax", "jaxlib", "flatbuffers", "orbax-checkpoint", "numpy", "mlflow", "numpy[x]"]

    def run():
        pins = [mp.pinned_requirement(p) for p in pkgs]
        envs = [mp.mlflow_conda_env(pins[:2]), mp.mlflow_conda_env(pins, install_mlflow=False)]
        return mp.await_registration_default(), pins, envs, mp.env_file_names()

    a, b = _both(monkeypatch, names, run)
    assert a == b


def test_validate_env_arguments_fallback(monkeypatch):
    name = f"{mp._ENV}:_validate_env_arguments"
    for _ in range(2):
        mp.validate_env_arguments(None, ["numpy"], None)
        with pytest.raises(ValueError, match="Only one of"):
            mp.validate_env_arguments({"dependencies": []}, None, ["numpy"])
        remove(monkeypatch, name)
    assert name in mp.fallbacks_taken()


def test_requirements_fallback(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_SKIP_PIP_REQUIREMENTS_CHECK", "true")
    (tmp_path / "cons.txt").write_text("numpy<3\n# pinned\nscipy<2  # inline\n")
    (tmp_path / "more.txt").write_text("pandas\n-c cons.txt\n")
    (tmp_path / "reqs.txt").write_text("numpy\n-r more.txt\n")
    default = ["jax==0.10.2", "numpy==2.4.6"]
    conda = {
        "name": "x",
        "channels": ["conda-forge"],
        "dependencies": ["python=3.11", {"pip": ["numpy", "-c cons.txt"]}],
    }
    names = [f"{mp._ENV}:_process_pip_requirements", f"{mp._ENV}:_process_conda_env"]

    def run():
        return [
            mp.process_pip_requirements(list(default)),
            mp.process_pip_requirements(None, ["numpy", "mlflow", "-c cons.txt"]),
            mp.process_pip_requirements(list(default), None, ["numpy", "scipy[io]>=1"]),
            mp.process_pip_requirements(None, str(tmp_path / "reqs.txt")),
            mp.process_conda_env(dict(conda)),
            mp.process_conda_env({"dependencies": ["python=3.11"]}),
        ]

    a, b = _both(monkeypatch, names, run)
    assert a == b


def test_python_env_and_code_paths_fallback(monkeypatch, tmp_path):
    src = tmp_path / "src"
    (src / "pkg" / "__pycache__").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("x = 1\n")
    (src / "pkg" / "__pycache__" / "mod.pyc").write_bytes(b"\0")
    (src / "single.py").write_text("y = 2\n")
    names = [f"{mp._ENV}:_PythonEnv", f"{mp._MODEL_UTILS}:_validate_and_copy_code_paths"]
    outs = iter([tmp_path / "a", tmp_path / "b"])

    def run():
        out = next(outs)
        out.mkdir()
        mp.write_python_env(out / "python_env.yaml")
        sub = mp.copy_code_paths([str(src / "pkg"), str(src / "single.py")], str(out))
        assert mp.copy_code_paths(None, str(out)) is None
        return sub, _tree(out)

    a, b = _both(monkeypatch, names, run)
    assert a == b
    assert "code/pkg/mod.py" in a[1] and not any("__pycache__" in k for k in a[1])


def test_save_input_example_fallback(monkeypatch, tmp_path):
    name = "mlflow.models.utils:_save_example"
    outs = iter([tmp_path / "a", tmp_path / "b"])

    def run():
        out, model = next(outs), mlflow.models.Model()
        out.mkdir()
        mp.save_input_example(model, _example(), out)
        return model.saved_input_example_info, _tree(out)

    a, b = _both(monkeypatch, [name], run)
    assert a == b
    assert sorted(a[1]) == ["input_example.json", "serving_input_example.json"]


# --------------------------------------------------------------------------------------------
# a models:/ model through a real `mlflow server`, private names of the transfer removed


def _apply(params, x):
    return x @ params["w"][:4] + params["b"]


@pytest.fixture(scope="module")
def server(tracking_server):
    """The session's ``mlflow server`` (tests/conftest.py), its URL."""
    return tracking_server[0]


def test_remote_models_uri_without_private_names(server, tmp_path, monkeypatch):
    """Log and load ``models:/`` through a real server with
    ``_add_registered_model_meta_file`` removed (as in MLflow 3.18) and ``_host_creds``,
    ``_download_file`` hidden from
    jaxexp (MLflow's own code still calls them): the same files as with them (less MLflow
    3.17's ``registered_model_meta``), the same outputs."""
    from mlflow.store.artifact.models_artifact_repo import ModelsArtifactRepository

    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    monkeypatch.setenv("MLFLOW_ENABLE_PROXY_MULTIPART_UPLOAD", "false")
    monkeypatch.setenv("JAXEXP_READBACK_RESTORE_MAX_BYTES", str(2**20))
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((2**17, 4), np.float32)), "b": jnp.ones(4)}
    x = np.ones((2, 4), np.float32)
    fn = jax.jit(_apply)
    meta = META
    upload_names = [f"{mp._HTTP_REPO}._host_creds"]
    mlflow.set_tracking_uri(server)
    try:
        mlflow.set_experiment("private-names")
        with monkeypatch.context() as m:
            hide(m, upload_names)
            with mlflow.start_run():
                mlflow.jaxexp.log_model(
                    fn, name="m", params=params, input_example=x, registered_model_name="pn"
                )
        want = np.asarray(_apply(params, x))

        private = tmp_path / "private"
        model = mlflow.jaxexp.load_model("models:/pn/1", dst_path=str(private))
        np.testing.assert_array_equal(model(x), want)
        metas = [p for p in private.rglob("registered_model_meta")]
        assert len(metas) == int(mp.present(meta))

        fallback = tmp_path / "fallback"
        with monkeypatch.context() as m:
            remove(m, meta)  # really gone (MLflow 3.18): only our download called it
            assert not hasattr(ModelsArtifactRepository, "_add_registered_model_meta_file")
            hide(m, [DOWNLOAD_FILE])
            model = mlflow.jaxexp.load_model("models:/pn/1", dst_path=str(fallback))
            np.testing.assert_array_equal(model(x), want)
            model = mlflow.jaxexp.load_model("models:/pn/1")  # private temp download
            np.testing.assert_array_equal(model(x), want)
        assert {meta, DOWNLOAD_FILE} <= mp.fallbacks_taken()
        got, expected = _tree(fallback), _tree(private)
        for p in metas:
            expected.pop(p.relative_to(private).as_posix())
        assert "MLmodel" in {Path(k).name for k in got}
        assert got == expected
    finally:
        mlflow.set_tracking_uri(None)


# --------------------------------------------------------------------------------------------
# the module is the only place that touches a private MLflow name


def test_no_private_name_outside_module():
    attrs = {
        n.partition(":")[2].rpartition(".")[2] for n in [*mp.PRIVATE_NAMES, *mp.REPLACED_BY_PUBLIC]
    }
    uses = re.compile(
        r"\bfrom mlflow[\w.]* import [^(]*\b_[A-Za-z]\w*|\bmlflow(\.\w+)*\._[a-z]\w*|"
        + "|".join(rf"[.\"']{re.escape(a)}\b" for a in sorted(attrs))
    )
    grouped = re.compile(r"\bfrom mlflow[\w.]* import \(([^)]*)\)")
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "internals/mlflow_private.py" or rel in NOT_YET_ROUTED:
            continue
        text = path.read_text()
        for block in grouped.finditer(text):
            names = [n.strip() for n in block.group(1).replace("\n", ",").split(",")]
            if any(n.startswith("_") for n in names):
                found.append(f"{rel}: {block.group(0)}")
        for i, line in enumerate(text.splitlines(), 1):
            code = line.split("#", 1)[0]
            if uses.search(code) and "mlflow_private" not in code:
                found.append(f"{rel}:{i}: {line.strip()}")
    assert not found, "private MLflow names outside internals/mlflow_private.py:\n" + "\n".join(
        found
    )
