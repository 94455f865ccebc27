"""`python -m steprl.hosting [options]`: `steprl serve-env` without importing the trainer (torch)."""

from __future__ import annotations

import sys

import typer

from steprl.errors import UserError
from steprl.hosting.command import serve_env


def main() -> None:
    try:
        typer.run(serve_env)
    except UserError as err:  # a missing extra, a plugin that does not import: one line
        print(err, file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
