"""`check_step_reward`: the contract of a step-reward kind, as `check_env` is an env's. The tests
run it over every entry of `STEP_REWARDS`; run it on your own before a long run:

    from steprl.training.commands.step_reward_check import check_kind
    check_kind("my_rewards:MyKind")            # or a name of STEP_REWARDS

`check_kind` builds what it needs: a small random tiny model, and real gridwalk episodes of it
through the HF engine (`sample_data`), relabelled so every task has a winner and a loser (every
kind has a preference to fit). The episodes are multi-step and include malformed actions.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Callable
from dataclasses import replace
from itertools import islice
from typing import Any

import torch
from torch import nn

from steprl.training.step_rewards import step_reward_class
from steprl.training.step_rewards.base import ModelContext, StepData, StepRewardModel


def sample_data(model: nn.Module, tokenizer: Any, *, tasks: int = 3, group_size: int = 2) -> StepData:
    """`tasks` x `group_size` gridwalk episodes of `model` (3 turns of at most 8 tokens), the
    first of each group relabelled outcome 1 and the rest 0, as one step's `StepData`."""
    from steprl.engines.base import SamplingParams
    from steprl.engines.hf import HFEngine
    from steprl.envs.registry import make_env, make_tasks
    from steprl.rollout.chat import PlainFormat
    from steprl.rollout.context import AppendOnly
    from steprl.rollout.loop import Budgets, RolloutSetup, rollout_groups
    from steprl.rollout.views import packed_view
    from steprl.training.loop.step_batch import advantage_inputs

    pad = tokenizer.pad_token_id
    setup = RolloutSetup(
        make_env=lambda t: make_env("gridwalk"),
        engine=HFEngine(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=pad, seed=0),
        fmt=PlainFormat(tokenizer),
        rule=AppendOnly(),
        sampling=SamplingParams(temperature=1.0),
        budgets=Budgets(max_turns=3, max_tokens_per_turn=8),
    )
    groups = asyncio.run(
        rollout_groups(list(islice(make_tasks("gridwalk", "train", 0), tasks)), group_size, setup, seed=0)
    )
    trajs = tuple(
        replace(t, outcome_reward=float(j == 0)) for g in groups for j, t in enumerate(g.trajectories)
    )
    views = tuple(packed_view(t, i) for i, t in enumerate(trajs))
    rewards = torch.tensor([t.outcome_reward for t in trajs])
    return StepData(advantage_inputs(trajs, views, rewards, env_ids={"gridwalk": 0}), views, trajs)


def check_kind(kind: str) -> None:
    """`check_step_reward` for a name of `STEP_REWARDS` or an import path, on a small random
    model and its own episodes."""
    from steprl.models import tiny

    tokenizer = tiny.build_tokenizer()
    spec = tiny.TinyModelSpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    model = tiny.build_model(
        len(tokenizer), spec, seed=0, pad_id=tokenizer.pad_token_id,
        bos_id=tokenizer.bos_token_id, eos_id=tokenizer.eos_token_id,
    ).eval()  # fmt: skip
    ctx = ModelContext(
        model, None, tokenizer.pad_token_id, micro_batch_size=2, temperature=1.0, grad_clip=1.0
    )
    check_step_reward(kind, step_reward_class(kind), ctx, sample_data(model, tokenizer))


def check_step_reward(
    name: str, kind: Callable[..., StepRewardModel], ctx: ModelContext, data: StepData
) -> None:
    """What the trainer relies on, for one kind, on a real batch (`data`): it follows the
    protocol; `score` is (S,), finite, changes nothing and repeats exactly; `fit` returns float
    metrics and (for a kind that trains) changes its scores; the state round-trips through
    `torch.save` / `torch.load(weights_only=True)` to the same scores; a fresh copy loaded from
    that state gives the same scores; it does not touch the policy."""
    policy_before = {k: v.clone() for k, v in ctx.policy.state_dict().items()}
    model = kind(ctx)
    assert isinstance(model, StepRewardModel), f"{name}: does not follow StepRewardModel"
    first = model.score(data)
    assert first.shape == (data.num_steps,), f"{name}: score shape {tuple(first.shape)}"
    assert bool(torch.isfinite(first).all()), f"{name}: non-finite scores"
    assert torch.equal(first, model.score(data)), f"{name}: score is not repeatable"
    metrics = model.fit(data)
    assert all(isinstance(v, float) for v in metrics.values()), f"{name}: fit metrics must be floats"
    after = model.score(data)
    if model.trains:
        assert not torch.equal(first, after), f"{name}: trains=True but a fit changed no score"
    state = model.state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    fresh = kind(ctx)
    fresh.load_state_dict(loaded)
    assert torch.equal(fresh.score(data), after), f"{name}: a copy loaded from its state scores differently"
    if model.trains:  # and training goes on identically from the loaded state
        model.fit(data)
        fresh.fit(data)
        assert torch.equal(fresh.score(data), model.score(data)), f"{name}: a resumed fit diverges"
    for k, v in ctx.policy.state_dict().items():
        assert torch.equal(v, policy_before[k]), f"{name}: changed the policy's {k}"


__all__ = ["check_kind", "check_step_reward", "sample_data"]
