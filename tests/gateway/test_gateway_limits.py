"""The gateway under hostile or oversized requests (issue 44, items 2 and 11): `steprl serve-policy`
bounds the body before parsing it, the rendered prompt and `max_tokens` by the model's context,
refuses a foreign `Host` as `serve-env` does, answers deep or broken JSON with a 400, cancels a
generation whose client went away (others are served meanwhile) and stops on SIGTERM within
seconds even mid-generation.

The request tests run against the real CLI (the tiny model with its chat template: 512
positions); the cancel test against the HF engine on a tiny model slowed by a forward hook, so
that a generation is still running when its client leaves.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import uvicorn

import cli_zygote
from steprl.engines.hf import HFEngine
from steprl.gateway.app import make_app
from steprl.gateway.policy_gateway import Gateway
from steprl.hosting.local_server import free_port
from steprl.models import tiny
from steprl.rollout.chat_format import ChatFormat

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "configs" / "templates" / "tiny_chat.jinja"
TOKEN = "limits-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HI = [{"role": "user", "content": "hi"}]
CONTEXT = tiny.TinyModelSpec().max_positions  # 512: the served model's positions


@dataclass
class Served:
    proc: subprocess.Popen[str]
    url: str


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """`steprl serve-policy` on the tiny model with its chat template (no warm start)."""
    port = free_port()
    overrides = ["model.format=chat", f"model.chat_template={TEMPLATE}", "model.init=scratch"]
    command = [sys.executable, "-c", "from steprl.cli import main; main()", "serve-policy"]
    command += [str(ROOT / "configs" / "calculator_tiny.yaml"), "--port", str(port)]
    for o in overrides:
        command += ["--set", o]
    env = {**os.environ, "STEPRL_GATEWAY_TOKEN": TOKEN}
    proc = cli_zygote.popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 240  # imports and the model: seconds, more on a busy machine
    while True:
        try:
            httpx.get(f"{url}/models", headers=AUTH, timeout=5).raise_for_status()
            break
        except httpx.TransportError:
            assert proc.poll() is None and time.monotonic() < deadline, (
                proc.stdout.read() if proc.stdout else ""
            )
            time.sleep(0.3)
    try:
        yield Served(proc, url)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _post(url: str, body: Any = None, *, raw: bytes | None = None, timeout: float = 60) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    headers = {**AUTH, "content-type": "application/json"}
    return httpx.post(url, content=content, headers=headers, timeout=timeout)


def _error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, (response.status_code, response.text[:300])
    message: str = response.json()["error"]["message"]
    assert "\n" not in message
    return message


def test_a_body_over_the_cap_is_413_before_it_is_parsed(served: Served) -> None:
    """A few bytes of request padded with JSON whitespace past the cap: refused for its size
    alone (the cap is named), never read whole or parsed."""
    padded = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1' + b" " * 200_000 + b"}"
    says = _error(_post(f"{served.url}/chat/completions", raw=padded), 413)
    assert "request body over" in says and "bytes" in says
    # a body under the cap is served as before
    assert _post(f"{served.url}/chat/completions", {"messages": HI, "max_tokens": 1}).status_code == 200


def test_prompts_and_max_tokens_past_the_context_are_400_naming_the_numbers(served: Served) -> None:
    """A rendered prompt longer than the model's positions, a 5,000-id completions prompt, a
    max_tokens over the context and a prompt + max_tokens past it: 400 with the numbers; a
    request that fits is answered, with no more tokens than the context leaves."""
    chat, complete = f"{served.url}/chat/completions", f"{served.url}/completions"
    long = [{"role": "user", "content": "x" * 600}]
    says = _error(_post(chat, {"messages": long, "max_tokens": 5}), 400)
    assert "601" in says and str(CONTEXT) in says
    says = _error(_post(complete, {"prompt": [5] * 5000, "max_tokens": 5}), 400)
    assert "5000" in says and str(CONTEXT) in says
    says = _error(_post(chat, {"messages": HI, "max_tokens": 100_000}, timeout=20), 400)
    assert "100000" in says and str(CONTEXT) in says
    half = [{"role": "user", "content": "x" * 300}]
    says = _error(_post(chat, {"messages": half, "max_tokens": 300}), 400)
    assert "301" in says and "300" in says and str(CONTEXT) in says
    full = [{"role": "user", "content": "x" * 500}]  # 501 tokens + 11 is the context exactly
    ok = _post(chat, {"messages": full, "max_tokens": CONTEXT - 501})
    assert ok.status_code == 200 and ok.json()["usage"]["total_tokens"] <= CONTEXT
    unasked = _post(chat, {"messages": full})  # the context leaves 11 of the default 256
    assert unasked.status_code == 200 and unasked.json()["usage"]["completion_tokens"] <= CONTEXT - 501


def test_deep_or_broken_json_is_a_400_with_the_reason(served: Served) -> None:
    chat, complete = f"{served.url}/chat/completions", f"{served.url}/completions"
    too_deep = _post(chat, raw=b'{"messages": ' + b"[" * 20_000 + b"]" * 20_000 + b"}")
    assert "nest" in _error(too_deep, 400)
    schema: Any = {"type": "string"}
    for _ in range(200):  # deep enough to break a recursive render, far under the parser's limit
        schema = {"type": "object", "properties": {"a": schema}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    assert "nest" in _error(_post(chat, {"messages": HI, "tools": tools, "max_tokens": 1}), 400)
    huge = _post(chat, raw=b"[" * 100_000 + b"]" * 100_000)
    assert huge.status_code in (400, 413), huge.text[:300]
    lone = b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 1}'
    assert "surrogate" in _error(_post(chat, raw=lone), 400)
    assert "surrogate" in _error(_post(complete, raw=b'{"prompt": "\\udfff", "max_tokens": 1}'), 400)
    assert "JSON" in _error(_post(chat, raw=b'{"messages": [\xff]}'), 400)


def test_a_foreign_host_is_refused_as_serve_env_refuses_it(served: Served) -> None:
    """DNS rebinding: a page on evil.example re-bound to 127.0.0.1 sends its own Host."""
    for headers, status in (({"host": "evil.example"}, 421), ({"origin": "http://evil.example"}, 400)):
        refused = httpx.get(f"{served.url}/models", headers={**AUTH, **headers}, timeout=30)
        assert refused.status_code == status, refused.text[:300]
    assert httpx.get(f"{served.url}/models", headers=AUTH, timeout=30).status_code == 200


def test_sigterm_mid_generation_stops_the_server_within_seconds(served: Served) -> None:
    """(Last: it stops the module's server.) A generation as long as the context allows is
    running; SIGTERM: the server exits 0 within seconds and logs its metrics."""
    body = {"messages": HI, "max_tokens": CONTEXT - 2, "temperature": 1.0}
    asked = threading.Thread(target=lambda: _post(f"{served.url}/chat/completions", body, timeout=60))
    asked.start()
    time.sleep(0.5)
    start = time.monotonic()
    served.proc.send_signal(signal.SIGTERM)
    try:
        out, _ = served.proc.communicate(timeout=20)
    finally:
        asked.join(60)
    assert served.proc.returncode == 0, out[-2000:]
    assert time.monotonic() - start < 10 and "gateway/calls=" in out, out[-2000:]


# -- a generation still running when its client leaves ------------------------------------------


class Slow:
    """A forward hook: every forward pass of the tiny model takes `delay_s` longer, and never
    samples a stop id (its generations run to max_tokens)."""

    def __init__(self, stop_ids: tuple[int, ...], delay_s: float) -> None:
        self.stop_ids, self.delay_s = list(stop_ids), delay_s

    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        time.sleep(self.delay_s)
        output.logits[..., self.stop_ids] = float("-inf")
        return output


@contextlib.contextmanager
def serving(gateway: Gateway) -> Iterator[str]:
    port = free_port()
    app = make_app(gateway, TOKEN)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(30)


def _settled(engine: HFEngine, quiet_s: float = 0.5, within_s: float = 20.0) -> int:
    """The engine's forward-pass count once it has not moved for `quiet_s` (or after `within_s`)."""
    deadline, seen = time.monotonic() + within_s, -1
    while seen != engine.forward_passes and time.monotonic() < deadline:
        seen = engine.forward_passes
        time.sleep(quiet_s)
    return seen


def test_a_client_that_leaves_cancels_its_generation_and_others_are_served() -> None:
    """Client A asks for 400 slow tokens and hangs up mid-generation: its row stops decoding (the
    engine's forward passes stop long before 400) and nothing is recorded; B, whose temperature
    cannot join A's batch, is then answered with its own few passes, not after A's 400."""
    tok = tiny.build_tokenizer()
    tok.chat_template = TEMPLATE.read_text()
    fmt = ChatFormat(tok, system_prompt="none")
    spec = tiny.TinyModelSpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    ids = {"pad_id": tok.pad_token_id, "bos_id": tok.bos_token_id, "eos_id": tok.eos_token_id}
    model = tiny.build_model(len(tok), spec, seed=0, **ids)
    model.register_forward_hook(Slow(fmt.stop_tokens(())[0], delay_s=0.025))
    engine = HFEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    gateway = Gateway(engine, fmt, "tiny")
    with serving(gateway) as url:
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        body = json.dumps({"messages": HI, "max_tokens": 400, "temperature": 1.0}).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer "
            f"{TOKEN}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        with socket.create_connection(("127.0.0.1", port)) as a:
            a.sendall(head.encode() + body)
            deadline = time.monotonic() + 30
            while engine.forward_passes < 5:  # A is decoding
                assert time.monotonic() < deadline
                time.sleep(0.01)
        stopped = _settled(engine)  # A hung up
        assert stopped < 100, stopped  # of 400 (A would run ~10 s more)
        b = _post(f"{url}/chat/completions", {"messages": HI, "max_tokens": 2, "temperature": 0.5})
        assert b.status_code == 200, b.text[:300]
        assert engine.forward_passes - stopped <= 3  # B's prefill and one step: A is not decoding
    (only,) = gateway.take("default")  # B's call; A's cancelled call left no trace
    assert gateway.stats.calls == 1 and len(only.turns) == 1 and len(only.turns[0].completion_ids) == 2
