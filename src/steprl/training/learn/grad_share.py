"""Each env's share of the gradient (`grad_share/<env>`), for a run with several envs: a
mini-batch's rows backpropagated env by env (`by_env`) and the gradient measured between them
(`GradShare`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def by_env(idx: list[int], envs: Sequence[str] | None) -> list[list[int]]:
    """A mini-batch's rows, whole (no `envs`) or one part per env (in order of first row)."""
    if envs is None:
        return [idx]
    parts: dict[str, list[int]] = {}
    for i in idx:
        parts.setdefault(envs[i], []).append(i)
    return list(parts.values())


class GradShare:
    """Each env's share of the gradient, from the env-by-env backward passes of a mini-batch.

    The mini-batch's loss is a sum over rows with the mini-batch's denominators, so its gradient
    is exactly the sum of each env's part, g = sum_e g_e; what an env's passes add to the
    accumulated `.grad` is g_e. Over the step, share_e = sum ||g_e||^2 / sum_e' ||g_e'||^2 (the
    squared norms before clipping, summed over mini-batches and epochs; the shares sum to 1, and
    leave out the cross terms <g_e, g_e'>). Cost: no extra forward or backward pass; one copy of
    the gradient and one difference per env per mini-batch (as many micro-batches as before,
    plus at most one per env where a micro-batch would have held rows of two envs)."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = params
        self.squared: dict[str, float] = {}
        self._before: list[torch.Tensor] | None = None  # the gradient before this env's passes

    def add(self, env: str) -> None:
        """On learner ranks each rank measures its shard (`to_local`): the squared norms add up
        across ranks (`LocalLearner._reduced`) before `metrics`."""
        now = [
            _local(p.grad).detach().clone() if p.grad is not None else torch.zeros_like(_local(p))
            for p in self.params
        ]
        before = self._before or [torch.zeros_like(g) for g in now]
        sq = sum(float((a - b).double().square().sum()) for a, b in zip(now, before, strict=True))
        self.squared[env] = self.squared.get(env, 0.0) + sq
        self._before = now

    def reset(self) -> None:
        """A new mini-batch: its gradient starts from zero."""
        self._before = None

    def metrics(self, squared: dict[str, float] | None = None) -> dict[str, float]:
        """Each env's share, of this process's squared norms or of `squared` (summed over ranks)."""
        squared = self.squared if squared is None else squared
        total = sum(squared.values())
        return {f"grad_share/{e}": v / total if total > 0 else 0.0 for e, v in sorted(squared.items())}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


__all__ = ["GradShare", "by_env"]
