"""`python -m steprl.hosting [options]`: `steprl serve-env` without importing the trainer (torch)."""

from __future__ import annotations

import sys

import typer

from steprl.extras import MissingExtra
from steprl.hosting.command import serve_env


def main() -> None:
    try:
        typer.run(serve_env)
    except MissingExtra as err:  # one line, as `steprl serve-env` prints it
        print(err, file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
