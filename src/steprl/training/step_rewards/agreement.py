"""How far a step reward agrees with what is known: pure functions, no model.

* `kendall_within_groups`: Kendall's tau between each trajectory's summed step reward and its
  outcome, over the pairs a group method compares (same task, different outcomes). tau =
  (concordant - discordant) / pairs; a pair whose summed rewards tie counts as neither, so a
  reward that says nothing (all equal) reads 0, one that ranks every pair right 1, and one that
  ranks them all wrong -1. NaN when no group has two different outcomes.
* `auroc`: the probability that a random positive (a step labelled optimal) gets a higher score
  than a random negative, ties counting half (the Mann-Whitney statistic). NaN without both.
* `positive_share_on_failures`: the share of the steps of failed episodes (outcome <= 0) whose
  step reward is positive: credit paid for what did not work.
"""

from __future__ import annotations

import math

from torch import Tensor


def kendall_within_groups(summed: Tensor, outcomes: Tensor, groups: Tensor) -> float:
    """summed, outcomes, groups: (N,). See the module docstring."""
    same = groups[:, None] == groups[None, :]
    d_out = outcomes[:, None] - outcomes[None, :]
    pairs = same & (d_out > 0)  # each informative pair once: i the better of the two
    n = int(pairs.sum())
    if n == 0:
        return math.nan
    d_rew = (summed[:, None] - summed[None, :])[pairs]
    return float(((d_rew > 0).sum() - (d_rew < 0).sum()) / n)


def auroc(scores: Tensor, labels: Tensor) -> float:
    """scores: (K,) float; labels: (K,) bool."""
    pos, neg = scores[labels], scores[~labels]
    if pos.numel() == 0 or neg.numel() == 0:
        return math.nan
    diff = pos[:, None] - neg[None, :]
    return float(((diff > 0).float() + 0.5 * (diff == 0).float()).mean())


def positive_share_on_failures(step_rewards: Tensor, step_traj: Tensor, outcomes: Tensor) -> float:
    """(S,) step rewards, (S,) trajectory of each step, (N,) outcomes. NaN without a failed step."""
    failed = outcomes[step_traj] <= 0
    if not bool(failed.any()):
        return math.nan
    return float((step_rewards[failed] > 0).float().mean())


__all__ = ["auroc", "kendall_within_groups", "positive_share_on_failures"]
