"""The ``jaxexp`` command line: inspect, check, predict, verify, log, refresh and audit models.

Every command takes a model URI MLflow understands (``runs:/<run_id>/<name>``,
``models:/<name>/<version>``, ``models:/<name>@<alias>``, ``models:/<model_id>``, a local model
directory) or, where it makes sense, a bare blob file; has ``--json`` and ``--debug``; exits 0 on
success, 1 when the answer is "no" (incompatible, mismatch) and 2 on usage or input errors. The
command modules import jax and mlflow only inside the commands that need them.
"""

from __future__ import annotations

import click

from jaxexp_mlflow import __version__
from jaxexp_mlflow.cli.audit import audit
from jaxexp_mlflow.cli.check import check
from jaxexp_mlflow.cli.inspect import inspect
from jaxexp_mlflow.cli.log import log
from jaxexp_mlflow.cli.predict import predict
from jaxexp_mlflow.cli.refresh import refresh
from jaxexp_mlflow.cli.serve import serve
from jaxexp_mlflow.cli.verify import verify


@click.group(
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog="""\b
Example: reproduce the result of a run logged long ago
  jaxexp inspect runs:/0f3c.../model
  jaxexp check   runs:/0f3c.../model
  jaxexp verify  runs:/0f3c.../model
  jaxexp refresh runs:/0f3c.../model --register classifier
""",
)
@click.version_option(__version__, prog_name="jaxexp")
def main() -> None:
    """Inspect, check, run, reproduce and log jaxexp (jax.export) MLflow models.

    Exit codes: 0 success, 1 the answer is "no" (incompatible, mismatch), 2 usage or input
    error. The tracking server is MLflow's usual MLFLOW_TRACKING_URI.
    """


for _command in (inspect, check, predict, verify, log, refresh, audit, serve):
    main.add_command(_command)

__all__ = ["main"]
