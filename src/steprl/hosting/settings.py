"""`Settings`: how the env server runs (bind address, token, caps, deadlines, limits).

Validated when built, so a bad value fails at start with the fix in the message. The defaults
suit a trainer on the same machine; `steprl serve-env` maps its options onto these fields.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from steprl.hosting.security import LOOPBACK_HOSTS

_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Settings:
    """How the env server runs. Defaults suit a trainer on the same machine."""

    token: str  # bearer token (secrets.token_urlsafe(32)); required on every route but /healthz
    host: str = "127.0.0.1"  # anything but loopback needs insecure_bind=True
    port: int = 8765
    max_instances: int = 256  # live env instances; creates beyond answer 503 + Retry-After
    idle_ttl_s: float = 600.0  # an instance unused this long is closed by the reaper
    handler_timeout_s: float = 30.0  # deadline of one create/reset/step/close handler -> 504
    max_body_bytes: int = 1 << 20  # request bodies beyond this answer 413
    max_threads: int | None = None  # worker threads for sync env calls (None: max_instances + 16)
    retry_after_s: int = 1  # Retry-After of 503 answers
    keep_alive_s: int = 5  # idle keep-alive connections are closed after this (uvicorn)
    header_timeout_s: float = 10.0  # a request's headers must arrive within this (slowloris)
    body_timeout_s: float = 30.0  # ...and its body within this of its headers (408 beyond)
    graceful_shutdown_s: int = 10  # on SIGTERM, in-flight calls get this long to finish
    concurrency_headroom: int = 64  # uvicorn limit_concurrency = max_instances + this
    limit_max_requests: int | None = None  # exit (gracefully) after this many requests: recycling
    allowed_hosts: tuple[str, ...] = ()  # Host names accepted besides localhost/127.0.0.1/[::1]
    insecure_bind: bool = False  # allow a non-loopback host (then also pass a token you chose)
    # Also serve envs a request names by import path (package.module:attr) or family (gym, mcp):
    # their names or params say which module to import or which command to start, so with this
    # on, any token holder runs any code as the server's user. Off: registered envs only.
    allow_import_paths: bool = False
    log_level: str = "warning"

    def __post_init__(self) -> None:
        if len(self.token) < 16:
            raise ValueError(
                "Settings.token must be at least 16 characters; generate one with secrets.token_urlsafe(32)"
            )
        if not is_loopback(self.host) and not self.insecure_bind:
            raise ValueError(
                f"refusing to bind {self.host!r}: the env server executes env code for anyone who holds "
                "the token, so it binds loopback (127.0.0.1) only. To expose it anyway pass "
                "insecure_bind=True (--insecure-bind) with a token you set (STEPRL_ENV_TOKEN)."
            )
        if not 0 <= self.port < 65536:
            raise ValueError(f"Settings.port must be in 0..65535, got {self.port}")
        for name in ("max_instances", "retry_after_s", "keep_alive_s", "concurrency_headroom"):
            if getattr(self, name) < 1:
                raise ValueError(f"Settings.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("idle_ttl_s", "handler_timeout_s", "header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Settings.{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"Settings.max_body_bytes must be >= 1024, got {self.max_body_bytes}")

    @property
    def hosts(self) -> frozenset[str]:
        """Host header values served (the DNS-rebinding allowlist)."""
        extra = set(self.allowed_hosts)
        if self.host not in _WILDCARD_HOSTS:
            extra.add(f"[{self.host}]" if ":" in self.host else self.host)
        return LOOPBACK_HOSTS | {h.lower() for h in extra}
