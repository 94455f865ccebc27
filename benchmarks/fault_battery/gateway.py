"""Gateway abuse (`steprl serve-policy`, issue 44 item 2): the tiny model behind the OpenAI API,
fed a 10 MB message, a 100k-character prompt, a prompt past the model's context (512 positions),
`max_tokens: 100000`, a client that leaves mid-generation, SIGTERM mid-generation, a foreign
Host, 100k-deep JSON and a lone surrogate. A request the model cannot serve is a 4xx in seconds;
a long generation neither blocks other callers nor outlives its client or a SIGTERM."""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from .common import MIB, ROOT, TINY, TINY_CONFIG, Ctx, Outcome, Probe, Verdict, defect, holds, sets
from .http import Server, four_xx, tail
from .wire import Reply, call, deep_json, free_port, request_bytes, send, wait_ready

TEMPLATE = ROOT / "configs" / "templates" / "tiny_chat.jinja"
#: the tiny model from scratch with a chat template: what serve-policy serves in seconds
POLICY = [*TINY, f"model.chat_template={TEMPLATE}"]
#: a generation that does not end by itself: greedy decoding of a random model loops on tokens
#: that are not end-of-sequence (sampled, it ends within ~200 tokens)
LONG = {"max_tokens": 100_000, "temperature": 0.0}


def start_gateway(ctx: Ctx) -> Server:
    port, token = free_port(), secrets.token_urlsafe(16)
    args = ["serve-policy", str(TINY_CONFIG), "--port", str(port), *sets(POLICY)]
    proc = ctx.start(args, env={"STEPRL_GATEWAY_TOKEN": token})
    server = Server(port, token, proc)
    if not wait_ready(port, "/v1/models", token, server.alive, timeout=180):
        raise RuntimeError(f"serve-policy did not start: {tail(proc.output())}")
    return server


@contextlib.contextmanager
def gateway(ctx: Ctx, *, own: bool = False) -> Iterator[Server]:
    """A gateway for one probe: its `own` (a probe that stops or saturates it), else the one the
    probes share (started once: ~10-40 s of imports and model load each time saved), restarted
    if an earlier probe left it dead."""
    if own:
        yield start_gateway(ctx)
        return
    server: Server | None = ctx.shared.get("gateway")
    if server is None or not server.alive():
        home = Ctx(
            ctx.shared["root"] / f"gateway-{len(ctx.shared['closers'])}", shared=ctx.shared, src=ctx.src
        )
        home.tmp.mkdir(parents=True)
        server = start_gateway(home)
        ctx.shared["gateway"] = server
        ctx.shared["closers"].append(home.close)
    ctx.watched.append(server.proc)
    yield replace(server, since=len(server.proc.output()))


def chat(s: Server, content: str, timeout: float = 60, **fields: Any) -> Reply:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], **fields}
    return call(s.port, "POST", "/v1/chat/completions", body, token=s.token, timeout=timeout)


def served(s: Server) -> bool:
    """A small chat call answers within 15 s (the model is free)."""
    try:
        return chat(s, "hi", timeout=15, max_tokens=2).status == 200
    except OSError:
        return False


def verdict(reply: Reply, s: Server, want: Any, what: str) -> Verdict:
    if s.proc.mem_killed:
        return Verdict(Outcome.MEMORY, f"{what}: past the memory cap ({s.proc.peak / MIB:.0f} MB)")
    if reply.status is None and not reply.closed:
        s.proc.kill()  # still busy: the next probe gets a fresh gateway, not this one's backlog
        return Verdict(Outcome.HUNG, f"{what}: no answer in {reply.seconds:.0f} s")
    if "Traceback" in s.log():
        return Verdict(Outcome.TRACEBACK, f"{what}: status {reply.status}; the gateway logged a traceback")
    if reply.status is not None and want(reply.status):
        return holds(f"{what}: {reply.status} in {reply.seconds:.1f} s")
    return defect(f"{what}: status {reply.status} in {reply.seconds:.1f} s: {reply.body[:100]!r}")


def ten_mb_message(ctx: Ctx) -> Verdict:
    """A 4xx, or the connection cut before the body is read: memory is the point (15.9 GB
    resident for this once)."""
    with gateway(ctx) as s:
        reply = chat(s, "word " * (2 * MIB), max_tokens=4)
        if reply.status is None and reply.closed and s.alive():
            return verdict(chat(s, "hi", max_tokens=2), s, lambda c: c == 200, "cut while sent; then a call")
        return verdict(reply, s, four_xx, "a 10 MB message")


def long_prompt(ctx: Ctx) -> Verdict:
    with gateway(ctx) as s:
        return verdict(chat(s, "x " * 50_000, timeout=30, max_tokens=4), s, four_xx, "a 100k-char prompt")


def past_context(ctx: Ctx) -> Verdict:
    """~1000 tokens against the tiny model's 512 positions: not a 200 of garbage."""
    with gateway(ctx) as s:
        return verdict(chat(s, "seven " * 1000, max_tokens=4), s, four_xx, "a prompt past the context")


def huge_max_tokens(ctx: Ctx) -> Verdict:
    """`max_tokens: 100000`: refused, or cut at the context; either way answered in bounded time."""
    with gateway(ctx, own=True) as s:
        reply = chat(s, "hi", timeout=60, **LONG)
        body = reply.json() or {}
        used = (body.get("usage") or {}).get("completion_tokens", 0)
        if reply.status == 200 and used > 512:
            return defect(f"max_tokens 100000: {used} tokens generated past the 512-position context")
        return verdict(reply, s, lambda c: c in (200, 400), "max_tokens 100000")


def _long_call(s: Server, leave_after: float) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **LONG}
    with contextlib.suppress(OSError):
        data = request_bytes("POST", "/v1/chat/completions", s.port, _json(body), _auth(s))
        send(s.port, data, timeout=leave_after)  # the client leaves here, closing its socket


def _json(body: Any) -> bytes:
    return json.dumps(body).encode()


def _auth(s: Server) -> dict[str, str]:
    return {"Authorization": f"Bearer {s.token}"}


def others_wait(ctx: Ctx) -> Verdict:
    """While one client's long generation runs, a second client's 2-token call is answered."""
    with gateway(ctx, own=True) as s:
        long = threading.Thread(target=_long_call, args=(s, 40.0), daemon=True)
        long.start()
        time.sleep(1.0)
        started = time.monotonic()
        ok = served(s)
        took = time.monotonic() - started
        long.join(45)
        if not ok:
            return Verdict(Outcome.HUNG, f"a 2-token call waited {took:.0f} s behind a long generation")
        return holds(f"served in {took:.1f} s beside a long generation")


def client_leaves(ctx: Ctx) -> Verdict:
    """A client that leaves 1 s into a long generation: the model is free again at once."""
    with gateway(ctx, own=True) as s:
        _long_call(s, 1.0)
        started = time.monotonic()
        ok = served(s)
        took = time.monotonic() - started
        if not ok:
            return Verdict(Outcome.HUNG, f"the generation went on after its client left ({took:.0f} s)")
        return holds(f"free {took:.1f} s after the client left")


def sigterm_mid_generation(ctx: Ctx) -> Verdict:
    with gateway(ctx, own=True) as s:
        long = threading.Thread(target=_long_call, args=(s, 30.0), daemon=True)
        long.start()
        time.sleep(1.5)
        s.proc.signal(15)
        run = s.proc.wait(15)
        if run.timed_out:
            return Verdict(Outcome.HUNG, "SIGTERM did not stop the gateway within 15 s of a long generation")
        return holds(f"exit {run.rc} {run.seconds:.1f} s after start")


def foreign_host(ctx: Ctx) -> Verdict:
    with gateway(ctx) as s:
        reply = call(s.port, "GET", "/v1/models", token=s.token, headers={"Host": "evil.example"})
        return verdict(reply, s, four_xx, "Host: evil.example")


def deep_body(ctx: Ctx) -> Verdict:
    """100k-deep JSON (a 4xx: past the body cap, or unreadable), then 30k-deep, inside the cap:
    the JSON parser itself must say 400, not fail with a 500."""
    with gateway(ctx) as s:
        first = call(s.port, "POST", "/v1/chat/completions", raw_body=deep_json(100_000), token=s.token)
        if first.status != 400 and not (first.status and four_xx(first.status)):
            return verdict(first, s, four_xx, "100k-deep JSON")
        reply = call(s.port, "POST", "/v1/chat/completions", raw_body=deep_json(30_000), token=s.token)
        return verdict(reply, s, lambda c: c == 400, f"100k-deep: {first.status}; 30k-deep JSON")


def lone_surrogate(ctx: Ctx) -> Verdict:
    with gateway(ctx) as s:
        return verdict(chat(s, "hi \ud800", max_tokens=4), s, lambda c: c in (200, 400), "a lone surrogate")


def no_key(ctx: Ctx) -> Verdict:
    with gateway(ctx) as s:
        reply = call(s.port, "POST", "/v1/chat/completions", {"model": "tiny", "messages": []})
        return verdict(reply, s, lambda c: c == 401, "no API key")


PROBES = [
    Probe("gateway", "serve-policy: 10 MB message", "2", ten_mb_message),
    Probe("gateway", "serve-policy: 100k-char prompt", "2", long_prompt),
    Probe("gateway", "serve-policy: prompt past the context", "2", past_context),
    Probe("gateway", "serve-policy: max_tokens 100000", "2", huge_max_tokens),
    Probe("gateway", "serve-policy: a long call blocks others", "2", others_wait),
    Probe("gateway", "serve-policy: client leaves mid-generation", "2", client_leaves),
    Probe("gateway", "serve-policy: SIGTERM mid-generation", "2", sigterm_mid_generation),
    Probe("gateway", "serve-policy: Host: evil.example", "2", foreign_host),
    Probe("gateway", "serve-policy: 100k-deep JSON", "2", deep_body),
    Probe("gateway", "serve-policy: lone surrogate", "2", lone_surrogate),
    Probe("gateway", "serve-policy: no API key", "", no_key),
]
