"""Supervised warm start on demonstrations from an env's scripted strategies.

The demonstrations are played by the agent loop itself (`rollout/demos.py`), so they are
tokenized exactly as rollouts are and any env the trainer runs (async, MCP, remote) gives them.

The mixture of strategies is configurable (default: expert 30%, guess 70%), so the warm-start
policy is deliberately imperfect and RL has real headroom. Loss: cross-entropy on the
demonstrated action tokens only (observations and prompts are masked, as in RL).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Unpack

import torch

from steprl.errors import UserError
from steprl.rollout.demos import DemoPlay, play_demos
from steprl.rollout.views import Sample, packed_view, per_step_view
from steprl.training.learn.batching import collate, device_of, token_logprobs
from steprl.types import NOT_TRAINABLE, EndReason, Task


@dataclass(frozen=True)
class Demo:
    strategy: str
    sample: Sample
    outcome_reward: float


class DemoError(UserError):
    """No demonstration could be played (every episode failed in the env)."""


def make_demos(
    tasks: Sequence[Task], *, log: Callable[[str], None] = print, **play: Unpack[DemoPlay]
) -> list[Demo]:
    """Play each task once with a strategy drawn by weight, through the agent loop
    (`rollout/demos.py`, whose `DemoPlay` are the other keywords) under RL's context rule and
    budgets, and keep the trainable transcripts as training rows shaped as RL's (one packed row
    per transcript for an append-only context, one row per step otherwise).

    Episodes that fail in the env (`infra_failed`, `env_timeout`) are counted and dropped, as
    in RL; when every one fails, the first error says why.
    """
    played = asyncio.run(play_demos(tasks, **play))
    kept = [d for d in played if d.trajectory.end not in NOT_TRAINABLE and d.trajectory.steps]
    failed = [d.trajectory for d in played if d.trajectory.end in NOT_TRAINABLE]
    if failed:
        log(
            f"  {len(failed)} of {len(played)} demonstrations failed in the env "
            f"(not trained on); the first: {failed[0].info.get('error')}"
        )
    cut = sum(d.trajectory.end is EndReason.TRUNCATED for d in kept)
    if cut:
        log(f"  {cut} of {len(played)} demonstrations hit a rollout budget (rollout.max_*) and were cut")
    if not kept:
        raise DemoError(
            f"no demonstration could be played ({len(failed)} failed in the env; the first error: "
            f"{failed[0].info.get('error') if failed else 'none'}); run `steprl check-env` on this env"
        )
    rows = (lambda t, i: [packed_view(t, i)]) if play["rule"].append_only else per_step_view
    return [
        Demo(d.strategy, sample, d.trajectory.outcome_reward)
        for i, d in enumerate(kept)
        for sample in rows(d.trajectory, i)
    ]


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
    device = device_of(model)  # the batch goes where the model is
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        idx = torch.randint(len(demos), (batch_size,), generator=gen).tolist()
        batch = collate([demos[i].sample for i in idx], pad_id).to(device)
        logp, _ = token_logprobs(model, batch.input_ids, batch.attention, mask=batch.loss_mask)
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
