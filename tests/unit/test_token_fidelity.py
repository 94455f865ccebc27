"""Token fidelity: the learner's recomputed log-probs equal the engine's (fp32, CPU, 1e-4).

Covers the hard cases: left-padded batches of different prompt lengths, KV-cached decoding,
multi-turn trajectories with observations spliced in, and temperature scaling.
"""

import asyncio

import pytest
import torch

from steprl.rollout.context import AppendOnly, KeepLastK
from steprl.rollout.engines.base import SamplingParams
from steprl.rollout.engines.hf import HFEngine, sample_from_logits
from steprl.rollout.views import packed_view, per_step_view
from steprl.training.batching import collate, token_logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_learner_logprobs_match_engine(tokenizer, small_model, sample_rollouts, temperature):
    trajs = sample_rollouts(AppendOnly(), temperature=temperature, engine_seed=3)
    assert sum(len(t.steps) > 1 for t in trajs) > 0, "want some multi-turn trajectories"
    samples = [packed_view(t, i) for i, t in enumerate(trajs)]
    batch = collate(samples, tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _ = token_logprobs(small_model, batch.input_ids, batch.attention, temperature)
    m = batch.loss_mask.bool()
    assert m.sum() > 50
    diff = (logp[m] - batch.old_logp[m]).abs().max().item()
    assert diff < 1e-4, diff


def test_per_step_learner_logprobs_match_engine(tokenizer, small_model, sample_rollouts):
    trajs = sample_rollouts(KeepLastK(1), engine_seed=3)
    samples = [s for i, t in enumerate(trajs) for s in per_step_view(t, i)]
    batch = collate(samples, tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _ = token_logprobs(small_model, batch.input_ids, batch.attention, 1.0)
    m = batch.loss_mask.bool()
    assert (logp[m] - batch.old_logp[m]).abs().max().item() < 1e-4


def test_top_p_restricts_sampling_but_logprob_is_untruncated():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    g = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(200):
        tok, lp = sample_from_logits(logits, 1.0, 0.5, g)
        seen.add(int(tok))
        assert torch.allclose(lp, torch.log_softmax(logits, -1)[0, tok])
    assert seen == {0}  # p(top token) = 0.64 >= 0.5: only it survives


def test_engine_batches_concurrent_requests(tokenizer, small_model):
    engine = HFEngine(small_model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)

    async def many():
        sp = SamplingParams(max_new_tokens=5)
        return await asyncio.gather(
            *[engine.generate([tokenizer.bos_token_id] + [20] * i, sp) for i in range(1, 9)]
        )

    gens = asyncio.run(many())
    assert len(gens) == 8 and all(len(g.token_ids) == len(g.logprobs) for g in gens)
    assert engine.forward_passes <= 5  # one batch of 8, not 8 separate generations


def test_multi_token_stop_sequences(tokenizer, small_model):
    engine = HFEngine(small_model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    prompt = [tokenizer.bos_token_id, 20, 21]
    free = asyncio.run(engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=6)))
    stop = tuple(free.token_ids[1:3])
    cut = asyncio.run(
        engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=6, stop_sequences=(stop,)))
    )
    assert cut.finish_reason == "stop"
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)] and cut.token_ids[-2:] == stop
    assert len(cut.token_ids) <= 3
