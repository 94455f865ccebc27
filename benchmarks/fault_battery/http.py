"""HTTP attacks on the env server (`steprl serve-env`, issue 44 item 2's twin on the env side):
no or wrong credentials, a foreign Host (DNS rebinding), a body past the cap, 100k-deep JSON, a
lone surrogate, trickled headers and a body that never arrives, an env named by import path.
Each must be a 4xx (never a 500) in bounded time, with the server still answering after it."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .common import MIB, Ctx, Outcome, Probe, Proc, Verdict, defect, holds, judge
from .wire import Reply, call, deep_json, free_port, request_bytes, send, wait_ready

#: the server's own deadlines, short so that a trickling client is cut in seconds
SERVER_ARGS = ["--header-timeout", "3", "--body-timeout", "3", "--handler-timeout", "5"]


@dataclass(frozen=True)
class Server:
    port: int
    token: str
    proc: Proc
    since: int = 0  # how much of its log came before this probe (a shared server's)

    def log(self) -> str:
        """What the server wrote during this probe."""
        return self.proc.output()[self.since :]

    def alive(self) -> bool:
        return self.proc.popen.poll() is None

    def answers(self) -> bool:
        """Still serving: an authorized GET /v1/metrics is a 200 within 5 s."""
        try:
            return (
                self.alive()
                and call(self.port, "GET", "/v1/metrics", token=self.token, timeout=5).status == 200
            )
        except OSError:
            return False


@contextlib.contextmanager
def env_server(ctx: Ctx) -> Iterator[Server]:
    port, token = free_port(), secrets.token_urlsafe(16)
    proc = ctx.start(["serve-env", "--port", str(port), *SERVER_ARGS], env={"STEPRL_ENV_TOKEN": token})
    server = Server(port, token, proc)
    if not wait_ready(port, "/v1/metrics", token, server.alive, timeout=90):
        raise RuntimeError(f"serve-env did not start: {tail(proc.output())}")
    yield server


def tail(log: str) -> str:
    """The last lines of a log that say something (not a rich panel's borders)."""
    lines = [x.strip(" │") for x in log.splitlines() if x.strip(" │─╭╮╰╯")]
    return " / ".join(lines[-3:])[-400:]


def verdict_of(reply: Reply, server: Server, want: Callable[[int], bool], what: str) -> Verdict:
    """`want(status)` and the server still answering; a 500 is a defect, no answer a hang."""
    if server.proc.mem_killed:
        return Verdict(Outcome.MEMORY, f"the server passed the memory cap ({server.proc.peak / MIB:.0f} MB)")
    if reply.status is None and not reply.closed:
        return Verdict(Outcome.HUNG, f"{what}: no answer in {reply.seconds:.0f} s")
    if not server.answers():
        return defect(f"{what}: the server stopped answering (exit {server.proc.popen.poll()})")
    if "Traceback" in server.log():
        return Verdict(Outcome.TRACEBACK, f"{what}: status {reply.status}; the server logged a traceback")
    if reply.status is not None and want(reply.status):
        return holds(f"{what}: {reply.status} in {reply.seconds:.1f} s")
    if reply.status is None and what.startswith("closed"):  # a connection cut: what a deadline does
        return holds(what)
    return defect(f"{what}: status {reply.status} in {reply.seconds:.1f} s: {reply.body[:120]!r}")


def four_xx(status: int) -> bool:
    return 400 <= status < 500


def no_token(ctx: Ctx) -> Verdict:
    with env_server(ctx) as s:
        reply = call(s.port, "POST", "/v1/envs", {"env": "calculator"})
        return verdict_of(reply, s, lambda c: c == 401, "create without a token")


def foreign_host(ctx: Ctx) -> Verdict:
    with env_server(ctx) as s:
        reply = call(s.port, "GET", "/v1/metrics", token=s.token, headers={"Host": "evil.example"})
        return verdict_of(reply, s, four_xx, "Host: evil.example")


def token_in_query(ctx: Ctx) -> Verdict:
    with env_server(ctx) as s:
        reply = call(s.port, "GET", f"/v1/metrics?token={s.token}")
        return verdict_of(reply, s, four_xx, "?token= in the URL")


def huge_body(ctx: Ctx) -> Verdict:
    with env_server(ctx) as s:
        body = b'{"env": "calculator", "params": {"x": "' + b"a" * (64 * MIB) + b'"}}'
        reply = call(s.port, "POST", "/v1/envs", raw_body=body, token=s.token, timeout=60)
        return verdict_of(reply, s, lambda c: c == 413, "a 64 MiB body")


def deep_body(ctx: Ctx) -> Verdict:
    with env_server(ctx) as s:
        reply = call(s.port, "POST", "/v1/envs", raw_body=deep_json(100_000), token=s.token)
        return verdict_of(reply, s, four_xx, "100k-deep JSON")


def lone_surrogate(ctx: Ctx) -> Verdict:
    """A task and an action carrying U+D800 (legal in JSON's \\u escapes, not in UTF-8)."""
    with env_server(ctx) as s:
        made = call(s.port, "POST", "/v1/envs", {"env": "calculator"}, token=s.token)
        if made.status != 200:
            return defect(f"could not create a calculator instance: {made.status} {made.body[:120]!r}")
        iid = made.json()["instance_id"]
        task = {"id": "t", "prompt": "what is 2+2? \ud800", "env": "calculator", "answer": "4"}
        reset = call(s.port, "POST", f"/v1/envs/{iid}/reset", {"task": task, "seed": 0}, token=s.token)
        if reset.status == 500 or reset.status is None:
            return verdict_of(reset, s, four_xx, "a task with a lone surrogate")
        step = call(s.port, "POST", f"/v1/envs/{iid}/step", {"action": "4 \ud800", "seq": 1}, token=s.token)
        return verdict_of(step, s, lambda c: c < 500, f"reset {reset.status}; a step with a lone surrogate")


def slow_headers(ctx: Ctx) -> Verdict:
    """Headers trickled one byte per 0.2 s: the server cuts the connection at its header
    deadline (3 s here), and answers others meanwhile."""
    with env_server(ctx) as s:
        data = request_bytes("GET", "/v1/metrics", s.port, headers={"X-Pad": "p" * 200})
        reply = send(s.port, data, timeout=20, drip=0.2)
        if reply.status is None:
            if not reply.closed:
                return Verdict(Outcome.HUNG, f"a trickling client held its connection {reply.seconds:.0f} s")
            return verdict_of(reply, s, four_xx, f"closed, no answer, after {reply.seconds:.1f} s")
        return verdict_of(reply, s, lambda c: c in (400, 408, 431), f"cut after {reply.seconds:.1f} s")


def body_never_comes(ctx: Ctx) -> Verdict:
    with env_server(ctx) as s:
        head = {"Authorization": f"Bearer {s.token}", "Content-Length": "1000"}
        reply = send(s.port, request_bytes("POST", "/v1/envs", s.port, b'{"env": "calc', head), timeout=20)
        if not reply.closed and reply.status is None:
            return Verdict(Outcome.HUNG, f"a body that never came held its connection {reply.seconds:.0f} s")
        return verdict_of(reply, s, lambda c: c in (400, 408, 413), f"cut after {reply.seconds:.1f} s")


def import_path_env(ctx: Ctx) -> Verdict:
    with env_server(ctx) as s:
        reply = call(s.port, "POST", "/v1/envs", {"env": "os:system", "params": {}}, token=s.token)
        return verdict_of(reply, s, lambda c: c == 403, "env os:system")


def sigterm_stops(ctx: Ctx) -> Verdict:
    with env_server(ctx) as s:
        s.proc.signal(15)
        run = s.proc.wait(20)
        return judge(run, (0, 143, -15), why="after SIGTERM: ")


PROBES = [
    Probe("http", "serve-env: no token", "", no_token),
    Probe("http", "serve-env: Host: evil.example", "2", foreign_host),
    Probe("http", "serve-env: token in the query", "", token_in_query),
    Probe("http", "serve-env: 64 MiB body", "2", huge_body),
    Probe("http", "serve-env: 100k-deep JSON", "2", deep_body),
    Probe("http", "serve-env: lone surrogate", "10", lone_surrogate),
    Probe("http", "serve-env: trickled headers", "", slow_headers),
    Probe("http", "serve-env: body never comes", "", body_never_comes),
    Probe("http", "serve-env: env os:system", "", import_path_env),
    Probe("http", "serve-env: SIGTERM", "", sigterm_stops),
]
