"""Escapes through the code env's sandbox (`code`, served by `steprl serve-env`): the model's
program tries to write, run, read and connect outside, to eat the host's memory, to fork, to kill
its parent and to outlive its deadline. The marker file, the secret, the listening socket and the
server's own memory say whether anything got out."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

from .common import MIB, Ctx, Outcome, Probe, Verdict, defect, holds
from .http import Server, env_server
from .wire import call


def _step(
    ctx: Ctx, program: str, *, wait_after: float = 0.0, timeout: float = 60
) -> tuple[Verdict | None, str]:
    """`program` as the model's action in a fresh `code` episode: a verdict if the server failed
    it (hang, memory, no answer), else None and the observation's text."""
    with env_server(ctx) as s:
        made = call(s.port, "POST", "/v1/envs", {"env": "code"}, token=s.token)
        if made.status != 200:
            return defect(f"no code env: {made.status} {made.body[:120]!r}"), ""
        iid = made.json()["instance_id"]
        task = {"id": "t", "prompt": "compute 1", "env": "code", "answer": "1"}
        call(s.port, "POST", f"/v1/envs/{iid}/reset", {"task": task, "seed": 0}, token=s.token)
        action = f"```python\n{program}\n```\n```output"
        reply = call(
            s.port,
            "POST",
            f"/v1/envs/{iid}/step",
            {"action": action, "seq": 1},
            token=s.token,
            timeout=timeout,
        )
        time.sleep(wait_after)
        return _server_verdict(s, reply.status, reply.seconds), reply.body.decode("utf-8", errors="replace")


def _server_verdict(s: Server, status: int | None, seconds: float) -> Verdict | None:
    if s.proc.mem_killed:
        return Verdict(Outcome.MEMORY, f"the env server passed the memory cap ({s.proc.peak / MIB:.0f} MB)")
    if status is None:
        return Verdict(Outcome.HUNG, f"the step did not answer in {seconds:.0f} s")
    if not s.answers():
        return defect("the env server stopped answering after the program ran")
    return None


def _escape_probe(make_program: Callable[[Ctx], str], *, wait_after: float = 0.0) -> Callable[[Ctx], Verdict]:
    def probe(ctx: Ctx) -> Verdict:
        failed, text = _step(ctx, make_program(ctx), wait_after=wait_after)
        if ctx.marker.exists():
            return Verdict(Outcome.ESCAPED, f"the program touched {ctx.marker.name} on the host")
        return failed or holds(f"observation: {text[:100]}")

    return probe


def write_file(ctx: Ctx) -> str:
    return f"open({str(ctx.marker)!r}, 'w').write('x')"


def run_command(ctx: Ctx) -> str:
    marker = str(ctx.marker)
    return f"import os, subprocess\nos.system('touch {marker}')\nsubprocess.run(['touch', {marker!r}])"


def linger(ctx: Ctx) -> str:
    """A grandchild in a session of its own that touches the marker after the deadline."""
    return (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        time.sleep(5); open({str(ctx.marker)!r}, 'w')\n"
        "    os._exit(0)\n"
        "print('forked')"
    )


def read_secret(ctx: Ctx) -> Verdict:
    secret = ctx.tmp / "secret.txt"
    token = "SECRET-" + ctx.tmp.name
    secret.write_text(token)
    failed, text = _step(ctx, f"print(open({str(secret)!r}).read())")
    if token in text:
        return Verdict(Outcome.ESCAPED, "the program read a host file and printed it")
    return failed or holds(f"observation: {text[:100]}")


def connect_out(ctx: Ctx) -> Verdict:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        program = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'hi')"
        failed, text = _step(ctx, program)
        try:
            conn, _ = listener.accept()
            conn.close()
            return Verdict(Outcome.ESCAPED, "the program connected to a host socket on loopback")
        except TimeoutError:
            return failed or holds(f"observation: {text[:100]}")


def _bounded(program: str, what: str) -> Callable[[Ctx], Verdict]:
    def probe(ctx: Ctx) -> Verdict:
        failed, text = _step(ctx, program, timeout=60)
        return failed or holds(f"{what}: {text[:100]}")

    return probe


#: 1000 children that sleep (the sandbox allows 64 processes): linear, not exponential, so that a
#: sandbox that failed to confine it would cost the host 1000 sleeping processes, not the machine
FORKS = (
    "import os, time\nn = 0\nfor _ in range(1000):\n    try:\n        pid = os.fork()\n"
    "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(20)\n        os._exit(0)\n"
    "    n += 1\nprint(n, 'forked')"
)

PROBES = [
    Probe("sandbox", "write a host file", "", _escape_probe(write_file)),
    Probe("sandbox", "run a host command", "", _escape_probe(run_command)),
    Probe("sandbox", "a setsid grandchild outlives the run", "", _escape_probe(linger, wait_after=7.0)),
    Probe("sandbox", "read a host file", "", read_secret),
    Probe("sandbox", "connect to a loopback socket", "", connect_out),
    Probe("sandbox", "allocate 8 GiB", "", _bounded("x = bytearray(8 << 30)\nprint(len(x))", "8 GiB")),
    Probe("sandbox", "spin forever", "", _bounded("while True:\n    pass", "spin")),
    Probe("sandbox", "fork 1000 sleepers", "", _bounded(FORKS, "forks")),
    Probe("sandbox", "kill its parent", "", _bounded("import os, signal\nos.kill(os.getppid(), 9)", "kill")),
]
