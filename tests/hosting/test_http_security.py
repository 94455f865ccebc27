"""HTTP security of the env server on loopback: reliability cases HTTP-01 .. HTTP-10.

Every server is a real `steprl serve-env` process (`LocalEnvServer`) on 127.0.0.1 with the
test-only fault envs loaded as a plugin; raw sockets drive the cases httpx would not send
(no Host header, lying Content-Length, trickled headers). Time bounds are generous hang guards.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from http_helpers import (
    fault_task,
    http,
    metrics,
    raw_request,
    scripted_rollout,
    start_server,
    status,
    wait_until,
    wire_task,
)
from typer.testing import CliRunner

from steprl.hosting import security
from steprl.hosting.client import RetryPolicy
from steprl.hosting.command import _token_file
from steprl.hosting.http_backend import HttpEnvBackend
from steprl.hosting.local_server import free_port
from steprl.hosting.server import build_app
from steprl.hosting.settings import Settings
from steprl.types import EndReason

MIB = 1 << 20


@pytest.fixture(scope="module")
def server():
    with start_server(
        max_instances=6, handler_timeout_s=1.0, keep_alive_s=1, header_timeout_s=1.0, body_timeout_s=1.0
    ) as s:
        yield s


def _no_cors(response: httpx.Response) -> None:
    assert not [h for h in response.headers if h.lower().startswith("access-control-")]


def _create(c: httpx.Client, env: str = "fault_count", **params) -> str:
    r = c.post("/v1/envs", json={"env": env, "params": params})
    assert r.status_code == 200, r.text
    return str(r.json()["instance_id"])


# ----------------------------------------------------------------------------------------------
# HTTP-01


def _listeners(port: int) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp*) of sockets listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.append(address)
    return found


def test_http01_listens_on_loopback_only_and_refuses_wildcard_binds(server, monkeypatch):
    assert _listeners(server.port) == ["0100007F"]  # 127.0.0.1, and no IPv6 / wildcard socket
    token = "t" * 32
    for host in ("0.0.0.0", "::", "192.168.1.10"):
        with pytest.raises(ValueError, match="insecure_bind"):
            Settings(token=token, host=host)
    Settings(token=token, host="0.0.0.0", insecure_bind=True)  # explicit opt-in (with a token)
    with pytest.raises(ValueError, match="token"):
        Settings(token="", host="127.0.0.1")

    from steprl.cli import app

    monkeypatch.delenv("STEPRL_ENV_TOKEN", raising=False)
    runner = CliRunner()
    refused = runner.invoke(app, ["serve-env", "--host", "0.0.0.0", "--insecure-bind"])
    assert refused.exit_code == 2 and "STEPRL_ENV_TOKEN" in refused.output  # no generated-token wildcard
    refused = runner.invoke(app, ["serve-env", "--host", "::"], env={"STEPRL_ENV_TOKEN": token})
    assert refused.exit_code == 2 and "insecure" in refused.output


# ----------------------------------------------------------------------------------------------
# HTTP-02


def test_http02_every_route_but_healthz_needs_the_bearer_token(server):
    token = server.token
    with httpx.Client(base_url=server.url, trust_env=False) as c:
        assert c.get("/healthz").status_code == 200
        bad = [
            {},
            {"Authorization": "Bearer wrong-token"},
            {"Authorization": "Bearer"},  # empty token
            {"Authorization": ""},
            {"Authorization": f"Basic {token}"},
            {"Authorization": token},
        ]
        for headers in bad:
            for method, path in (("GET", "/v1/metrics"), ("POST", "/v1/envs"), ("DELETE", "/v1/envs/x")):
                r = c.request(method, path, headers=headers, json={"env": "fault_count"})
                assert r.status_code == 401, (headers, path)
                assert r.json()["error"]["type"] == "unauthorized"
                assert r.headers["www-authenticate"] == "Bearer"
                assert token not in r.text
        # A token in the URL is refused even when it is right, and even with a valid header.
        for query in (f"token={token}", f"access_token={token}", "api_key=whatever", f"x={token}"):
            r = c.get(f"/v1/metrics?{query}")
            assert r.status_code == 401 and r.json()["error"]["type"] == "token_in_url"
            r = c.get(f"/v1/metrics?{query}", headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 401 and token not in r.text
        assert c.get("/v1/metrics", headers={"Authorization": f"bearer {token}"}).status_code == 200
    assert token not in server.log_tail(1_000_000)  # never logged (no access log; no echo)


def test_http02_a_generated_token_goes_to_a_private_file_never_to_the_output(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "STEPRL_ENV_TOKEN"}
    port = free_port()
    argv = [sys.executable, "-m", "steprl.hosting", "--port", str(port), "--graceful-shutdown", "1"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        line = proc.stdout.readline().decode()
        token_path = Path(line.split("written to ")[1].split(" ")[0])
        assert stat.S_IMODE(token_path.stat().st_mode) == 0o600
        token = token_path.read_text()
        assert len(token) >= 32 and token not in line
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _answers(url), 30, "the server to start")
        r = httpx.get(f"{url}/v1/metrics", headers={"Authorization": f"Bearer {token}"}, trust_env=False)
        assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=30)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and token not in output
    assert not token_path.exists()  # removed when the server exits


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def test_http02_token_is_compared_in_constant_time(monkeypatch):
    calls = []
    real = security.secrets.compare_digest

    def spy(a, b):
        calls.append((type(a), type(b)))
        return real(a, b)

    monkeypatch.setattr(security.secrets, "compare_digest", spy)
    token = "s" * 32
    app = build_app(Settings(token=token, port=0))

    async def go() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            wrong = await c.get("/v1/metrics", headers={"Authorization": "Bearer " + "s" * 31 + "x"})
            right = await c.get("/v1/metrics", headers={"Authorization": f"Bearer {token}"})
            return [wrong.status_code, right.status_code]

    assert asyncio.run(go()) == [401, 200]
    assert len(calls) == 2  # both checks went through secrets.compare_digest


# ----------------------------------------------------------------------------------------------
# HTTP-03


def test_http03_foreign_host_and_origin_are_refused_and_no_cors_headers(server):
    port = server.port
    with http(server) as c:
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1:1", f"127.0.0.2:{port}"):
            r = c.get("/v1/metrics", headers={"Host": host})
            assert r.status_code == 421 and r.json()["error"]["type"] == "misdirected_request", host
            _no_cors(r)
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "localhost"):
            assert c.get("/v1/metrics", headers={"Host": host}).status_code == 200, host
        for origin in ("http://evil.example", "null", f"http://evil.example:{port}", "file://"):
            r = c.get("/v1/metrics", headers={"Origin": origin})
            assert r.status_code == 400 and r.json()["error"]["type"] == "foreign_origin", origin
            _no_cors(r)
        ok = c.get("/v1/metrics", headers={"Origin": f"http://127.0.0.1:{port}"})
        assert ok.status_code == 200
        _no_cors(ok)
        preflight = c.options(
            "/v1/envs",
            headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
        )
        assert preflight.status_code in (400, 401, 405)
        _no_cors(preflight)
    # HTTP/1.0 without a Host header: refused (h11 requires Host only for 1.1).
    answer = raw_request(port, b"GET /healthz HTTP/1.0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400"), answer[:80]
    assert b"access-control-" not in answer.lower()


# ----------------------------------------------------------------------------------------------
# HTTP-04


def _post_head(server, extra: str) -> bytes:
    return (
        f"POST /v1/envs HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        f"Authorization: Bearer {server.token}\r\ncontent-type: application/json\r\n{extra}\r\n"
    ).encode()


def _stream_until_answer(server, head: bytes, chunks: int, chunk: bytes) -> tuple[bytes, int]:
    """Send `head` then up to `chunks` chunks, stopping once the server answers; the answer and
    the number of body bytes sent."""
    sent = 0
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(head)
        try:
            for _ in range(chunks):
                if select.select([s], [], [], 0)[0]:
                    break
                s.sendall(chunk)
                sent += len(chunk)
        except OSError:  # the server closed the connection after its 413
            pass
        answer = b""
        try:
            while piece := s.recv(65536):
                answer += piece
        except OSError:
            pass
    return answer, sent


def test_http04_oversized_bodies_get_413_early_without_buffering(server):
    rss0 = status(server.pid)["VmRSS"]
    # A declared 50 MB body: refused before a single body byte is read.
    answer = raw_request(server.port, _post_head(server, "Content-Length: 52428800\r\n"))
    assert answer.startswith(b"HTTP/1.1 413") and b"body_too_large" in answer
    # A chunked 50 MB body (no Content-Length): cut once the streamed bytes pass the 1 MiB cap.
    size = 64 * 1024
    chunk = f"{size:x}\r\n".encode() + b"x" * size + b"\r\n"
    answer, sent = _stream_until_answer(
        server, _post_head(server, "Transfer-Encoding: chunked\r\n"), 800, chunk
    )
    assert answer.startswith(b"HTTP/1.1 413"), answer[:120]
    assert sent < 20 * MIB  # answered long before the 50 MB were sent
    # A lying Content-Length (20 bytes declared, 5 MiB sent): only 20 bytes are read as the body.
    answer, _ = _stream_until_answer(server, _post_head(server, "Content-Length: 20\r\n"), 80, b"y" * size)
    assert answer.startswith(b"HTTP/1.1 4"), answer[:120]  # 422 (not JSON); the rest is junk, closed
    with http(server) as c:
        assert c.get("/healthz").status_code == 200
    assert status(server.pid)["VmRSS"] - rss0 < 20 * 1024  # kB: nothing close to 50 MB was held


def test_http04_body_limit_counts_streamed_bytes_whatever_content_length_claims():
    """The middleware alone: a transport that does not enforce framing delivers more than the
    declared length; the cap still holds and the app's own answer is dropped."""
    seen = []

    async def app(scope, receive, send):
        while (message := await receive())["more_body"]:
            seen.append(len(message["body"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def go() -> list[dict]:
        chunks = [{"type": "http.request", "body": b"z" * 600, "more_body": True} for _ in range(4)]
        sent: list[dict] = []

        async def receive():
            return chunks.pop(0)

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "headers": [(b"content-length", b"10")]}
        await security.BodyLimit(app, max_bytes=1024)(scope, receive, send)
        return sent

    sent = asyncio.run(go())
    assert sent[0]["status"] == 413 and len(sent) == 2
    assert b"body_too_large" in sent[1]["body"]
    assert sum(seen) <= 1024


# ----------------------------------------------------------------------------------------------
# HTTP-05


def test_http05_slowloris_and_idle_keepalive_connections_are_closed(server):
    head = f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nX-Slow: ".encode()
    slow = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    idle = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    try:
        idle.sendall(f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n\r\n".encode())
        answer = b""
        while b'{"status":"ok"}' not in answer:
            answer += idle.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200")
        slow.sendall(head)
        t0, closed = time.monotonic(), False
        with http(server) as c:
            while time.monotonic() - t0 < 8 and not closed:
                try:
                    slow.sendall(b"a")  # one header byte every 0.2 s, never finishing
                    closed = bool(select.select([slow], [], [], 0.2)[0]) and slow.recv(1024) == b""
                except OSError:
                    closed = True
                started = time.monotonic()
                assert c.get("/healthz").status_code == 200  # others are served meanwhile
                assert time.monotonic() - started < 2.0
        assert closed, "a connection trickling its headers was never closed"
        assert time.monotonic() - t0 < 6  # header deadline (1 s) + slack
        idle.settimeout(6)
        assert idle.recv(1024) == b""  # closed by the server after its keep-alive (1 s)
    finally:
        slow.close()
        idle.close()
    # Oversized headers: refused by the header cap (431) when they arrive at once, and by h11's
    # 16 KB limit on an incomplete header block (400) when they trickle in.
    big = f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nX-Big: {'b' * 40_000}\r\n\r\n"
    assert raw_request(server.port, big.encode()).startswith(b"HTTP/1.1 431")
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(big.encode()[:20_000])
        time.sleep(0.2)
        with contextlib.suppress(OSError):
            s.sendall(big.encode()[20_000:])
        assert s.recv(65536).startswith(b"HTTP/1.1 400")


def test_http05_a_trickled_body_gets_408_and_the_connection_is_closed(server):
    body = json.dumps({"env": "fault_count", "params": {}}).encode()
    head = (
        f"POST /v1/envs HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        f"Authorization: Bearer {server.token}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    created = metrics(server)["instances_created"]
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as slow:
        slow.sendall(head)
        t0, answer, sent = time.monotonic(), b"", 0
        while time.monotonic() - t0 < 8 and not answer.endswith(b"}"):
            if sent < len(body) - 1:  # one byte every 0.2 s, never the last one
                with contextlib.suppress(OSError):
                    slow.sendall(body[sent : sent + 1])
                sent += 1
            if select.select([slow], [], [], 0.2)[0]:
                chunk = slow.recv(65536)
                if not chunk:
                    break
                answer += chunk
        took = time.monotonic() - t0
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b'"type":"body_timeout"' in answer
        assert took < 6  # body deadline (1 s) + slack
        slow.settimeout(5)
        with contextlib.suppress(ConnectionResetError):
            assert slow.recv(1024) == b""  # closed: the rest of that body is never read as a request
    assert metrics(server)["instances_created"] == created  # nothing was created


# ----------------------------------------------------------------------------------------------
# HTTP-06


def test_http06_over_the_instance_cap_is_a_fast_503_and_the_client_backs_off(server):
    with http(server) as c:
        free = 6 - metrics(server)["instances_live"]
        held = [_create(c) for _ in range(free)]
        started = time.monotonic()
        r = c.post("/v1/envs", json={"env": "fault_count"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "server_busy"
        assert time.monotonic() - started < 2.0

        async def client_waits_for_a_slot() -> tuple[str, float]:
            backend = HttpEnvBackend(server.url, server.token, "fault_count", {}, call_timeout_s=10.0)
            env = backend.make_env(fault_task())
            t0 = time.monotonic()
            try:
                obs = await env.reset(fault_task(), 0)
            finally:
                await env.close()
            return obs.text, time.monotonic() - t0

        async def free_one_later() -> None:
            await asyncio.sleep(0.5)
            await asyncio.to_thread(c.delete, f"/v1/envs/{held.pop()}")

        async def both():
            return await asyncio.gather(client_waits_for_a_slot(), free_one_later())

        (text, waited), _ = asyncio.run(both())
        assert text.startswith("ready") and 0.5 < waited < 8.0  # honoured Retry-After, then got in
        for instance_id in held:
            assert c.delete(f"/v1/envs/{instance_id}").status_code == 200


# ----------------------------------------------------------------------------------------------
# HTTP-07


def test_http07_a_handler_that_never_returns_is_a_504_and_its_instance_is_destroyed(server):
    threads0 = status(server.pid)["Threads"]
    tasks0 = metrics(server)["asyncio_tasks"]
    with http(server) as c:
        destroyed0 = metrics(server)["instances_destroyed"]
        for env, params in (("fault_sleep", {"where": "step"}), ("fault_async", {"seconds": 3600})):
            instance_id = _create(c, env, **params)
            assert c.post(
                f"/v1/envs/{instance_id}/reset", json={"task": wire_task(env), "seed": 0}
            ).is_success
            started = time.monotonic()
            r = c.post(f"/v1/envs/{instance_id}/step", json={"action": "x", "seq": 1})
            assert r.status_code == 504 and r.json()["error"]["type"] == "handler_timeout"
            assert 0.9 < time.monotonic() - started < 5.0
            after = c.post(f"/v1/envs/{instance_id}/step", json={"action": "x", "seq": 1})
            assert after.status_code == 409 and after.json()["error"]["type"] == "instance_closed"
        assert metrics(server)["instances_destroyed"] == destroyed0 + 2
    # The hung thread is released by close(); no thread stays behind.
    wait_until(lambda: status(server.pid)["Threads"] <= threads0, 5.0, "the server's threads to settle")
    m = metrics(server)
    assert m["threads_alive"] == 0 and m["asyncio_tasks"] <= tasks0  # no thread or task leak


# ----------------------------------------------------------------------------------------------
# HTTP-08


def test_http08_bad_bodies_are_structured_422s_and_env_bugs_never_leak_tracebacks(server):
    with http(server) as c:
        instance_id = _create(c)
        reset = {"task": wire_task(), "seed": 0}
        assert c.post(f"/v1/envs/{instance_id}/reset", json=reset).is_success
        step = f"/v1/envs/{instance_id}/step"
        bad = [
            ("/v1/envs", b'{"env": "fault_count",'),  # malformed JSON
            ("/v1/envs", b'["fault_count"]'),  # not an object
            ("/v1/envs", b'{"env": 3}'),  # wrong type
            ("/v1/envs", b'{"env": "fault_count", "extra": 1}'),  # unknown field
            ("/v1/envs", b"{}"),  # missing field
            (step, b'{"action": "x", "seq": "1"}'),  # strings are not coerced
            (step, b'{"action": "x", "seq": 0}'),  # seq starts at 1
            (step, b'{"action": null, "seq": 1}'),
            (f"/v1/envs/{instance_id}/reset", b'{"task": {"id": "t"}, "seed": 0}'),
            # issue 44 item 11: a lone surrogate (valid JSON, not Unicode) was a 500 and a traceback
            (step, b'{"action": "4 \\ud800", "seq": 1}'),
            (
                f"/v1/envs/{instance_id}/reset",
                b'{"task": {"id": "t", "prompt": "2+2? \\ud800", "env": "fault_count"}, "seed": 0}',
            ),
        ]
        for path, body in bad:
            r = c.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 422, (path, body, r.text)
            assert r.json()["error"]["type"] == "validation_error"
            assert "Traceback" not in r.text and 'File "' not in r.text
            assert b"ud800" not in body or "lone surrogate" in r.json()["error"]["message"], r.text
        raising = _create(c, "fault_raise")
        c.post(f"/v1/envs/{raising}/reset", json=reset)
        r = c.post(f"/v1/envs/{raising}/step", json={"action": "x", "seq": 1})
        assert r.status_code == 500 and r.json() == {
            "error": {
                "type": "env_error",
                "message": "env 'fault_raise' step() raised RuntimeError: env bug in step",
            }
        }
        for i in (instance_id, raising):
            c.delete(f"/v1/envs/{i}")


# ----------------------------------------------------------------------------------------------
# HTTP-09

_PROBE = r"""
import json, os, socket
out = {"environ": dict(os.environ)}
try:
    s = socket.create_connection(("127.0.0.1", PORT), timeout=2)
    s.sendall(b"GET /healthz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
    out["connect"] = s.recv(200).decode("latin-1")
except OSError as e:
    out["connect"] = "failed: " + type(e).__name__
files = {}
for path in PATHS:
    try:
        files[path] = open(path, errors="replace").read()[:4000]
    except OSError as e:
        files[path] = "unreadable: " + type(e).__name__
for root, _, names in os.walk("/tmp"):
    for name in names:
        p = os.path.join(root, name)
        try:
            files[p] = open(p, errors="replace").read()[:4000]
        except OSError:
            pass
for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
    for what in ("environ", "cmdline"):
        try:
            files[f"/proc/{pid}/{what}"] = open(f"/proc/{pid}/{what}", "rb").read()[:4000].decode("latin-1")
        except OSError:
            pass
out["files"] = files
print(json.dumps(out))
"""


def test_http09_code_in_the_sandbox_cannot_reach_the_server_or_read_its_token(server):
    from steprl.envs.sandbox import Sandbox, SandboxLimits, probe_capabilities

    caps = probe_capabilities()
    if not caps.usable:
        pytest.skip(f"the sandbox cannot confine code on this host: {caps.problems}")
    token_path = _token_file(server.token, server.port)  # where `steprl serve-env` would keep it
    try:
        paths = [str(token_path), str(server.log_path), f"/proc/{server.pid}/environ"]
        code = _PROBE.replace("PORT", str(server.port)).replace("PATHS", repr(paths))
        result = Sandbox(SandboxLimits(wall_s=10.0, cpu_s=5.0)).run(code)
    finally:
        token_path.unlink()
    assert result.ok, result.stderr
    assert server.token not in result.stdout and server.token not in result.stderr
    out = json.loads(result.stdout)
    assert out["connect"].startswith("failed"), out["connect"]  # its own network namespace
    assert not any(k.startswith("STEPRL") for k in out["environ"])
    for path in paths:
        assert out["files"][path].startswith("unreadable"), path


# ----------------------------------------------------------------------------------------------
# HTTP-10


@pytest.mark.slow
def test_http10_soak_with_request_recycling_fails_only_as_infra_failed(tokenizer):
    """A small soak against a server recycled every 80 requests (uvicorn limit_max_requests)
    under a supervisor (auto_restart). Episodes crossing a recycle end `infra_failed` (their
    instance died with the process); the rest complete; nothing escapes."""
    with start_server(limit_max_requests=80, auto_restart=True, graceful_shutdown_s=2) as srv:
        backend = HttpEnvBackend(
            srv.url,
            srv.token,
            "fault_count",
            {"episode_len": 2},
            call_timeout_s=10.0,
            retry=RetryPolicy(max_attempts=6, base_s=0.05, max_backoff_s=0.4),
            coalesce=False,  # one request per call: the recycle point counts requests
        )
        rss = []
        trajectories = []
        for round_ in range(3):
            tasks = [fault_task(i=i) for i in range(6)]
            got = scripted_rollout(tokenizer, backend.make_env, tasks, ["ok"], group_size=3, seed=round_)
            assert len(got) == 18  # trajectories in == out
            trajectories += got
            wait_until(srv.healthy, 20, "the server to come back")
            rss.append(status(srv.pid)["VmRSS"])
        ends = [t.end for t in trajectories]
        assert set(ends) <= {EndReason.ANSWERED, EndReason.INFRA_FAILED}
        assert ends.count(EndReason.ANSWERED) >= len(ends) // 2
        assert srv.restarts >= 1  # up to 54 episodes x 5 requests: recycled at least once
        assert max(rss) < 200 * 1024  # kB
