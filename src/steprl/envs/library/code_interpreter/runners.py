"""Code runners for the code-interpreter env, backed by the bubblewrap sandbox.

`SandboxRunner` runs each program in a fresh sandbox (ToRL: programs are independent);
`SessionRunner` keeps one sandboxed interpreter per trajectory (state persists between the
trajectory's programs, never across trajectories). One `Sandbox` is shared by all episodes of a
process: it owns the concurrency limit and the per-run uids.
"""

from __future__ import annotations

import functools

from steprl.envs.library.code_interpreter.env import RunOutput
from steprl.envs.sandbox import ErrorKind, ExecResult, Sandbox, SandboxLimits, SandboxSession

#: limits for model code in this env: short deadline, small memory
DEFAULT_LIMITS = SandboxLimits(wall_s=3.0, cpu_s=3.0, address_space_bytes=256 * 2**20, output_bytes=8192)


@functools.cache
def shared_sandbox() -> Sandbox:
    return Sandbox(DEFAULT_LIMITS)


def _to_output(result: ExecResult) -> RunOutput:
    if result.error is ErrorKind.SANDBOX_ERROR:
        # the sandbox itself failed: an infrastructure fault, never the policy's (infra_failed)
        raise RuntimeError(f"sandbox failed to run the program: {result.stderr.strip()[-200:]}")
    failed = not result.ok
    error = (result.stderr or f"{result.error.value}") if failed else None
    return RunOutput(result.stdout, error, timed_out=result.timed_out)


class SandboxRunner:
    def __init__(self, sandbox: Sandbox | None = None) -> None:
        self.sandbox = sandbox or shared_sandbox()

    def run(self, code: str) -> RunOutput:
        return _to_output(self.sandbox.run(code))

    def close(self) -> None:
        pass


class SessionRunner:
    def __init__(self, sandbox: Sandbox | None = None) -> None:
        self.session = SandboxSession(sandbox or shared_sandbox())

    def run(self, code: str) -> RunOutput:
        return _to_output(self.session.run(code))

    def close(self) -> None:
        self.session.close()
