"""The policy gateway (issue 30, first part): the official `openai` SDK against the gateway on
loopback, the real Qwen3 tokenizer and chat template; exact ids recorded, appended or branched,
provenance checked on every call."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
import uvicorn

import cli_zygote
from steprl.engines.base import Generation, SamplingParams
from steprl.engines.hf import HFEngine
from steprl.engines.scripted import ScriptedEngine
from steprl.gateway.app import make_app
from steprl.gateway.policy_gateway import Gateway
from steprl.hosting.local_server import free_port
from steprl.models import qwen3_testbed
from steprl.rollout.chat_format import ChatFormat
from steprl.rollout.views import Sample
from steprl.training.learn.batching import collate, token_logprobs

TOKEN = "gw-test-token"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
ANSWER = "It is sunny in Paris.<|im_end|>"


@pytest.fixture(scope="module")
def fmt() -> ChatFormat:
    return ChatFormat(qwen3_testbed.load_tokenizer())


@contextlib.contextmanager
def serving(gateway: Gateway) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(make_app(gateway, TOKEN), host="127.0.0.1", port=port, log_level="error")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(10)


def _client(url: str, session: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=f"{TOKEN}.{session}", max_retries=0)


def test_a_tool_calling_harness_gets_one_packed_trajectory_of_exact_ids(fmt: ChatFormat) -> None:
    """Turn 2's render extends turn 1's prompt + sampled ids: appended, one sample; every
    recorded completion is exactly the engine's ids; the harness sees parsed tool calls."""
    engine = ScriptedEngine([CALL, ANSWER], fmt.template_ids)
    gateway = Gateway(engine, fmt, "qwen3-testbed")
    with serving(gateway) as url:
        client = _client(url, "ep1")
        assert [m.id for m in client.models.list().data] == ["qwen3-testbed"]
        messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
        first = client.chat.completions.create(model="qwen3-testbed", messages=messages, tools=[WEATHER])
        (call,) = first.choices[0].message.tool_calls or []
        assert first.choices[0].finish_reason == "tool_calls" and json.loads(call.function.arguments) == {
            "city": "Paris"
        }
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ]
        second = client.chat.completions.create(model="qwen3-testbed", messages=messages, tools=[WEATHER])
        assert second.choices[0].message.content == "It is sunny in Paris."
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
    (sample,) = gateway.take("ep1")
    one, two = sample.turns
    assert (
        two.appended
        and two.prompt_ids[: len(one.prompt_ids + one.completion_ids)] == one.prompt_ids + one.completion_ids
    )
    assert [t.completion_ids for t in sample.turns] == [fmt.template_ids(CALL), fmt.template_ids(ANSWER)]
    assert engine.calls == [one.prompt_ids, two.prompt_ids]
    assert (
        gateway.metrics()["gateway/branch_rate"] == 0.0
        and gateway.metrics()["gateway/exact_token_share"] == 1.0
    )


def test_a_harness_that_rewrites_history_starts_a_new_sample_and_is_counted(fmt: ChatFormat) -> None:
    """Arguments re-serialised without spaces: the render no longer extends what was sampled,
    so the call is a branch (a sample of its own); nothing re-tokenised is ever a completion."""
    gateway = Gateway(ScriptedEngine([CALL, ANSWER], fmt.template_ids), fmt, "m")
    with serving(gateway) as url:
        client = _client(url, "ep2")
        messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
        first = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER])
        (call,) = first.choices[0].message.tool_calls or []
        squeezed = {**call.model_dump(), "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [squeezed]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ]
        client.chat.completions.create(model="m", messages=messages, tools=[WEATHER])
    samples = gateway.take("ep2")
    assert len(samples) == 2 and not samples[1].turns[0].appended
    m = gateway.metrics()
    assert m["gateway/branch_rate"] == 1.0 and 0.0 < m["gateway/exact_token_share"] < 1.0


class BrokenEngine(ScriptedEngine):
    """Drops a log-prob: what rLLM #816 zero-padded in silence."""

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, *, seed: int | None = None
    ) -> Generation:
        gen = await super().generate(prompt_ids, sampling, seed=seed)
        return Generation(gen.token_ids, gen.logprobs[:-1], gen.finish_reason)


def test_a_completion_without_matching_logprobs_fails_loudly(fmt: ChatFormat) -> None:
    gateway = Gateway(BrokenEngine([ANSWER], fmt.template_ids), fmt, "m")
    with serving(gateway) as url, pytest.raises(openai.InternalServerError, match="log-probs"):
        _client(url, "ep3").chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert gateway.take("ep3") == [] and gateway.metrics()["gateway/provenance_errors"] == 1.0


def test_sampled_logprobs_are_the_learners_and_streaming_says_the_same(fmt: ChatFormat) -> None:
    """The HF engine on the Qwen3 test bed: the recorded log-probs match the learner's recompute
    on the recorded ids; a streamed reply carries the text of the same completion."""
    tok = fmt.tokenizer
    model = qwen3_testbed.build_model(
        tok, qwen3_testbed.TestbedSize(hidden_size=64, num_layers=2), seed=0
    ).eval()
    gateway = Gateway(HFEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id), fmt, "m")
    with serving(gateway) as url:
        client = _client(url, "ep4")
        plain = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=12, seed=7
        )
        streamed = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=12, seed=7, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    samples = gateway.take("ep4")
    a, b = (s.turns[0] for s in samples)
    assert a.completion_ids == b.completion_ids and text == (plain.choices[0].message.content or "")
    ids = a.prompt_ids + a.completion_ids
    mask = (0,) * len(a.prompt_ids) + (1,) * len(a.completion_ids)
    batch = collate([Sample(ids, mask, (0.0,) * len(ids), 0)], tok.pad_token_id)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch.input_ids, batch.attention, mask=batch.loss_mask)
    learner = logp[0][batch.loss_mask[0].bool()]
    assert torch.allclose(learner, torch.tensor(a.logprobs), atol=1e-4)


def test_serve_policy_serves_a_configs_model_from_the_cli() -> None:
    """`steprl serve-policy CONFIG`: the config's model (the Qwen3 test bed) answers the openai
    SDK with the key from STEPRL_GATEWAY_TOKEN; a model with no chat template is one line."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    steprl = [sys.executable, "-c", "from steprl.cli import main; main()", "serve-policy"]
    config = str(root / "configs" / "calculator_tiny.yaml")
    port = free_port()
    env = {**os.environ, "STEPRL_GATEWAY_TOKEN": TOKEN}
    args = ["--set", "model.name=qwen3-testbed", "--set", "model.init=pretrained", "--port", str(port)]
    proc = cli_zygote.popen(
        [*steprl, config, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        client = _client(f"http://127.0.0.1:{port}/v1", "cli")
        deadline = time.monotonic() + 120
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, (
                    proc.stdout.read() if proc.stdout else ""
                )
                time.sleep(0.3)
        reply = client.chat.completions.create(
            model="qwen3-testbed", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.usage is not None and reply.usage.completion_tokens >= 1
    finally:
        proc.terminate()
        proc.wait(30)
    tiny = subprocess.run(
        [*steprl, config, "--port", str(port)], env=env, capture_output=True, text=True, timeout=300
    )
    assert (
        tiny.returncode == 2
        and "has no chat template" in tiny.stdout
        and tiny.stdout.strip().count("\n") == 0
    )


def test_the_anthropic_sdk_runs_the_same_harness_and_appends_the_same_way(fmt: ChatFormat) -> None:
    """`/v1/messages`: a tool_use block out, a tool_result back in; the second call renders as the
    extension of the first's exact ids, as through the OpenAI API."""
    import anthropic

    gateway = Gateway(ScriptedEngine([CALL, ANSWER], fmt.template_ids), fmt, "m")
    tools: Any = [
        {
            "name": "get_weather",
            "description": "The weather in a city.",
            "input_schema": WEATHER["function"]["parameters"],
        }
    ]
    with serving(gateway) as url:
        client = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key=f"{TOKEN}.ep5", max_retries=0)
        messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
        first = client.messages.create(model="m", max_tokens=64, messages=messages, tools=tools)
        (use,) = [b for b in first.content if b.type == "tool_use"]
        assert first.stop_reason == "tool_use" and use.input == {"city": "Paris"}
        messages += [
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
        ]
        second = client.messages.create(model="m", max_tokens=64, messages=messages, tools=tools)
        assert second.stop_reason == "end_turn" and second.content[0].type == "text"
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(
                base_url=url.removesuffix("/v1"), api_key="nope", max_retries=0
            ).messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    (sample,) = gateway.take("ep5")
    assert [t.appended for t in sample.turns] == [False, True]


RECORDED = sorted((Path(__file__).parent / "recorded").glob("*.json"))


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: p.stem)
def test_recorded_harness_sessions_replay_as_recorded(fmt: ChatFormat, path: Path) -> None:
    """Each recorded session's calls, replayed through the openai SDK with the completions the
    engine gave: every call lands as recorded (first, append or branch), every trained token is
    the engine's own id, none padded, none lost."""
    recorded = json.loads(path.read_text())
    calls = recorded["calls"]
    engine = ScriptedEngine([c["completion"] for c in calls], fmt.template_ids)
    gateway = Gateway(engine, fmt, "m")
    placed, last = [], ""
    with serving(gateway) as url:
        client = _client(url, path.stem)
        for call in calls:
            request = json.loads(json.dumps(call["request"]).replace("TRUNCATED", json.dumps(last)[1:-1]))
            before = (gateway.stats.later_turns, gateway.stats.branches)
            if request.pop("stream", False):
                chunks = client.chat.completions.create(model="m", stream=True, **request)
                last = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            else:
                last = client.chat.completions.create(model="m", **request).choices[0].message.content or ""
            later, branched = (gateway.stats.later_turns - before[0], gateway.stats.branches - before[1])
            placed.append("branch" if branched else "append" if later else "first")
    assert placed == [c["expect"] for c in calls], recorded["harness"]
    turns = [t for s in gateway.take(path.stem) for t in s.turns]
    want = [fmt.template_ids(c["completion"])[: c["request"].get("max_tokens", 1 << 20)] for c in calls]
    assert sorted(t.completion_ids for t in turns) == sorted(want)  # the engine's ids, each once
    assert all(len(t.completion_ids) == len(t.logprobs) for t in turns)
    assert gateway.metrics()["gateway/provenance_errors"] == 0.0


class FailingOnce(ScriptedEngine):
    """Raises on its first call (an engine error, e.g. out of memory), then replays."""

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, *, seed: int | None = None
    ) -> Generation:
        if not self.calls:
            self.calls.append(tuple(prompt_ids))
            raise RuntimeError("engine died")
        return await super().generate(prompt_ids, sampling, seed=seed)


def test_bad_requests_are_one_line_and_a_failed_call_leaves_no_trace(fmt: ChatFormat) -> None:
    gateway = Gateway(FailingOnce([ANSWER], fmt.template_ids), fmt, "m")
    hi = [{"role": "user", "content": "hi"}]
    with serving(gateway) as url:
        client = _client(url, "ep6")
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model="m", messages=hi)
        assert gateway.sessions["ep6"].samples == []  # the failed call's sample is gone
        client.chat.completions.create(
            model="m", messages=[{"role": "developer", "content": "be brief"}, *hi]
        )
        for bad, says in (
            ({"messages": hi, "n": 2}, "n: not supported"),
            (
                {
                    "messages": [
                        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                    ]
                },
                "only text",
            ),
            ({"messages": [{"role": "critic", "content": "x"}]}, r"messages\[0\]\.role"),
            ({"messages": hi, "max_tokens": 5.5}, "max_tokens: an integer"),
        ):
            with pytest.raises(openai.BadRequestError, match=says):
                client.chat.completions.create(model="m", **bad)
        with pytest.raises(openai.BadRequestError, match="token ids in"):
            client.completions.create(model="m", prompt=[len(fmt.tokenizer) + 5])
    (sample,) = gateway.take("ep6")
    assert "<|im_start|>system\nbe brief" in fmt.decode_all(sample.turns[0].prompt_ids)
