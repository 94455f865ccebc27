"""Helpers for the env-server tests: servers with the fault envs, /proc probes, raw sockets,
a fault-injecting proxy and a scripted rollout through the real agent loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from steprl.engines.base import SamplingParams
from steprl.engines.scripted import ScriptedEngine
from steprl.hosting.local_server import LocalEnvServer
from steprl.rollout.chat import PlainFormat
from steprl.rollout.context import AppendOnly
from steprl.rollout.loop import Budgets, RolloutSetup, rollout_groups
from steprl.types import Task, Trajectory

HERE = Path(__file__).resolve().parent
#: The server imports `fault_envs` (this directory) as a plugin.
PLUGIN_ENV = {"PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)}


def start_server(**kw: Any) -> LocalEnvServer:
    return LocalEnvServer(plugins=["fault_envs"], extra_env=PLUGIN_ENV, **kw).start()


def auth(server: LocalEnvServer) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.token}"}


def http(server: LocalEnvServer, **kw: Any) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers=auth(server), trust_env=False, timeout=10.0, **kw)


def fault_task(env: str = "fault_count", i: int = 0) -> Task:
    return Task(id=f"{env}-{i}", prompt="go", env=env, seed=i, answer="ok")


def wire_task(env: str = "fault_count", i: int = 0) -> dict[str, Any]:
    return {"id": f"{env}-{i}", "prompt": "go", "env": env, "seed": i, "answer": "ok", "params": {}}


def status(pid: int) -> dict[str, int]:
    """VmRSS (kB) and Threads of a process, from /proc."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "Threads"):
            out[key] = int(value.split()[0])
    return out


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def zombie_children(pid: int) -> list[int]:
    zombies = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                fields = stat[stat.rfind(")") + 2 :].split()
                if fields[0] == "Z" and int(fields[1]) == pid:
                    zombies.append(int(entry))
    return zombies


def wait_until(predicate: Any, timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    """Poll `predicate` until true; fail with `what` after `timeout_s` (a generous hang guard)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def metrics(server: LocalEnvServer) -> dict[str, Any]:
    with http(server) as c:
        data: dict[str, Any] = c.get("/v1/metrics").json()
        return data


def raw_request(port: int, data: bytes, *, timeout_s: float = 5.0) -> bytes:
    """Send raw bytes, read until the server closes (or the timeout); the bytes received."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(data)
        chunks = []
        with contextlib.suppress(OSError):
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks)


def scripted_rollout(
    tokenizer: Any,
    make_env: Any,
    tasks: Sequence[Task],
    responses: Sequence[str],
    *,
    group_size: int = 2,
    max_turns: int = 4,
    seed: int = 0,
) -> list[Trajectory]:
    """Episodes of `tasks` through the real agent loop with a scripted engine (one asyncio.run)."""
    setup = RolloutSetup(
        make_env=make_env,
        engine=ScriptedEngine(responses, lambda s: tokenizer.encode(s, add_special_tokens=False)),
        fmt=PlainFormat(tokenizer),
        rule=AppendOnly(),
        sampling=SamplingParams(),
        budgets=Budgets(max_turns=max_turns, max_tokens_per_turn=48, max_total_tokens=1024),
    )
    groups = asyncio.run(rollout_groups(list(tasks), group_size, setup, seed=seed))
    return [t for g in groups for t in g.trajectories]


# ----------------------------------------------------------------------------------------------
# A fault-injecting HTTP/1.1 proxy (loopback, in a thread). Per request kind ("create", "reset",
# "step", "close"; a /v1/batch of one call counts as that call) it consumes a plan of faults in
# order, then forwards normally:
#   "503"          answer 503 + Retry-After: 0 without forwarding;
#   "drop_before"  close the connection without forwarding (the server never sees the call);
#   "drop_after"   forward, read the server's answer, then close without relaying it (the call
#                  WAS applied; the client sees a connection reset).


def _kind(method: str, path: str, body: bytes) -> tuple[str, bytes]:
    """The request's kind and the body to record; a one-call /v1/batch counts as that call."""
    if path == "/v1/batch":
        calls = json.loads(body)["calls"]
        if len(calls) == 1:
            return calls[0]["op"], json.dumps(calls[0]["body"]).encode()
        return "batch", body
    return _single_kind(method, path), body


def _single_kind(method: str, path: str) -> str:
    if method == "DELETE":
        return "close"
    if path.endswith("/reset"):
        return "reset"
    if path.endswith("/step"):
        return "step"
    return "create" if path == "/v1/envs" else "other"


@dataclass
class FaultProxy:
    upstream_port: int
    plan: dict[str, list[str]] = field(default_factory=dict)
    seen: dict[str, list[bytes]] = field(default_factory=lambda: defaultdict(list))  # bodies per kind
    port: int = 0
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def _read_request(self, reader: asyncio.StreamReader) -> tuple[bytes, bytes, str, str] | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        body = await reader.readexactly(length) if length else b""
        return head, body, method, path

    async def _forward(self, head: bytes, body: bytes) -> bytes:
        text = head.decode("latin-1").replace(f"127.0.0.1:{self.port}", f"127.0.0.1:{self.upstream_port}")
        text = text.replace("\r\n\r\n", "\r\nConnection: close\r\n\r\n", 1)  # one request upstream
        reader, writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        writer.write(text.encode("latin-1") + body)
        await writer.drain()
        answer = await reader.read()  # until the server closes
        writer.close()
        return answer.replace(b"connection: close\r\n", b"")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            while (request := await self._read_request(reader)) is not None:
                head, body, method, path = request
                kind, recorded = _kind(method, path, body)
                self.seen[kind].append(recorded)
                fault = self.plan[kind].pop(0) if self.plan.get(kind) else None
                if fault == "503":
                    msg = b'{"error":{"type":"proxy","message":"injected 503"}}'
                    head503 = "HTTP/1.1 503 Service Unavailable\r\nRetry-After: 0\r\n"
                    head503 += f"content-type: application/json\r\ncontent-length: {len(msg)}\r\n\r\n"
                    writer.write(head503.encode() + msg)
                    await writer.drain()
                    continue
                if fault == "drop_before":
                    break
                answer = await self._forward(head, body)
                if fault == "drop_after":
                    break
                writer.write(answer)
                await writer.drain()
        finally:
            writer.close()

    @contextlib.contextmanager
    def running(self) -> Iterator[FaultProxy]:
        loop = asyncio.new_event_loop()
        started = threading.Event()
        server_box: list[asyncio.base_events.Server] = []

        async def start() -> None:
            server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            server_box.append(server)
            started.set()

        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        asyncio.run_coroutine_threadsafe(start(), loop)
        assert started.wait(5.0), "the fault proxy did not start"
        try:
            yield self
        finally:

            async def stop() -> None:
                server_box[0].close()
                for task in list(self._tasks):
                    task.cancel()
                await asyncio.gather(*self._tasks, return_exceptions=True)

            asyncio.run_coroutine_threadsafe(stop(), loop).result(5.0)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(5.0)
            loop.close()
