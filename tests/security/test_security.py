"""Attacks on a model directory: each test damages a copy of a real saved model, then loads it.

A model directory is untrusted input (docs/security.md): nothing outside it is read, wrong
weights never load, no file hangs or blows up the process, and every refusal is a typed
``ArtifactError`` that quotes neither outside content nor outside listings.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import mlflow
import numpy as np
import pytest
import yaml
from click.testing import CliRunner

import jaxexp_mlflow  # noqa: F401 - installs mlflow.jaxexp
from jaxexp_mlflow import params as P
from jaxexp_mlflow.cli import main
from jaxexp_mlflow.codec import mlmodel
from jaxexp_mlflow.errors import ArtifactError
from jaxexp_mlflow.params import manifest as M
from tests.conftest import reseal_reference
from tests.models import batch, export_mlp, mlp_apply, mlp_params


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A saved MLP (params, reference) and a second one with other weights beside it."""
    root = tmp_path_factory.mktemp("sec")
    params = mlp_params()
    mlflow.jaxexp.save_model(
        export_mlp(params),
        root / "model",
        params=params,
        input_example=batch(3),
        include_package=False,
    )
    other = mlp_params(seed=7)
    mlflow.jaxexp.save_model(export_mlp(other), root / "other", params=other, include_package=False)
    return root, params


@pytest.fixture
def model(base, tmp_path):
    """A fresh copy of the model, with the other model beside it (``../other``)."""
    root, _ = base
    shutil.copytree(root / "model", tmp_path / "model", symlinks=True)
    shutil.copytree(root / "other", tmp_path / "other", symlinks=True)
    return tmp_path / "model"


def edit_flavor(model: Path, **changes) -> None:
    doc = yaml.safe_load((model / "MLmodel").read_text())
    for key, value in changes.items():
        if value is _DROP:
            doc["flavors"]["jaxexp"].pop(key)
        else:
            doc["flavors"]["jaxexp"][key] = value
    (model / "MLmodel").write_text(yaml.safe_dump(doc))


_DROP = object()


def refused(model: Path, match: str) -> str:
    with pytest.raises(ArtifactError, match=match) as err:
        mlflow.jaxexp.load_model(str(model))
    return str(err.value)


def chunk(model: Path) -> Path:
    meta = (".zarray", "zarr.json")
    return next(p for p in sorted((model / "params" / "w1").iterdir()) if p.name not in meta)


def test_the_undamaged_copy_loads(model, base):
    got = mlflow.jaxexp.load_model(str(model))(batch(3))
    np.testing.assert_allclose(got, mlp_apply(base[1], batch(3)), rtol=1e-6)


# -- 1. confinement ------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["absolute", "dotdot"])
def test_params_outside_the_model_are_refused(model, where):
    other = str(model.parent / "other" / "params")
    edit_flavor(model, params=other if where == "absolute" else "../other/params")
    refused(model, "absolute path or a '..' escape")


def test_blob_path_to_an_outside_file_leaks_nothing(model, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET-CONTENT\n" * 10)
    edit_flavor(model, exported_file=str(secret))
    msg = refused(model, "absolute path")
    assert "TOPSECRET" not in msg
    edit_flavor(model, params=str(tmp_path))  # a directory: its listing must not appear
    assert "secret.txt" not in refused(model, "absolute path")


@pytest.mark.parametrize("what", ["blob", "params_dir", "array_dir", "chunk_file"])
def test_symlinks_leading_outside_are_refused(model, what):
    other = model.parent / "other"
    link = {
        "blob": (model / "exported.bin", other / "exported.bin"),
        "params_dir": (model / "params", other / "params"),
        "array_dir": (model / "params" / "w1", other / "params" / "w1"),
        "chunk_file": (chunk(model), other / "params" / "w1" / chunk(model).name),
    }[what]
    if link[0].is_dir():
        shutil.rmtree(link[0])
    else:
        link[0].unlink()
    link[0].symlink_to(link[1])
    refused(model, "symbolic link .*outside")


def _walk_by_os_walk(root: Path, rel: str) -> list[tuple[str, int, int]]:
    """The walk as ``codec.files.walk_files`` once did it (``os.walk`` with
    ``followlinks=True`` and every directory's ``realpath``): the reference it is held to."""
    import stat as st_

    base = os.path.realpath(root)
    top = Path(os.path.realpath(os.path.join(base, rel)))
    out, seen = [], set()
    for dirpath, dirnames, filenames in os.walk(top, followlinks=True):
        real = os.path.realpath(dirpath)
        if os.path.commonpath([base, real]) != base:
            raise ArtifactError("symbolic link outside")
        if real in seen:
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames.sort()
        for name in sorted(filenames):
            child = os.path.join(dirpath, name)
            st = os.lstat(child)
            if st_.S_ISLNK(st.st_mode):
                target = os.path.realpath(child)
                if os.path.commonpath([base, target]) != base:
                    raise ArtifactError("symbolic link outside")
                st = os.stat(target)
            if not st_.S_ISREG(st.st_mode):
                raise ArtifactError("not a regular file")
            rel_dir = os.path.relpath(dirpath, top)
            out.append((os.path.normpath(os.path.join(rel_dir, name)), st.st_size, st.st_ino))
    return out


@pytest.mark.parametrize("outside", [None, "dir", "file"])
def test_walk_files_lists_what_os_walk_lists(tmp_path, outside):
    """``walk_files`` resolves only links, not every directory: same files, sizes, order and
    refusals as the ``os.walk`` walk it replaced, on a tree with nested directories, links to
    directories and to a file inside, a link cycle, an empty directory and names out of order."""
    from jaxexp_mlflow.codec import files

    root = tmp_path / "model"
    ck = root / "params"
    for i, rel in enumerate(["b/z.bin", "b/a.bin", "a/deep/er/x.bin", "A.bin", "c/y.bin", "_m"]):
        (ck / rel).parent.mkdir(parents=True, exist_ok=True)
        (ck / rel).write_bytes(b"x" * (i + 1))
    (ck / "e").mkdir()
    (ck / "link_dir").symlink_to(ck / "a")  # inside, to a directory walked already: not again
    (ck / "0deep").symlink_to(ck / "a" / "deep")  # sorted first: a/deep is walked as 0deep/
    (ck / "c" / "link_file").symlink_to(ck / "b" / "z.bin")
    (ck / "a" / "deep" / "up").symlink_to(ck / "a")  # a cycle: walked once
    if outside == "dir":
        (tmp_path / "away").mkdir()
        (tmp_path / "away" / "f").write_bytes(b"f")
        (ck / "b" / "out").symlink_to(tmp_path / "away")
    elif outside == "file":
        (tmp_path / "f").write_bytes(b"f")
        (ck / "c" / "out").symlink_to(tmp_path / "f")
    if outside:
        with pytest.raises(ArtifactError, match="outside"):
            _walk_by_os_walk(root, "params")
        with pytest.raises(ArtifactError, match="symbolic link .*outside"):
            list(files.walk_files(root, "params", what="params checkpoint"))
        return
    want = _walk_by_os_walk(root, "params")
    got = [(r, st.st_size, st.st_ino) for r, st in files.walk_files(root, "params", what="x")]
    assert got == want
    names = [r for r, _, _ in got]
    assert "0deep/er/x.bin" in names and "c/link_file" in names
    assert not [n for n in names if n.startswith(("link_dir", "a/deep/"))]


def test_manifest_entries_cannot_reach_outside(model):
    mf = model / "params" / M.MANIFEST_FILE
    doc = json.loads(mf.read_text())
    doc["files"]["../../other/exported.bin"] = {"size": 1, "crc32c": "00000000"}
    mf.write_text(json.dumps(doc))
    msg = refused(model, "manifest .* damaged")
    assert str((model.parent / "other" / "exported.bin").stat().st_size) not in msg


def test_fifo_and_device_are_refused_without_blocking(model):
    (model / "exported.bin").unlink()
    os.mkfifo(model / "exported.bin")
    signal.alarm(20)  # a blocking open would hang the test: fail it instead
    try:
        refused(model, "expected a regular file, found a FIFO")
    finally:
        signal.alarm(0)
    (model / "exported.bin").unlink()
    (model / "exported.bin").symlink_to("/dev/zero")
    refused(model, "symbolic link")


def test_log_params_refuses_links_leaving_the_checkpoint(base, tmp_path):
    root, _ = base
    src = tmp_path / "ckpt"
    shutil.copytree(root / "model" / "params", src)
    target = chunk(root / "model")
    c = src / "w1" / target.name
    c.unlink()
    c.symlink_to(root / "other" / "params" / "w1" / target.name)
    with pytest.raises(ArtifactError, match="symbolic link .*outside"):
        P.copy_checkpoint(src, tmp_path / "copy")
    assert not (tmp_path / "copy").exists()


# -- 2. integrity --------------------------------------------------------------------------------


def test_sixteen_altered_bytes_are_detected(model):
    c = chunk(model)
    with open(c, "r+b") as f:
        f.seek(8)
        f.write(b"\x7f" * 16)  # same size: only the checksum sees it
    refused(model, r"w1/(c[./])?0([./]0)*' does not match its checksum")


def test_a_chunk_deleted_with_its_manifest_entry_is_not_zeros(model):
    c = chunk(model)
    mf = model / "params" / M.MANIFEST_FILE
    doc = json.loads(mf.read_text())
    del doc["files"][f"w1/{c.name}"]
    mf.write_text(json.dumps(doc))
    c.unlink()
    refused(model, "lacks its chunk file")


def test_missing_manifest_and_missing_blob_checksum_are_errors(model):
    edit_flavor(model, exported_sha256=_DROP)
    refused(model, "exported_sha256")
    edit_flavor(model, exported_sha256="0" * 64)
    refused(model, "does not match its recorded checksum")


def test_missing_manifest_is_an_error_and_a_legacy_one_warns(model, base, caplog):
    mf = model / "params" / M.MANIFEST_FILE
    doc = json.loads(mf.read_text())
    mf.unlink()
    refused(model, "has no jaxexp_manifest.json")
    mf.write_text(json.dumps({"files": {k: v["size"] for k, v in doc["files"].items()}}))
    got = mlflow.jaxexp.load_model(str(model))(batch(3))  # saved by an older main: loads
    np.testing.assert_allclose(got, mlp_apply(base[1], batch(3)), rtol=1e-6)
    assert "without checksums" in caplog.text


@pytest.mark.parametrize(
    "content",
    ["[" * 100_000, '{"files": [1, 2]}', '{"files": {"w1/zarr.json": "big"}}', "\xff\xfe"],
)
def test_malformed_manifests_are_typed_errors(model, content):
    (model / "params" / M.MANIFEST_FILE).write_text(content, errors="surrogateescape")
    refused(model, "manifest")


def test_a_consistent_forgery_cannot_claim_more_bytes_than_on_disk(model):
    c = chunk(model)
    os.truncate(c, 64)
    M.write_manifest(model / "params")  # the attacker rewrites the manifest too
    refused(model, "Truncated|claims|damaged")


# -- 4./5. bounded MLmodel, typed errors ---------------------------------------------------------


def test_yaml_alias_bomb_is_refused(model):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    (model / "MLmodel").write_text("\n".join(lines) + "\nflavors: {jaxexp: *a8}\n")
    with pytest.raises(ArtifactError, match="reading budget"):
        mlmodel.read_mlmodel(model)
    result = CliRunner().invoke(main, ["inspect", str(model), "--json"])
    assert result.exit_code == 2 and "reading budget" in result.output


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"serving": {"max_batch": 2**40}}, "serving.max_batch"),
        ({"serving": {"buckets": list(range(1, 500))}}, "serving.buckets"),
        ({"serving": {"compilation_cache": "/tmp/evil"}}, "compilation_cache"),
        ({"n_param_leaves": "four"}, "n_param_leaves"),
        ({"params": None}, "params: None"),
        ({"params": ["params"]}, "jaxexp.params"),
        ({"pytree_node_types": "flax"}, "pytree_node_types"),
    ],
)
def test_bad_flavor_fields_are_typed_errors(model, changes, match):
    edit_flavor(model, **changes)
    refused(model, match)


@pytest.mark.parametrize(
    ("field", "edit", "match"),
    [
        ("vjp_order", lambda f: 5, r"jaxexp.vjp_order says 5, the blob says"),
        ("nr_devices", lambda f: 2, r"jaxexp.nr_devices says 2, the blob says 1"),
        ("platforms", lambda f: ["cuda"], r"jaxexp.platforms says \[cuda\], the blob says"),
        (
            "in_avals",
            lambda f: [a.replace("float32", "int32") for a in f["in_avals"]],
            r"jaxexp.in_avals\[0\] says int32",
        ),
        (
            "io",
            lambda f: {**f["io"], "inputs": [{**f["io"]["inputs"][0], "dtype": "int32"}]},
            r"jaxexp.io.inputs 'x' says int32\[rank 2\], the blob says float32",
        ),
    ],
)
def test_mlmodel_facts_differing_from_the_blob_are_refused(model, field, edit, match):
    """MLmodel's facts about the function are the blob's: edited apart from it, they would have
    the model promise what its blob cannot do (a 5th derivative) or refuse what it takes. Load,
    `jaxexp check` and `inspect` read them through the same check."""
    doc = yaml.safe_load((model / "MLmodel").read_text())
    section = doc["flavors"]["jaxexp"]
    section[field] = edit(section)
    (model / "MLmodel").write_text(yaml.safe_dump(doc))
    refused(model, match)
    for command in ("check", "inspect"):
        result = CliRunner().invoke(main, [command, str(model)])
        assert result.exit_code == 2 and "does not match its blob" in result.output, result.output


def test_io_shapes_are_bounded(model):
    doc = yaml.safe_load((model / "MLmodel").read_text())
    doc["flavors"]["jaxexp"]["io"]["inputs"][0]["shape"] = [-1, 2**40]
    (model / "MLmodel").write_text(yaml.safe_dump(doc))
    with pytest.raises(ArtifactError, match=r"io.inputs\[0\].shape"):
        mlflow.pyfunc.load_model(str(model))


def test_a_jaxexp_section_that_is_a_list(model):
    doc = yaml.safe_load((model / "MLmodel").read_text())
    doc["flavors"]["jaxexp"] = [1, 2, 3]
    (model / "MLmodel").write_text(yaml.safe_dump(doc))
    refused(model, "expected a mapping")


# -- reference arrays ----------------------------------------------------------------------------


def test_zip_bomb_reference_is_refused_before_decompressing(model):
    ref = model / "reference" / "outputs.npz"
    with zipfile.ZipFile(ref, "w", zipfile.ZIP_DEFLATED) as z, z.open("out_0.npy", "w") as f:
        header = {"descr": "<f8", "fortran_order": False, "shape": (32 << 20,)}
        np.lib.format.write_array_header_1_0(f, header)
        block = bytes(1 << 20)
        for _ in range(256):  # 256 MiB of zeros: about 250 kB compressed
            f.write(block)
    result = CliRunner().invoke(main, ["verify", str(model)])
    assert result.exit_code == 2 and "does not match its recorded checksum" in result.output
    reseal_reference(model)  # a forger who rewrote the digest too, or a model saved before it
    result = CliRunner().invoke(main, ["verify", str(model)])
    assert result.exit_code == 2, result.output
    assert "zip bomb" in result.output and "damaged" in result.output


def test_reference_member_claiming_more_than_it_holds(model):
    ref = model / "reference" / "outputs.npz"
    with zipfile.ZipFile(ref, "w") as z, z.open("out_0.npy", "w") as f:
        np.lib.format.write_array_header_1_0(
            f, {"descr": "<f4", "fortran_order": False, "shape": (10**9,)}
        )
        f.write(b"\0" * 64)
    reseal_reference(model)  # past the digest: the parse's own checks
    result = CliRunner().invoke(main, ["verify", str(model)])
    assert result.exit_code == 2 and "declares float32[1000000000]" in result.output


# -- 3. no process death from a blob ---------------------------------------------------------------

#: Mutations (benchmarks/fuzz_module.py, seed 0) of the 0.10.2 corpus whose MLIR module makes
#: jax 0.10.2's deserializer abort the process (SIGABRT, found by the fuzz benchmark).
CRASHERS = (117, 141)


def _crasher(tmp_path: Path, index: int) -> Path:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import fuzz_module

    path = tmp_path / f"m{index}.bin"
    path.write_bytes(fuzz_module.mutations(index + 1)[index])
    return path


def test_check_refuses_a_blob_that_crashes_jax(tmp_path):
    # in-process, these bytes abort jax 0.10.2 (and pytest with it): the check survives only if
    # JAX runs isolated; a jax whose deserializer refuses them instead is named as refusing
    path = str(_crasher(tmp_path, CRASHERS[0]))
    import fuzz_module  # on sys.path since _crasher

    crashes = fuzz_module.classify([path], cap=2 << 30)[path].startswith("signal")
    result = CliRunner().invoke(main, ["check", path])
    assert result.exit_code == 2, result.output
    said = "crashed (SIGABRT)" if crashes else "JAX refused it"
    assert said in result.output and len(result.output.strip().splitlines()) == 1, result.output


@pytest.mark.slow
def test_fuzzed_modules_crash_jax_but_not_verify(tmp_path):
    import hashlib

    paths = [str(_crasher(tmp_path, i)) for i in CRASHERS]
    import fuzz_module  # on sys.path since _crasher

    # in a capped child: jax 0.10.2 dies of these bytes; a jax that refuses them says so
    outcomes = fuzz_module.classify(paths, cap=2 << 30)
    assert all(outcomes[p].startswith("signal") or outcomes[p] == "error" for p in paths), outcomes
    # the same bytes as the blob of a model saved from the unmutated one (the mutations keep
    # the flatbuffer, so MLmodel still describes them), with a consistent checksum: verify
    # refuses, exit 2
    blobs = fuzz_module.corpus_blobs()
    source = blobs[CRASHERS[0] % len(blobs)]
    assert len({i % len(blobs) for i in CRASHERS}) == 1  # both mutate the same blob
    model = tmp_path / "saved"
    mlflow.jaxexp.save_model(source, model, include_package=False)
    for path in paths:
        data = Path(path).read_bytes()
        (model / "exported.bin").write_bytes(data)
        edit_flavor(model, exported_sha256=hashlib.sha256(data).hexdigest())
        result = CliRunner().invoke(main, ["verify", str(model), "--allow-incompatible"])
        assert result.exit_code == 2, result.output
        said = "crashed (SIG" if outcomes[path].startswith("signal") else "JAX refused it"
        assert said in result.output and "isolated child" in result.output, result.output
    fig = fuzz_module.run(40, tmp_path)  # a small campaign: every dangerous one is refused
    assert fig["refused_by_probe"] == fig["dangerous"], fig


# -- 5. disk full ----------------------------------------------------------------------------------


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs (skipped where mounting is not permitted)."""
    import subprocess

    mnt = tmp_path / "tiny"
    mnt.mkdir()
    cmd = ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)]
    if os.geteuid() != 0 or subprocess.run(cmd, capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_disk_full_is_an_artifact_error_saying_how_much(tiny_disk):
    import jax.numpy as jnp

    params = {**mlp_params(), "w1": jnp.ones((8, 16 * 4096), jnp.float32)}  # 2 MiB
    with pytest.raises(ArtifactError, match=r"needs about \d+ bytes .* bytes free"):
        mlflow.jaxexp.save_model(
            export_mlp_wide(params), tiny_disk / "m", params=params, include_package=False
        )
    with pytest.raises(ArtifactError, match="No space left on device"):  # past the pre-check
        P.save_params({"w": np.ones(1 << 19, np.float32)}, tiny_disk / "ck")


def export_mlp_wide(params):
    import jax
    import jax.numpy as jnp

    def apply(p, x):
        return jnp.tanh(x @ p["w1"][:, :16] + p["b1"]) @ p["w2"] + p["b2"]

    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    return jax.export.export(jax.jit(apply))(spec, jax.ShapeDtypeStruct((2, 8), jnp.float32))


def test_manifest_verification_needs_no_jax(base):
    # the IREE reader calls verify_checkpoint without JAX: it must not import it
    import subprocess
    import sys

    code = (
        "import sys; from jaxexp_mlflow.params.manifest import verify_checkpoint; "
        f"m = verify_checkpoint({str(base[0] / 'model' / 'params')!r}); "
        "assert m.verified == set(m.files) and not m.legacy; "
        "assert 'jax' not in sys.modules, 'jax imported'; print('OK', len(m.files))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("OK"), out.stderr[-2000:]


# -- 6. loading and vetting run none of the model's code ---------------------------------------

_CLI = "import sys; from jaxexp_mlflow.cli import main; sys.exit(main())"


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The ``jaxexp`` command in a fresh interpreter (nothing imported yet that a model could
    shadow), the way a user runs it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    return subprocess.run(
        [sys.executable, "-c", _CLI, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )


def _plant(directory: Path, module: str, marker: Path, *, exit_ok: bool = False) -> None:
    """A Python module in ``directory`` that leaves ``marker`` behind if it is ever imported
    (and with ``exit_ok`` ends the process with status 0, so that a vetting child reads 'ok')."""
    target = directory / module.replace(".", "/")
    target.mkdir(parents=True, exist_ok=True)
    body = f"open({str(marker)!r}, 'a').write({module!r} + '\\n')\n"
    if exit_ok:
        body += "import os\nos._exit(0)\n"
    (target / "__init__.py").write_text(body)


def test_check_run_inside_a_model_imports_none_of_its_python(model, tmp_path, monkeypatch):
    import hashlib

    data = _crasher(tmp_path, CRASHERS[0]).read_bytes()  # JAX aborts on it: the real verdict
    (model / "exported.bin").write_bytes(data)
    edit_flavor(model, exported_sha256=hashlib.sha256(data).hexdigest())
    marker = tmp_path / "ran"
    _plant(model, "jax", marker, exit_ok=True)  # a top-level jax/ that says "all fine"
    real = CliRunner().invoke(main, ["check", str(model)])  # from a neutral directory
    assert not marker.exists()
    monkeypatch.chdir(model)
    inside = CliRunner().invoke(main, ["check", "."])
    assert not marker.exists(), "the isolation child imported the model's jax/"
    assert inside.exit_code == real.exit_code, (real.output, inside.output)
    verdict = [ln for ln in real.output.splitlines() if ln.startswith(("Verdict", "jaxexp check"))]
    assert verdict and all(ln in inside.output for ln in verdict), (real.output, inside.output)


def test_isolated_load_inside_a_model_imports_none_of_its_python(model, tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    _plant(model, "jax", marker, exit_ok=True)
    monkeypatch.chdir(model)
    loaded = mlflow.jaxexp.load_model(".", isolate=True)
    assert loaded(batch(3)).shape[0] == 3
    assert not marker.exists(), "the isolation child imported the model's jax/"


@pytest.mark.parametrize("code", ["absolute", "../..", 5, ["code"]])
def test_code_field_is_validated(model, code):
    outside = model.parent / "other"
    edit_flavor(model, code=str(outside) if code == "absolute" else code)
    before = list(sys.path)
    refused(model, "jaxexp.code")
    assert sys.path == before and str(outside) not in sys.path


def test_verify_and_predict_import_nothing_from_code(model, tmp_path):
    marker = tmp_path / "ran"
    _plant(model / "code", "timeit", marker)
    for name in ("orbax", "tensorstore", "absl", "msgpack", "jaxexp_mlflow"):
        _plant(model / "code", name, marker)  # would also break the load if imported
    edit_flavor(model, code="code")
    np.save(tmp_path / "x.npy", batch(2))
    verify = _cli("verify", str(model), cwd=tmp_path)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    predict = _cli("predict", str(model), "--input", str(tmp_path / "x.npy"), cwd=tmp_path)
    assert predict.returncode == 0, predict.stdout + predict.stderr
    assert not marker.exists(), marker.read_text()


def _python_files(model: Path) -> list[str]:
    return sorted(
        str(p.relative_to(model))
        for p in model.rglob("*")
        if p.suffix in (".py", ".pyc", ".so", ".pth")
    )


def test_a_default_save_carries_no_python(base, tmp_path):
    from jaxexp_mlflow import __version__

    params = base[1]
    mlflow.jaxexp.save_model(export_mlp(params), tmp_path / "m", params=params)
    model = tmp_path / "m"
    assert _python_files(model) == [] and not (model / "code").exists()
    doc = yaml.safe_load((model / "MLmodel").read_text())
    assert not doc["flavors"]["jaxexp"].get("code")
    assert not doc["flavors"]["python_function"].get("code")
    reqs = (model / "requirements.txt").read_text().splitlines()
    assert f"jaxexp-mlflow>={__version__}" in reqs, reqs
    result = CliRunner().invoke(main, ["check", str(model)])
    assert result.exit_code == 0 and "carries no Python" in result.output, result.output
    doc = json.loads(CliRunner().invoke(main, ["check", str(model), "--json"]).stdout)
    assert doc["model_python"] == {"count": 0, "files": [], "code": None}


def test_include_package_is_reported_and_never_imported(base, tmp_path):
    params = base[1]
    mlflow.jaxexp.save_model(
        export_mlp(params), tmp_path / "m", params=params, include_package=True
    )
    model = tmp_path / "m"
    carried = _python_files(model)
    assert "code/jaxexp_mlflow/__init__.py" in carried
    result = CliRunner().invoke(main, ["check", str(model)])
    assert result.exit_code == 0, result.output
    assert f"carries {len(carried)} Python files" in result.output, result.output
    assert "code/jaxexp_mlflow/__init__.py" in result.output
    before = list(sys.path)
    mlflow.jaxexp.load_model(str(model))(batch(2))
    assert sys.path == before  # jaxexp is the loader: the copy is never put on sys.path


@pytest.mark.parametrize(
    "node_types",
    [
        ["flax.serialization.to_bytes"],  # importable, but a function, not a node type
        ["flax." + "x" * 200_000],  # once passed on the child's argv: E2BIG
        ["flax.core.frozen_dict.FrozenDict\n--evil"],
        [5],
    ],
    ids=["function", "200kB", "newline", "int"],
)
@pytest.mark.parametrize("isolate", [False, True])
def test_hostile_node_types_are_typed_errors(model, node_types, isolate):
    edit_flavor(model, pytree_node_types=node_types)
    with pytest.raises(ArtifactError, match="pytree_node_types"):
        mlflow.jaxexp.load_model(str(model), isolate=isolate)
