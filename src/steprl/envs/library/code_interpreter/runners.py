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


#: kinds whose stderr already ends in why (a MemoryError; the session's "[... state lost]" note)
_SAY_WHY = (ErrorKind.OOM, ErrorKind.SESSION_DEAD, ErrorKind.PROTOCOL_ERROR)


def how_it_ended(result: ExecResult) -> str:
    """One line for the model saying why a run failed (the observation shows an error's last line).

    A Python traceback already ends in its exception, and `sys.exit("msg")` in its message (both
    exit 1); any other end says so itself: `sys.exit(3)` writes nothing to stderr, and the
    sandbox's own `error` is `ok` there (the interpreter exited by itself), never the answer.
    """
    if result.error is ErrorKind.OK:
        return f"Error: the program exited with status {result.exit_code}"
    if result.error is ErrorKind.KILLED and result.signal is not None:
        return f"Error: the program was killed by signal {result.signal}"
    return {
        ErrorKind.TIMEOUT: "Timeout: the program ran too long",
        ErrorKind.OOM: "MemoryError: the program ran out of memory",
        ErrorKind.OUTPUT_LIMIT: "Error: the program printed too much output and was stopped",
    }.get(result.error, f"Error: {result.error.value}")


def _to_output(result: ExecResult, *, session_ended: bool = False) -> RunOutput:
    """`session_ended`: the session's interpreter died in this run; its stderr ends in a note
    that says how, and that the state is lost."""
    if result.error is ErrorKind.SANDBOX_ERROR:
        # the sandbox itself failed: an infrastructure fault, never the policy's (infra_failed)
        raise RuntimeError(f"sandbox failed to run the program: {result.stderr.strip()[-200:]}")
    if result.ok:
        return RunOutput(result.stdout, None, timed_out=result.timed_out)
    stderr = result.stderr.rstrip()
    said_why = bool(stderr) and (  # a traceback or `exit("msg")` (status 1), or the session's note
        session_ended or result.error in _SAY_WHY or (result.error is ErrorKind.OK and result.exit_code == 1)
    )
    error = stderr if said_why else f"{stderr}\n{how_it_ended(result)}".lstrip("\n")
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
        result = self.session.run(code)
        return _to_output(result, session_ended=not self.session.alive)

    def close(self) -> None:
        self.session.close()
