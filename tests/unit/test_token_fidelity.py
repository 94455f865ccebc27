"""Token fidelity: the learner's recomputed log-probs equal the engine's (fp32, CPU, 1e-4).

Covers the hard cases: left-padded batches of different prompt lengths, KV-cached decoding,
multi-turn trajectories with observations spliced in, and temperature scaling.
"""

import asyncio
from itertools import islice

import pytest
import torch

from steprl.envs.registry import make_env, make_tasks
from steprl.rollout.chat import PlainFormat
from steprl.rollout.context import AppendOnly, KeepLastK
from steprl.rollout.engines.base import SamplingParams
from steprl.rollout.engines.hf import HFEngine, sample_from_logits
from steprl.rollout.loop import Budgets, RolloutSetup, rollout_groups
from steprl.rollout.views import packed_view, per_step_view
from steprl.training.learner import collate, token_logprobs


def _rollouts(tokenizer, model, rule, temperature):
    engine = HFEngine(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, seed=3)
    tasks = list(islice(make_tasks("calculator", "train", 2), 6))
    groups = asyncio.run(
        rollout_groups(
            tasks,
            3,
            RolloutSetup(
                make_env=lambda t: make_env("calculator"),
                engine=engine,
                fmt=PlainFormat(tokenizer),
                rule=rule,
                sampling=SamplingParams(temperature=temperature),
                budgets=Budgets(max_turns=3, max_tokens_per_turn=16),
            ),
            seed=0,
        )
    )
    return [t for g in groups for t in g.trajectories]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_learner_logprobs_match_engine(tokenizer, small_model, temperature):
    trajs = _rollouts(tokenizer, small_model, AppendOnly(), temperature)
    assert sum(len(t.steps) > 1 for t in trajs) > 0, "want some multi-turn trajectories"
    samples = [packed_view(t, i) for i, t in enumerate(trajs)]
    batch = collate(samples, torch.zeros(len(trajs)), tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _ = token_logprobs(small_model, batch.input_ids, batch.attention, temperature)
    m = batch.loss_mask.bool()
    assert m.sum() > 50
    diff = (logp[m] - batch.old_logp[m]).abs().max().item()
    assert diff < 1e-4, diff


def test_per_step_learner_logprobs_match_engine(tokenizer, small_model):
    trajs = _rollouts(tokenizer, small_model, KeepLastK(1), 1.0)
    samples = [s for i, t in enumerate(trajs) for s in per_step_view(t, i)]
    batch = collate(samples, torch.zeros(len(trajs)), tokenizer.pad_token_id)
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
