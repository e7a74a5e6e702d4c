"""The ``jaxexp`` command line (filled in by the CLI module)."""


def main() -> None:  # placeholder until the CLI lands
    raise SystemExit("jaxexp: no commands yet")
