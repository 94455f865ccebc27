"""Guards of a run: the numeric guards of an optimizer step (reliability.md NUM-01, NUM-02) and
the epochs x mini-batches loop of guarded steps, shared by the learner and the separate critic,
and the accounting of trajectories that failed in
the env (counted by reason, the first of each kind logged). Both feed the trainer's K-in-a-row
stops: `trainer.max_nonfinite_skips` and `runtime.max_failed_steps`; a non-finite reward breaks
the env contract, so its trajectory fails (`infra/invalid/reward_not_finite`) and an env whose
rewards are all NaN trips the failure budget's stop."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from steprl.training.learn.batching import minibatches
from steprl.types import Trajectory


def guarded_step(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], grad_clip: float) -> float:
    """Clip and step, unless the loss or a gradient is NaN or Inf (NUM-01): then the step is
    skipped (parameters and optimizer state stay as they were). Returns the pre-clip norm (a
    spike above the clip is clipped as any norm is: NUM-02)."""
    total = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    # FSDP's sharded gradients give a DTensor: the norm over every rank's shard, the same on all
    norm = float(total.full_tensor() if hasattr(total, "full_tensor") else total)
    if math.isfinite(norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def guarded_epochs(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    grad_clip: float,
    n_rows: int,
    *,
    epochs: int,
    mini_batches: int,
    generator: torch.Generator,
    backward: Callable[[list[int]], None],
) -> list[float]:
    """`epochs` passes over `n_rows` rows, each shuffled by `generator` into `mini_batches`
    mini-batches; per mini-batch, `backward(rows)` accumulates its gradient and one
    `guarded_step` takes it. Returns the pre-clip norms, one per mini-batch.

    One loop for the learner and the separate critic: how a run shuffles and steps is written
    once, and a change to it (a generator draw, a skipped step) reaches both."""
    norms: list[float] = []
    for _ in range(epochs):
        for mb in minibatches(n_rows, mini_batches, generator):
            optimizer.zero_grad(set_to_none=True)
            backward(mb)
            norms.append(guarded_step(optimizer, params, grad_clip))
    return norms


def grad_metrics(prefix: str, norms: Sequence[float], spike_norm: float) -> dict[str, float]:
    """Pre-clip gradient norms of one update: mean and max of the finite ones, the skipped
    (non-finite) steps, and the spikes (a norm above `spike_norm`, flagged)."""
    finite = [n for n in norms if math.isfinite(n)]
    return {
        f"{prefix}/grad_norm": sum(finite) / len(finite) if finite else 0.0,
        f"{prefix}/grad_norm_max": max(finite, default=0.0),
        f"{prefix}/optimizer_steps": float(len(finite)),
        f"{prefix}/nonfinite_skips": float(len(norms) - len(finite)),
        f"{prefix}/grad_spikes": float(sum(n > spike_norm for n in finite)),
    }


def failure_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """`infra/invalid`: trajectories ended `infra_failed` because the env broke its contract
    (`envs/contract.py`: a str or NaN reward, ...); `infra/invalid/<reason>` for each reason
    seen. Their rewards were never used."""
    reasons = Counter(str(t.info["invalid"]) for t in trajectories if "invalid" in t.info)
    return {"infra/invalid": float(sum(reasons.values()))} | {
        f"infra/invalid/{reason}": float(n) for reason, n in sorted(reasons.items())
    }


class FirstFailures:
    """Logs the first failed trajectory of each kind (each contract reason, a missed deadline,
    an env exception) as one line, once per run: a run whose envs fail is never silent, and
    one that fails on every step does not repeat itself (the counts are in the metrics)."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self.log = log
        self.seen: set[str] = set()

    def __call__(self, trajectories: Sequence[Trajectory], where: str) -> None:
        for t in trajectories:
            if t.trainable:
                continue
            kind = f"invalid/{t.info['invalid']}" if "invalid" in t.info else t.end.value
            if kind in self.seen:
                continue
            self.seen.add(kind)
            metric = f"infra/{kind}" if kind.startswith("invalid/") else f"end/{kind}"
            self.log(
                f"WARNING {where}: env {t.env!r}, task {t.task_id!r} ended {t.end.value}: "
                f"{t.info.get('error', 'no error recorded')}; such trajectories are never trained on "
                f"(counted in {metric}; this line is shown once per run)"
            )
