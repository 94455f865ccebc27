"""Supervised warm start on demonstrations from an env's scripted strategies.

The mixture of strategies is configurable (default: expert 30%, guess 70%), so the warm-start
policy is deliberately imperfect and RL has real headroom. Loss: cross-entropy on the
demonstrated action tokens only (observations and prompts are masked, as in RL).
"""

from __future__ import annotations

import inspect
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from steprl.envs.base import Env
from steprl.rollout.chat import PromptFormat
from steprl.rollout.views import Sample
from steprl.training.batching import collate, token_logprobs
from steprl.types import Task

T = TypeVar("T")

#: (task, history of (action, observation)) -> next action text
Strategy = Callable[..., str]


@dataclass(frozen=True)
class Demo:
    strategy: str
    sample: Sample
    outcome_reward: float


def _sync(value: T | Awaitable[T]) -> T:
    if inspect.isawaitable(value):
        raise TypeError("SFT demonstrations need a synchronous env (reset/step returned an awaitable)")
    return value


def make_demos(
    *,
    make_env: Callable[[Task], Env],
    tasks: Sequence[Task],
    strategies: Mapping[str, Strategy],
    weights: Mapping[str, float],
    fmt: PromptFormat,
    seed: int,
    max_turns: int = 8,
) -> list[Demo]:
    """Roll each task once with a strategy drawn by weight; tokenize actions and observations once."""
    unknown = sorted(set(weights) - set(strategies))
    if unknown:
        raise ValueError(f"sft.strategies names {unknown}; this env offers: {sorted(strategies)}")
    rng = random.Random(seed)
    names = sorted(weights)
    probs = [weights[n] for n in names]
    demos = []
    for task in tasks:
        name = rng.choices(names, probs)[0]
        env = make_env(task)
        first = _sync(env.reset(task, seed))
        ids = list(fmt.initial_ids(env.system_prompt, first.text))
        mask = [0] * len(ids)
        history: list[tuple[str, str]] = []
        reward = 0.0
        for _ in range(max_turns):
            action = strategies[name](task, history, rng)
            tr = _sync(env.step(action))
            a_ids = fmt.observation_ids(action)  # demo actions are text: encode them once
            ids += a_ids
            mask += [1] * len(a_ids)
            reward += tr.reward
            history.append((action, tr.observation))
            if tr.terminated or tr.truncated:
                break
            o_ids = fmt.observation_ids(tr.observation)
            ids += o_ids
            mask += [0] * len(o_ids)
        env.close()
        demos.append(Demo(name, Sample(tuple(ids), tuple(mask), (0.0,) * len(ids), 0), reward))
    return demos


def sft_train(
    model: torch.nn.Module,
    demos: Sequence[Demo],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    pad_id: int,
    log: Callable[[str], None] = print,
) -> list[float]:
    """AdamW with linear warm-up and cosine decay; returns the loss per step."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.05 + 0.95 * 0.5 * (1 + torch.cos(torch.tensor(progress * torch.pi)).item())

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    model.train()
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        idx = torch.randint(len(demos), (batch_size,), generator=gen).tolist()
        batch = collate([demos[i].sample for i in idx], pad_id)
        logp, _ = token_logprobs(model, batch.input_ids, batch.attention)
        loss = -(logp * batch.loss_mask).sum() / batch.loss_mask.sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if (step + 1) % max(1, steps // 10) == 0:
            log(
                f"  sft step {step + 1}/{steps}  loss {sum(losses[-20:]) / len(losses[-20:]):.4f}  "
                f"({time.perf_counter() - t0:.0f}s)"
            )
    model.eval()
    return losses
