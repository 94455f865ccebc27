"""Token fidelity: the learner's recomputed log-probs equal the engine's (fp32, CPU, 1e-4).

Covers the hard cases: left-padded batches of different prompt lengths, KV-cached decoding,
multi-turn trajectories with observations spliced in, and temperature scaling.
"""

import asyncio

import pytest
import torch

from steprl.engines.base import SamplingParams
from steprl.engines.hf import HFEngine, request_uniforms, sample_from_logits
from steprl.rollout.context import AppendOnly, KeepLastK
from steprl.rollout.views import packed_view, per_step_view
from steprl.training.learn.batching import collate, token_logprobs


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
        tok, lp = sample_from_logits(logits, 1.0, 0.5, torch.rand(1, generator=g, dtype=torch.float64))
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


def test_inverse_cdf_sampling_matches_the_distribution():
    logits = torch.tensor([[1.0, 0.0, -1.0, 2.0]]).repeat(20_000, 1)
    u = torch.rand(20_000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    tok, _ = sample_from_logits(logits, 1.0, 1.0, u)
    freq = torch.bincount(tok, minlength=4).double() / 20_000
    assert torch.allclose(freq, torch.softmax(logits[0].double(), -1), atol=0.01)
    # u -> 0 gives the first token with mass, u -> 1 the last one
    edge, _ = sample_from_logits(logits[:2], 1.0, 1.0, torch.tensor([0.0, 1.0 - 2**-53], dtype=torch.float64))
    assert edge.tolist() == [0, 3]


def test_request_uniforms_are_a_pure_function_of_seeds_and_index():
    a = request_uniforms(7, [1, 2, 3], 0)
    assert torch.equal(a, request_uniforms(7, [1, 2, 3], 0))
    assert torch.equal(a[[2, 0]], request_uniforms(7, [3, 1], 0))  # order and company do not matter
    assert not torch.equal(a, request_uniforms(7, [1, 2, 3], 1))
    assert not torch.equal(a, request_uniforms(8, [1, 2, 3], 0))
    many = request_uniforms(0, list(range(10_000)), 5)
    assert float(many.min()) >= 0.0 and float(many.max()) < 1.0
    assert abs(float(many.mean()) - 0.5) < 0.01


def test_seeded_requests_do_not_depend_on_batch_company(tokenizer, small_model):
    """The same (engine seed, request seed) gives the same tokens alone or batched with others."""
    sp = SamplingParams(max_new_tokens=12)
    prompts = [[tokenizer.bos_token_id] + [20 + i] * (3 + 2 * i) for i in range(6)]

    def run(indices):
        engine = HFEngine(
            small_model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, seed=3
        )

        async def go():
            return await asyncio.gather(*[engine.generate(prompts[i], sp, seed=100 + i) for i in indices])

        return dict(zip(indices, asyncio.run(go()), strict=True))

    together = run(list(range(6)))
    for i in range(6):
        alone = run([i])[i]
        assert alone.token_ids == together[i].token_ids
        assert max(abs(a - b) for a, b in zip(alone.logprobs, together[i].logprobs, strict=True)) < 1e-5
    reordered = run([5, 3, 1])
    assert all(reordered[i].token_ids == together[i].token_ids for i in (5, 3, 1))
