"""RAGEN-2's mutual-information proxy for template collapse, from a cross-scored log-prob tensor.

Template collapse (RAGEN-2: Reasoning Collapse in Agentic RL, Wang et al. 2026, arXiv 2604.06268)
is reasoning that stays diverse within a prompt (entropy looks healthy) but no longer depends on
the prompt. I(X; Z) measures that dependence. With N prompts x_j, K reasonings r_ik sampled from
each prompt x_i, and every reasoning teacher-forced under every prompt, the proxy replaces p(r)
by the uniform mixture of the N prompts (mll-lab-nu/RAGEN @20daedc,
`ragen/trainer/collapse_metrics.py::CollapseDetector`, its `mi_seq_estimate`):

    MI ~= mean_{i,k} [ log p(r_ik | x_i) - log (1/N) sum_j p(r_ik | x_j) ]
        = mean_{i,k} [ s[i, i, k] - logsumexp_j s[j, i, k] + log N ]

It lies in [-inf, log N]: 0 when no prompt explains its own reasoning better than the others do
on average, log N when each reasoning has probability only under its own prompt. Retrieval
accuracy asks "which prompt produced this reasoning?": argmax_j s[j, i, k] == i, against chance
1/N. This module is pure (torch only); `training/loop/mi_probe.py` builds the scores from rollouts.
"""

from __future__ import annotations

import math

import torch


def mi_from_scores(scores: torch.Tensor) -> tuple[float, float]:
    """scores (N, N, K): scores[j, i, k] = log p(reasoning k of prompt i | prompt j), summed over
    the reasoning's tokens. Returns (mi_nats, retrieval_accuracy).

    Computed in float64. A score may be -inf (the reasoning is impossible under that prompt), not
    NaN or +inf. Ties in the retrieval argmax go to the lowest prompt index, so a tensor whose
    scores do not depend on the prompt (every j equal) retrieves prompt 0 for every reasoning:
    only prompt 0's K reasonings count as right, an accuracy of exactly 1/N (chance), never the
    1.0 that a "matched score is among the best" rule would give a collapsed policy.
    """
    if scores.dim() != 3 or scores.shape[0] != scores.shape[1] or scores.shape[0] < 1 or scores.shape[2] < 1:
        raise ValueError(
            f"scores must be (N, N, K) with N, K >= 1: scores[j, i, k] = log p(reasoning (i, k) | "
            f"prompt j); got shape {tuple(scores.shape)}"
        )
    s = scores.detach().to(torch.float64)
    if torch.isnan(s).any() or (s == math.inf).any():
        raise ValueError("scores hold NaN or +inf: a log-prob is finite or -inf (check the forward pass)")
    n = s.shape[0]
    own = torch.arange(n, device=s.device)
    matched = s[own, own]  # (N, K): s[i, i, k]
    # logsumexp of an all -inf column is -inf: matched - (-inf) would be NaN, and such a reasoning
    # (impossible under every prompt, its own included) says nothing; it counts as 0 nats
    lse = torch.logsumexp(s, dim=0)  # (N, K) over the prompts j
    point = torch.where(torch.isinf(lse), torch.zeros_like(lse), matched - lse + math.log(n))
    mi = float(point.mean())
    best = s.max(dim=0, keepdim=True).values  # (1, N, K)
    index = own.view(n, 1, 1).expand_as(s)
    # the lowest j that reaches the maximum (explicit rather than relying on argmax's tie order)
    picked = torch.where(s == best, index, torch.full_like(index, n)).min(dim=0).values  # (N, K)
    accuracy = float((picked == own.view(n, 1)).double().mean())
    return mi, accuracy
