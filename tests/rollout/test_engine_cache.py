"""The engine's KV reuse: in-place cache, prefixes kept across turns, a group's prompt once.

Each one must leave the rollouts as they were: the same sampled tokens (seeded per request) and
log-probs within float rounding of a fresh prefill, and still equal to the learner's.
"""

import asyncio
import copy
from itertools import islice

import torch
from transformers import DynamicCache

from steprl.engines.base import SamplingParams
from steprl.engines.hf import HFEngine
from steprl.engines.kv_cache import engine_cache
from steprl.envs.registry import make_env, make_tasks
from steprl.rollout.chat import PlainFormat
from steprl.rollout.context import AppendOnly
from steprl.rollout.loop import Budgets, RolloutSetup, rollout_groups
from steprl.rollout.views import packed_view
from steprl.training.learn.batching import collate, token_logprobs


def _engine(model, tokenizer, **kw):
    return HFEngine(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **kw)


def _rollouts(engine, tokenizer, n_tasks=6, group_size=4):
    setup = RolloutSetup(
        make_env=lambda t: make_env("calculator"),
        engine=engine,
        fmt=PlainFormat(tokenizer),
        rule=AppendOnly(),
        sampling=SamplingParams(temperature=1.0),
        budgets=Budgets(max_turns=4, max_tokens_per_turn=12),
    )
    tasks = list(islice(make_tasks("calculator", "train", 5), n_tasks))
    groups = asyncio.run(rollout_groups(tasks, group_size, setup, seed=0))
    return [t for g in groups for t in g.trajectories]


def test_growing_cache_holds_what_torch_cat_holds(small_model):
    ids = torch.randint(5, 60, (3, 7))
    caches = [DynamicCache(), engine_cache(small_model)]
    logits = []
    with torch.no_grad():
        for cache in caches:
            out = small_model(input_ids=ids, past_key_values=cache, use_cache=True)
            steps = [out.logits[:, -1]]
            for t in range(40):  # past the first buffer's 32 columns: it doubles
                nxt = torch.full((3, 1), 10 + t % 30)
                steps.append(small_model(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1])
            logits.append(torch.stack(steps))
    assert caches[1].get_seq_length() == 47
    assert torch.allclose(logits[0], logits[1], atol=1e-5, rtol=0)


def test_prefix_reuse_keeps_the_rollouts_and_their_logprobs(tokenizer, small_model):
    fresh = _rollouts(_engine(small_model, tokenizer, seed=4, prefix_cache_bytes=0), tokenizer)
    engine = _engine(small_model, tokenizer, seed=4)
    reused = _rollouts(engine, tokenizer)
    assert sum(len(t.steps) > 1 for t in fresh) >= 5, "want multi-turn trajectories"
    assert engine.prefix_cache is not None and engine.prefix_cache.hits > 0
    assert engine.prefix_cache.reused_tokens > 100
    for a, b in zip(fresh, reused, strict=True):
        assert [s.action_ids for s in a.steps] == [s.action_ids for s in b.steps]
        for sa, sb in zip(a.steps, b.steps, strict=True):
            gaps = [abs(x - y) for x, y in zip(sa.action_logprobs, sb.action_logprobs, strict=True)]
            assert max(gaps, default=0.0) < 1e-5
    # and the learner, recomputing from scratch, still agrees with the engine
    batch = collate([packed_view(t, i) for i, t in enumerate(reused)], tokenizer.pad_token_id)
    with torch.no_grad():  # on a copy: output_hidden_states installs hooks Ray cannot pickle
        logp, _ = token_logprobs(copy.deepcopy(small_model), batch.input_ids, batch.attention, 1.0)
    m = batch.loss_mask.bool()
    assert (logp[m] - batch.old_logp[m]).abs().max().item() < 1e-4


def test_a_groups_prompt_is_prefilled_once(tokenizer, small_model):
    prompt = (tokenizer.bos_token_id, *tokenizer.encode("What is 3+4?\n", add_special_tokens=False))
    sp = SamplingParams(max_new_tokens=6)
    alone = [_engine(small_model, tokenizer)._generate_batch([prompt], sp, [s])[0] for s in range(8)]
    engine = _engine(small_model, tokenizer)
    together = engine._generate_batch([prompt] * 8, sp, list(range(8)))
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]
    assert len({g.token_ids for g in together}) > 1  # the seeds still make the samples differ
    for a, b in zip(alone, together, strict=True):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_new_weights_drop_every_stored_prefix(tokenizer, small_model):
    engine = _engine(small_model, tokenizer)
    _rollouts(engine, tokenizer, n_tasks=2, group_size=2)
    assert engine.prefix_cache is not None and len(engine.prefix_cache) > 0
    engine.update_weights(small_model.state_dict(), version=1)
    assert len(engine.prefix_cache) == 0 and engine.prefix_cache.bytes == 0


def test_the_budget_evicts_the_oldest(tokenizer, small_model):
    engine = _engine(small_model, tokenizer, prefix_cache_bytes=300_000)  # about 4 entries of ~150 tokens
    _rollouts(engine, tokenizer, n_tasks=4, group_size=4)
    cache = engine.prefix_cache
    assert cache is not None and 0 < cache.bytes <= 300_000 and 0 < len(cache) < 16
