"""`python -m steprl.hosting [options]`: `steprl serve-env` without importing the trainer (torch)."""

from __future__ import annotations

import typer

from steprl.hosting.command import serve_env


def main() -> None:
    typer.run(serve_env)


if __name__ == "__main__":
    main()
