"""Stored executables run only if this user's own process wrote them, for that very entry.

The hostile inputs: a model directory that points the compilation cache at a directory of its
own (``serving.compilation_cache: 0.0``, which equals ``False`` and was used as the relative
directory ``0.0``); entries planted in the user's cache directory (a real entry of model A under
model B's name, a renamed or hard-linked entry, an entry signed with another machine's key).
Each is refused or compiled afresh: the outputs are always the real model's.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import mlflow
import numpy as np
import pytest
import yaml

import jaxexp_mlflow  # noqa: F401  (installs mlflow.jaxexp)
from jaxexp_mlflow.errors import ArtifactError
from jaxexp_mlflow.internals import jaxlib_private
from jaxexp_mlflow.runtime import cache, cache_auth, executables, lite
from jaxexp_mlflow.serving.pyfunc import load_pyfunc
from tests.conftest import result_of
from tests.models import batch, mlp_apply, mlp_params

BUCKETS = [1, 2, 4, 8]


def _export(fn):
    (b,) = jax.export.symbolic_shape("b")
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), mlp_params())
    return jax.export.export(jax.jit(fn))(specs, jax.ShapeDtypeStruct((b, 8), jnp.float32))


def _other_apply(params, x):  # model B: the same signature, another function
    return mlp_apply(params, x) * 2.0 + 1.0


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``(a, b)``: two saved models of one signature and different functions."""
    root = tmp_path_factory.mktemp("models")
    params = mlp_params()
    for name, fn in (("a", mlp_apply), ("b", _other_apply)):
        mlflow.jaxexp.save_model(_export(fn), root / name, params=params, input_example=batch(2))
    return root / "a", root / "b"


def _load(path: Path, cache_dir: Path, monkeypatch) -> object:
    executables.flush()
    monkeypatch.setenv("JAXEXP_PYFUNC_CACHE", "0")
    return load_pyfunc(path, {"compilation_cache": str(cache_dir), "buckets": BUCKETS})


def _entry(cache_dir: Path) -> Path:
    """The one entry of the executable store in ``cache_dir``."""
    executables.flush()
    (entry,) = [p for p in (cache_dir / executables.EXEC_SUBDIR).glob("*.bin")]
    return entry


def _b_reference() -> np.ndarray:
    return np.asarray(_other_apply(mlp_params(), batch(4)))


# -- a model directory never chooses where caches live -------------------------------------------


@pytest.mark.parametrize("value", [0.0, 0, 1, True, "0.0", "cache", "/tmp/evil"])
def test_a_model_cannot_point_the_cache_anywhere(models, tmp_path, monkeypatch, value):
    """``0.0 == False`` passed the check and became the directory ``0.0`` of the working
    directory: a model loaded from its own directory chose the cache, its executables ran."""
    model = tmp_path / "model"
    shutil.copytree(models[0], model)
    doc = yaml.safe_load((model / "MLmodel").read_text())
    doc["flavors"]["jaxexp"].setdefault("serving", {})["compilation_cache"] = value
    (model / "MLmodel").write_text(yaml.safe_dump(doc))
    (model / "0.0" / lite.LITE_SUBDIR).mkdir(parents=True)  # where the planted entries were
    monkeypatch.chdir(model)
    with pytest.raises(ArtifactError, match="serving.compilation_cache"):
        mlflow.pyfunc.load_model(".")


@pytest.mark.parametrize("value", [False, "off"])
def test_a_model_may_turn_the_cache_off(models, tmp_path, value):
    model = tmp_path / "model"
    shutil.copytree(models[0], model)
    doc = yaml.safe_load((model / "MLmodel").read_text())
    doc["flavors"]["jaxexp"].setdefault("serving", {})["compilation_cache"] = value
    (model / "MLmodel").write_text(yaml.safe_dump(doc))
    got = mlflow.pyfunc.load_model(str(model)).predict(batch(3))
    np.testing.assert_allclose(got, mlp_apply(mlp_params(), batch(3)), rtol=1e-6)


@pytest.mark.parametrize("setting", ["0.0", "relative/dir", 0.0, 3])
def test_a_relative_or_untyped_cache_setting_is_refused(setting, monkeypatch):
    with pytest.raises(cache.CacheSettingError, match="compilation_cache"):
        cache.resolve(setting)
    if isinstance(setting, str):
        monkeypatch.setenv(cache.ENV_VAR, setting)
        with pytest.raises(cache.CacheSettingError, match=cache.ENV_VAR):
            cache.resolve()
    assert cache.resolve("~/c") == Path.home() / "c"  # expanded explicitly, then absolute


def test_jax_cache_only_in_a_directory_only_this_user_writes(tmp_path):
    made = tmp_path / "new" / "xla"
    assert cache.private_dir(made) and stat.S_IMODE(made.stat().st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    assert not cache.private_dir(shared)
    link = tmp_path / "link"
    link.symlink_to(made)
    assert not cache.private_dir(link)


# -- the per-user key ---------------------------------------------------------------------------


def test_the_key_is_private_and_made_once(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    key = cache_auth.secret()
    path = cache_auth.key_path()
    assert path == tmp_path / "cfg" / "jaxexp-mlflow" / "cache.key"
    assert key is not None and len(key) == 32 and path.read_bytes() == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    cache_auth._secrets.clear()  # as a later process reads it
    assert cache_auth.secret() == key


@pytest.mark.parametrize("defect", ["symlink", "group_readable", "short"])
def test_a_doubtful_key_file_is_refused(tmp_path, monkeypatch, defect):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    path = cache_auth.key_path()
    path.parent.mkdir(parents=True)
    if defect == "symlink":
        other = tmp_path / "known.key"
        other.write_bytes(b"k" * 32)
        other.chmod(0o600)
        path.symlink_to(other)
    else:
        path.write_bytes(b"k" * (32 if defect == "group_readable" else 5))
        path.chmod(0o640 if defect == "group_readable" else 0o600)
    monkeypatch.setattr(cache_auth, "_secrets", {})
    assert cache_auth.secret() is None
    assert cache_auth.tag("x.bin", b"payload") is None
    with pytest.raises(OSError):
        from jaxexp_mlflow.runtime import entries

        entries.write_entry(tmp_path, tmp_path / "x.bin", b"payload")


# -- planted entries of the executable store (jaxexp-executables) --------------------------------


def test_model_a_entry_under_model_b_name_is_not_run(models, tmp_path, monkeypatch):
    cache_dir = tmp_path / "xla"
    x = batch(4)
    a = _load(models[0], cache_dir, monkeypatch)
    a.predict(x)
    a_entry = _entry(cache_dir)
    a_bytes = a_entry.read_bytes()
    a_entry.unlink()
    b = _load(models[1], cache_dir, monkeypatch)
    want = b.predict(x)
    np.testing.assert_allclose(want, _b_reference(), rtol=1e-5)
    b_entry = _entry(cache_dir)
    b_entry.write_bytes(a_bytes)  # model A's real entry, under model B's name
    again = _load(models[1], cache_dir, monkeypatch)
    np.testing.assert_array_equal(again.predict(x), want)
    assert (again._flat.compiles, again._flat.loaded) == (1, 0)
    later = _load(models[1], cache_dir, monkeypatch)  # replaced by B's own entry
    np.testing.assert_array_equal(later.predict(x), want)
    assert (later._flat.compiles, later._flat.loaded) == (0, 1)


@pytest.mark.parametrize("how", ["renamed", "hard_linked"])
def test_renamed_or_hard_linked_entries_are_compiled_again(models, tmp_path, monkeypatch, how):
    cache_dir = tmp_path / "xla"
    x, y = batch(4), batch(2)
    b = _load(models[1], cache_dir, monkeypatch)
    want = b.predict(x)
    first = _entry(cache_dir)
    if how == "renamed":  # bucket 4's entry under bucket 2's name
        b.predict(y)
        executables.flush()
        (second,) = set((cache_dir / executables.EXEC_SUBDIR).glob("*.bin")) - {first}
        os.replace(first, second)
        again = _load(models[1], cache_dir, monkeypatch)
        np.testing.assert_allclose(again.predict(y), _other_apply(mlp_params(), y), rtol=1e-5)
    else:  # a second name for the entry, elsewhere: not an entry only the store holds
        os.link(first, tmp_path / "elsewhere.bin")
        again = _load(models[1], cache_dir, monkeypatch)
        np.testing.assert_array_equal(again.predict(x), want)
    assert (again._flat.compiles, again._flat.loaded) == (1, 0)


def test_an_entry_signed_with_another_key_is_compiled_again(models, tmp_path, monkeypatch):
    """A cache copied from another machine: its entries were signed with another secret."""
    cache_dir = tmp_path / "xla"
    x = batch(4)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "other-machine"))
    want = _load(models[1], cache_dir, monkeypatch).predict(x)
    _entry(cache_dir)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "this-machine"))
    again = _load(models[1], cache_dir, monkeypatch)
    np.testing.assert_array_equal(again.predict(x), want)
    assert (again._flat.compiles, again._flat.loaded) == (1, 0)


# -- planted entries of the lite store (jaxexp-lite), through fresh processes --------------------

CHILD = r"""
import json, sys
import numpy as np
import mlflow.pyfunc
from jaxexp_mlflow.runtime import executables
model = mlflow.pyfunc.load_model(sys.argv[1], model_config={"buckets": [1, 2, 4]})
out = {"impl": type(model._model_impl).__name__}
out["y"] = model.predict(np.load(sys.argv[2])).tolist()
out["jax"] = "jax" in sys.modules  # False: answered from a lite entry
executables.flush()
print("RESULT " + json.dumps(out))
"""

needs_lite = pytest.mark.skipif(
    not jaxlib_private.available(), reason="this jaxlib has no lite path (models load via jax)"
)


def _child(model: Path, x_file: Path, cache_dir: Path, **env: str) -> dict:
    run_env = {**os.environ, "JAXEXP_COMPILATION_CACHE": str(cache_dir), "JAX_PLATFORMS": "cpu"}
    run_env.pop("JAX_COMPILATION_CACHE_DIR", None)
    run_env.update(env)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(model), str(x_file)],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return result_of(proc)


def _lite_entries(cache_dir: Path) -> set[Path]:
    return set((cache_dir / lite.LITE_SUBDIR).glob("*.lite"))


@pytest.fixture(scope="module")
def twin_models(tmp_path_factory):
    """``(a, b)``: one function with other params (the lite store folds them in)."""
    root = tmp_path_factory.mktemp("twins")
    export = _export(mlp_apply)
    for name, seed in (("a", 0), ("b", 7)):
        params = mlp_params(seed=seed)
        mlflow.jaxexp.save_model(export, root / name, params=params, input_example=batch(2))
    return root / "a", root / "b"


@needs_lite
@pytest.mark.slow
def test_a_forged_lite_entry_is_not_run(twin_models, tmp_path):
    """Model A's real lite entry under model B's name, then a fresh process of B, then a real
    ``mlflow models serve`` of B: B's outputs every time, and B's entry written afresh."""
    from tests.servers import server_env, start_server, stop_server

    cache_dir = tmp_path / "cache"
    x = batch(2)
    x_file = tmp_path / "x.npy"
    np.save(x_file, x)
    a = _child(twin_models[0], x_file, cache_dir)
    (a_entry,) = _lite_entries(cache_dir)
    b = _child(twin_models[1], x_file, cache_dir)
    assert a["y"] != b["y"]
    (b_entry,) = _lite_entries(cache_dir) - {a_entry}
    shutil.copyfile(a_entry, b_entry)  # what a writer of the cache directory could plant

    forged = _child(twin_models[1], x_file, cache_dir)
    assert forged["jax"] and forged["y"] == b["y"]  # not A's executable: through jax
    assert b_entry.read_bytes() != a_entry.read_bytes()  # B's own entry again
    again = _child(twin_models[1], x_file, cache_dir)
    assert not again["jax"] and again["y"] == b["y"]

    shutil.copyfile(a_entry, b_entry)
    env = {**server_env(tmp_path), "JAXEXP_COMPILATION_CACHE": str(cache_dir)}
    env.update(JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    proc, url = start_server(str(twin_models[1]), "local", env, tmp_path / "server.log")
    try:
        import requests

        got = requests.post(f"{url}/invocations", json={"inputs": x.tolist()}, timeout=120)
        assert got.status_code == 200, got.text
        np.testing.assert_allclose(got.json()["predictions"], b["y"], rtol=1e-5, atol=1e-6)
    finally:
        stop_server(proc)


@needs_lite
def test_a_lite_entry_of_another_machine_is_not_run(twin_models, tmp_path):
    cache_dir = tmp_path / "cache"
    x_file = tmp_path / "x.npy"
    np.save(x_file, batch(2))
    other = {"XDG_CONFIG_HOME": str(tmp_path / "other-machine")}
    first = _child(twin_models[1], x_file, cache_dir, **other)
    assert _lite_entries(cache_dir)
    assert not _child(twin_models[1], x_file, cache_dir, **other)["jax"]  # lite there
    here = _child(twin_models[1], x_file, cache_dir)  # this machine's key: through jax
    assert here["jax"] and here["y"] == first["y"]
