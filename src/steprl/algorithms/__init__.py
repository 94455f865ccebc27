"""Algorithms: advantage estimators and policy losses, picked by name from one dict each.

The learner is algorithm-blind: it looks the configured names up here and never branches on them.
`algorithms/` imports only torch and `steprl.types`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from steprl.algorithms import advantages, losses

#: name -> fn(rewards (N,), group_index (N,), **params) -> advantages (N,)
ADVANTAGES: dict[str, Callable[..., torch.Tensor]] = {
    "grpo": advantages.grpo,
}

#: name -> fn(logp, old_logp, advantages, **params) -> PolicyLossOutput
POLICY_LOSSES: dict[str, Callable[..., losses.PolicyLossOutput]] = {
    "ppo_clip": losses.ppo_clip,
}

AGGREGATIONS: tuple[str, ...] = ("token-mean",)
