"""``jaxexp audit`` over a real sqlite MLflow store holding live and archived (corpus) models."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import jax
import mlflow
import pytest
from click.testing import CliRunner

from jaxexp_mlflow.cli import main
from jaxexp_mlflow.cli.audit import plan
from jaxexp_mlflow.runtime import compat
from tests.conftest import CORPUS, corpus_cases, corpus_refusals, sqlite_store
from tests.models import batch, export_mlp, mlp_params

pytestmark = pytest.mark.skipif(not corpus_cases(), reason="corpus not available")
AS_OF = "2026-11-22"
#: jax >= 0.11.1 without its expired-versions flag refuses the 0.6.2 and 0.4.35 blobs (schema < 5)
REFUSES_MLP = "expired" in corpus_refusals(CORPUS / "jax-0.6.2" / "mlp")


def _live_window() -> dt.date:
    """When the window of a model logged by the running jaxlib closes (6 months after its build)."""
    return compat.release_date(compat.Environment.current().jaxlib_version) + compat.BACKWARD_WINDOW


@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    """A registry with a live model and archived blobs of several jax versions, plus a
    non-jaxexp model in the same experiment (skipped by the audit)."""
    root = tmp_path_factory.mktemp("audit")
    with sqlite_store(root, "archive", "art") as (uri, _):
        params = mlp_params()
        # logged as a jax that still read them would have (jax >= 0.11.1 needs its flag for
        # the blobs of jax <= 0.7); the audits below run without the flag, as a user would
        flag, before = compat.EXPIRED_FLAG, getattr(jax.config, compat.EXPIRED_FLAG, None)
        if before is not None:
            jax.config.update(flag, True)
        with mlflow.start_run():
            mlflow.jaxexp.log_model(
                export_mlp(params),
                name="live",
                params=params,
                input_example=batch(),
                registered_model_name="live",
            )
            for version, case in [
                ("0.6.2", "mlp"),
                ("0.8.3", "mlp_poly"),
                ("0.10.2", "sharded4"),
                ("0.4.35", "linalg"),
                ("0.10.2", "dtypes"),
            ]:
                blob = (CORPUS / f"jax-{version}" / case / "exported.bin").read_bytes()
                mlflow.jaxexp.log_model(
                    blob, name=f"{case}-{version}".replace(".", "_"), registered_model_name=case
                )
            # requirements given: MLflow infers none (a child that loads the model, seconds)
            mlflow.pyfunc.log_model(name="other", python_model=_Echo(), pip_requirements=["mlflow"])
        if before is not None:
            jax.config.update(flag, before)
        yield uri


class _Echo(mlflow.pyfunc.PythonModel):
    def predict(self, context, model_input):
        return model_input


def test_audit_registry_ranks_what_to_refresh_first(archive, expired_flag, without_expired_flag):
    with without_expired_flag():
        result = CliRunner().invoke(
            main, ["audit", "--as-of", AS_OF, "--json"], catch_exceptions=False
        )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["scope"] == "registry" and doc["as_of"] == AS_OF
    rows = {r["name"]: r for r in doc["models"]}
    assert set(rows) == {"live", "mlp", "mlp_poly", "sharded4", "linalg", "dtypes"}
    assert [r["rank"] for r in doc["models"]] == list(range(1, 7))
    # jax 0.6.2 blob (calling convention 9, bare: built on or before 2025-07-22): closed
    old = rows["mlp"]
    assert old["window"] == "by"
    assert old["window_closes"] == "2026-01-21" and old["months_left"] < 0
    if REFUSES_MLP:  # jax >= 0.11.1 without the flag: refused, refresh it with the flag set
        assert old["status"] == "incompatible" and old["codes"] == ["expired"]
        assert old["action"] == (
            "refresh now with JAX_EXPORT_DESERIALIZE_EXPIRED_VERSIONS=1 (window closed)"
        )
    else:
        assert old["status"] == "warn" and old["codes"] == ["window_backward"]
        assert old["action"] == "refresh now (window closed)"
    # refresh-now models come first, ordered by the date their window closes
    assert doc["models"][0]["name"] == "mlp"
    # the kernels of 0.4.35 linalg are gone: a refresh cannot help
    assert rows["linalg"]["action"].startswith("export again from source")
    assert "custom_calls" in rows["linalg"]["codes"]
    # 4-device blob on 1 device: refresh it where it runs
    assert rows["sharded4"]["action"] == "refresh with enough devices before the window closes"
    # live model logged by this jax: its window closes 6 months after this jaxlib's build
    # (jaxlib 0.10.2, built 2026-06-17: 2026-12-17, within a month; 0.12.0.1: 2027-04-21)
    live = rows["live"]
    closes = _live_window()
    assert live["status"] == "ok" and live["window"] == "exact"
    assert live["window_closes"] == closes.isoformat()
    soon = (closes - dt.date.fromisoformat(AS_OF)).days
    # logged by the jax that audits it: a refresh here keeps its window, a newer jax does not
    assert live["action"] == (
        "refresh now with a newer jax" if soon <= 31 else "refresh soon" if soon <= 92 else "ok"
    )
    assert doc["summary"]["refresh now"] >= 2
    # every model names the routes that run it here, each with when it closes
    for row in rows.values():
        for route in row["routes"]:
            assert route["closes_on"] or route["closes"].startswith("no known date"), route
    assert rows["live"]["routes"][0]["name"] == "direct"
    assert [r["name"] for r in old["routes"]][:1] == (
        ["expired-flag"] if REFUSES_MLP else ["direct"]
    )
    assert "direct" not in [r["name"] for r in rows["linalg"]["routes"]]  # its kernels are gone
    # with the flag set, the 0.6.2 blob is read here: a warning, refresh it now
    if expired_flag:
        flagged = CliRunner().invoke(
            main, ["audit", "--model", "mlp", "--as-of", AS_OF, "--json"], catch_exceptions=False
        )
        (row,) = json.loads(flagged.stdout)["models"]
        assert row["status"] == "warn" and set(row["codes"]) == {"expired", "window_backward"}
        assert row["action"] == "refresh now (window closed)"


def test_audit_table_experiment_scope_and_later_date(archive):
    result = CliRunner().invoke(
        main, ["audit", "--experiment", "archive", "--as-of", "2026-06-01"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == "Audit of experiments archive as of 2026-06-01 (6 jaxexp model(s))"
    header = next(ln for ln in lines if "window closes" in ln)
    assert header.split() == [
        "#",
        "model",
        "logged",
        "by",
        "jax",
        "verdict",
        "window",
        "closes",
        "months",
        "route",
        "action",
    ]
    body = "\n".join(lines)
    assert "bare blob" in body and "by 2026-01-21" in body and "Summary:" in body
    # a bare 0.8.3 blob: only a lower bound of its build date, so its window may have closed
    poly = next(ln for ln in lines if "mlp_poly" in ln)
    assert "after 2026-05-25" in poly and "refresh now (window may have closed)" in poly
    # as of June 2026 the live model (window to 2026-12-17 on jaxlib 0.10.2) has months left
    live = next(ln for ln in lines if ln.split()[1:2] and ln.split()[1].startswith("live"))
    months = (_live_window() - dt.date(2026, 6, 1)).days / 30.44
    assert f"{months:+.1f}" in live and live.rstrip().endswith("ok")
    # the 0.6.2 blob: refreshed with jax's flag set where this jax refuses it without
    mlp = next(ln for ln in lines if "mlp-0_6_2" in ln)
    if REFUSES_MLP:
        assert "incompatible" in mlp and "with JAX_EXPORT_DESERIALIZE_EXPIRED_VERSIONS=1" in mlp
    else:
        assert "warn" in mlp and "refresh now (window closed)" in mlp
    # progress goes to stderr, only when asked for (a terminal, or JAXEXP_PROGRESS=1)
    assert "Auditing" not in result.stderr
    shown = CliRunner().invoke(
        main, ["audit", "--model", "dtypes"], env={"JAXEXP_PROGRESS": "1"}, catch_exceptions=False
    )
    assert "Auditing" in shown.stderr and "Auditing" not in shown.stdout
    assert "(1 jaxexp model(s))" in shown.stdout
    # an unknown experiment is an input error (exit 2)
    bad = CliRunner().invoke(main, ["audit", "--experiment", "nope"], catch_exceptions=False)
    assert bad.exit_code == 2 and "no experiment named 'nope'" in bad.output


def test_plan_and_window_rules():
    day = dt.date(2026, 11, 22)
    assert plan("ok", [], day + dt.timedelta(days=200), day) == (5, "ok")
    assert plan("ok", [], day + dt.timedelta(days=60), day) == (3, "refresh soon")
    assert plan("warn", ["calling_convention"], day + dt.timedelta(days=400), day)[1] == (
        "refresh now"
    )
    assert plan("incompatible", ["kernel_abi"], None, day)[0] == 1
    # jax >= 0.11.1: an expired blob is refreshed here with the flag; HLO shardings elsewhere
    past = day - dt.timedelta(days=30)
    assert plan("incompatible", ["expired"], past, day, "by") == (
        0,
        "refresh now with JAX_EXPORT_DESERIALIZE_EXPIRED_VERSIONS=1 (window closed)",
    )
    sharded = plan("incompatible", ["devices", "expired", "hlo_sharding"], past, day)
    assert sharded[0] == 2 and "older jax" in sharded[1] and "--env-manager uv" in sharded[1]
    linalg = plan("incompatible", ["expired", "custom_calls"], past, day)
    assert linalg[1].startswith("export again from source")
    exact = {"build_date_earliest": "2026-06-17", "build_date_latest": "2026-06-17"}
    assert compat.window_closes(exact) == (dt.date(2026, 12, 17), "exact")
    assert compat.window_closes({"build_date_earliest": "2026-04-04"})[1] == "after"
    assert compat.window_closes({}) == (None, "unknown")


def test_audit_of_a_missing_scope_is_refused_either_way(archive):
    """--model and --experiment naming nothing there: both exit 2 saying so (--model gave an
    empty table and exit 0)."""
    for flag, what in (("--model", "registered model"), ("--experiment", "experiment")):
        result = CliRunner().invoke(main, ["audit", flag, "nosuch"])
        assert result.exit_code == 2, (flag, result.output)
        assert f"no {what} named 'nosuch'" in result.output


def test_audit_says_why_a_model_cannot_be_read(tracking_uri):
    """An unreadable model's reason is printed under the table (only --json had it), naming
    the model's URI rather than the temporary directory it was downloaded into."""
    from urllib.parse import urlparse

    from tests.models import batch, export_mlp, mlp_params

    params = mlp_params()
    info = mlflow.jaxexp.log_model(
        export_mlp(params), name="m", params=params, input_example=batch(2),
        registered_model_name="broken",
    )  # fmt: skip
    where = urlparse(mlflow.get_logged_model(info.model_id).artifact_location).path
    blob = Path(where) / "exported.bin"
    blob.write_bytes(blob.read_bytes()[:100])
    result = CliRunner().invoke(main, ["audit", "--model", "broken"])
    assert result.exit_code == 0, result.output
    why = [ln for ln in result.output.splitlines() if ln.startswith("#1: ")]
    assert why and "models:/broken/1" in why[0] and "/jaxexp-" not in why[0], result.output
