"""``python -m jaxexp_mlflow.cli``: the ``jaxexp`` command where no script is installed (a
package on ``PYTHONPATH``, as on a machine that gets the project as files)."""

from jaxexp_mlflow.cli import main

if __name__ == "__main__":
    main(prog_name="jaxexp")
