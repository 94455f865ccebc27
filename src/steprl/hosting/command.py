"""`steprl serve-env`: run the env server (registered in `steprl.cli`; also `python -m steprl.hosting`).

The command lives here, not in `cli.py`, so that `LocalEnvServer` can start it through
`python -m steprl.hosting` without importing the trainer's dependencies (torch), which would
add seconds to every server start and restart.

The token comes from the environment variable STEPRL_ENV_TOKEN, or is generated and written to
a file only this user can read (mode 0600), whose path is printed. The token itself is never
printed, logged or put on a command line (other users can read argv from /proc).
"""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path

import typer

from steprl.extras import require_extra
from steprl.hosting.protocol import PARENT_VAR, TOKEN_VAR


def _token_file(token: str, port: int) -> Path:
    fd, path = tempfile.mkstemp(prefix=f"steprl-env-{port}-", suffix=".token")  # created 0600
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return Path(path)


def serve_env(
    host: str = typer.Option("127.0.0.1", help="Interface to bind; non-loopback needs --insecure-bind."),
    port: int = typer.Option(8765, help="TCP port."),
    max_instances: int = typer.Option(256, help="Live env instances; creates beyond get 503 + Retry-After."),
    idle_ttl: float = typer.Option(600.0, help="Seconds an unused instance lives before it is reaped."),
    handler_timeout: float = typer.Option(30.0, help="Deadline (s) of one create/reset/step/close (504)."),
    max_body_bytes: int = typer.Option(1 << 20, help="Largest request body in bytes (413 beyond)."),
    plugin: list[str] = typer.Option([], "--plugin", help="Module to import first (registers envs)."),
    insecure_bind: bool = typer.Option(False, "--insecure-bind", help="Allow a non-loopback --host."),
    allow_import_paths: bool = typer.Option(
        False,
        "--allow-import-paths",
        help="Also serve envs a request names by import path (pkg.module:attr) or family (gym, mcp): "
        "any token holder can then run any code as this user. Default: registered envs only "
        "(built-ins, --plugin modules, installed 'steprl.envs' entry points).",
    ),
    keep_alive: int = typer.Option(5, help="Seconds an idle keep-alive connection stays open."),
    header_timeout: float = typer.Option(10.0, help="Seconds a request's headers may take (slowloris)."),
    body_timeout: float = typer.Option(30.0, help="Seconds a request's body may take after its headers."),
    graceful_shutdown: int = typer.Option(10, help="On SIGTERM, seconds in-flight calls get to finish."),
    limit_max_requests: int | None = typer.Option(None, help="Exit gracefully after this many requests."),
    max_threads: int | None = typer.Option(
        None, help="Sync env calls in flight at once (503 beyond); default max-instances + 16."
    ),
) -> None:
    """Serve every registered environment over HTTP (bearer token, loopback only by default).

    Registered means a built-in, one a --plugin module registers, or a name an installed package
    gives in the 'steprl.envs' entry-point group: what this server's operator chose to install.
    A request that names an import path or a family (gym, mcp) is refused (403) unless the
    server runs with --allow-import-paths."""
    require_extra("serve", feature="steprl serve-env")
    from steprl.hosting.server import serve
    from steprl.hosting.settings import Settings, is_loopback

    token = os.environ.get(TOKEN_VAR, "")
    token_path: Path | None = None
    if not is_loopback(host) and not token:
        typer.echo(
            f"refusing to bind {host}: a non-loopback server needs --insecure-bind AND a token you set "
            f"in {TOKEN_VAR} (a generated one would sit in a local file your remote clients cannot read).",
            err=True,
        )
        raise typer.Exit(2)
    if not token:
        token = secrets.token_urlsafe(32)
        token_path = _token_file(token, port)
        typer.echo(
            f"bearer token written to {token_path} (mode 0600); send it as 'Authorization: Bearer ...'"
        )
    try:
        settings = Settings(
            token=token,
            host=host,
            port=port,
            max_instances=max_instances,
            idle_ttl_s=idle_ttl,
            handler_timeout_s=handler_timeout,
            max_body_bytes=max_body_bytes,
            insecure_bind=insecure_bind,
            allow_import_paths=allow_import_paths,
            keep_alive_s=keep_alive,
            header_timeout_s=header_timeout,
            body_timeout_s=body_timeout,
            graceful_shutdown_s=graceful_shutdown,
            limit_max_requests=limit_max_requests,
            max_threads=max_threads,
        )
    except ValueError as err:
        typer.echo(f"serve-env: {err}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"steprl env server on http://{host}:{port} (max {max_instances} instances)")
    try:
        parent = os.environ.get(PARENT_VAR, "")
        serve(settings, plugin, exit_with_parent=int(parent) if parent.isdigit() else None)
    finally:
        if token_path is not None:
            token_path.unlink(missing_ok=True)
