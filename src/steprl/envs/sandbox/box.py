"""`Sandbox`: the entry point. Probes the host once, admits runs, runs one-shot code, opens sessions."""

from __future__ import annotations

import logging
import os
import threading

from steprl.envs.sandbox.limits import ExecResult, SandboxLimits, SandboxUnavailable
from steprl.envs.sandbox.probe import probe_capabilities
from steprl.envs.sandbox.rpc import Rpc
from steprl.envs.sandbox.runner import Runner, run_unconfined
from steprl.envs.sandbox.session import SandboxSession

logger = logging.getLogger(__name__)


class Sandbox:
    """Runs untrusted Python under bubblewrap. Thread-safe; `run` blocks the calling thread.

    `max_limits` are the operator's maximums: per-run `limits` (possibly model-supplied) are
    clamped to them. At most `max_concurrency` runs execute at once; the rest queue, and their
    deadline starts when they start. Each live sandbox gets its own outside uid from `uid_range`.
    `allow_unconfined=True` runs code WITHOUT isolation (plain subprocess + rlimits) on a host
    where bwrap is unusable: for development machines only, never for training on model output.
    Its sessions share its `runner` (uid pool) and `slots` (admission); see `session.SessionHost`.
    """

    def __init__(
        self,
        max_limits: SandboxLimits | None = None,
        *,
        max_concurrency: int | None = None,
        uid_range: tuple[int, int] = (200_000, 265_535),
        allow_unconfined: bool = False,
        bwrap: str | None = None,
        python: str = "/usr/bin/python3",
    ) -> None:
        self.max_limits = max_limits or SandboxLimits()
        self.capabilities = probe_capabilities(bwrap, python)
        self.allow_unconfined = allow_unconfined
        self.runner = Runner(self.capabilities.bwrap, python, self.capabilities.per_run_uid, uid_range)
        self.slots = threading.BoundedSemaphore(max_concurrency or 4 * (os.cpu_count() or 1))
        if allow_unconfined and not self.capabilities.usable:
            logger.warning(
                "Sandbox(allow_unconfined=True) on a host where bubblewrap cannot confine code: "
                "model code runs UNCONFINED (no filesystem, network or PID isolation). Dev only."
            )

    def confined(self) -> bool:
        """True: confine with bwrap. False: run unconfined (explicitly allowed). Else raise."""
        if self.capabilities.usable:
            return True
        if self.allow_unconfined:
            return False
        why = "; ".join(f"{name}: {text}" for name, text in self.capabilities.problems)
        raise SandboxUnavailable(
            f"cannot confine code on this host ({why}). Fix the host, or pass "
            "Sandbox(allow_unconfined=True) on a dev machine only."
        )

    def run(self, code: str, *, stdin: str = "", limits: SandboxLimits | None = None) -> ExecResult:
        """Execute `code` with `python3 -I` in a fresh sandbox; stdin is /dev/null unless given."""
        confined = self.confined()
        limits = self.max_limits.clamp(limits) if limits else self.max_limits
        with self.slots:
            if not confined:
                return run_unconfined(self.capabilities.python, code, stdin, limits)
            return self.runner.execute(code, stdin, limits, self.runner.take_uid())

    def session(
        self,
        limits: SandboxLimits | None = None,
        *,
        auto_restart: bool = False,
        rpc: Rpc | None = None,
        prelude: str = "",
    ) -> SandboxSession:
        """A stateful interpreter for one trajectory (see `SandboxSession`)."""
        return SandboxSession(self, limits, auto_restart=auto_restart, rpc=rpc, prelude=prelude)
