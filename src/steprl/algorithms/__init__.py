"""Algorithms: advantage estimators, policy losses, aggregations and group filters, each picked
by name from ONE dict below. The trainer looks names up here and never branches on them.

`algorithms/` imports only torch, the standard library and `steprl.types`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from steprl.algorithms import estimators, filters, losses
from steprl.algorithms.inputs import AdvantageInputs, AdvantageOutput, PolicyLossInputs

#: name -> fn(inputs: AdvantageInputs, **advantage_params) -> AdvantageOutput (token level)
ADVANTAGES: dict[str, Callable[..., AdvantageOutput]] = {
    "grpo": estimators.grpo,
    "dr_grpo": estimators.dr_grpo,
    "rloo": estimators.rloo,
    "loop": estimators.loop,
    "reinforce_pp": estimators.reinforce_pp,
    "reinforce_pp_baseline": estimators.reinforce_pp_baseline,
    "grpo_env_std": estimators.grpo_env_std,
    "gae": estimators.gae,
    "step_gae": estimators.step_gae,
    "bi_level_gae": estimators.bi_level_gae,
    "gigpo": estimators.gigpo,
}

#: estimators that read critic values (the config refuses them without algorithm.critic)
ADVANTAGE_NEEDS_CRITIC: dict[str, bool] = {"gae": True, "step_gae": True, "bi_level_gae": True}


@dataclass(frozen=True)
class LossSpec:
    """A policy loss and what it reads: `needs_proximal` makes the learner recompute the
    proximal log-probs (weights before this step's updates) once per step."""

    fn: Callable[..., losses.PolicyLossOutput]  # fn(inputs: PolicyLossInputs, **loss_params)
    needs_proximal: bool = False


def _ppo_clip(
    x: PolicyLossInputs, *, clip_low: float = 0.2, clip_high: float = 0.2, dual_clip_c: float | None = None
) -> losses.PolicyLossOutput:
    return losses.ppo_clip(
        x.logp, x.behav_logp, x.advantages, clip_low=clip_low, clip_high=clip_high, dual_clip_c=dual_clip_c
    )


def _loop_clip(x: PolicyLossInputs, *, eps: float = 0.1) -> losses.PolicyLossOutput:
    return losses.loop_clip(x.logp, x.behav_logp, x.advantages, eps=eps)


def _decoupled_ppo(
    x: PolicyLossInputs,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    behav_cap: float | None = 5.0,
    behav_mode: str = "mask",
    dual_clip_c: float | None = None,
) -> losses.PolicyLossOutput:
    return losses.decoupled_ppo(
        x.logp,
        x.prox_logp,
        x.behav_logp,
        x.advantages,
        clip_low=clip_low,
        clip_high=clip_high,
        behav_cap=behav_cap,
        behav_mode=behav_mode,
        dual_clip_c=dual_clip_c,
    )


#: name -> LossSpec
POLICY_LOSSES: dict[str, LossSpec] = {
    "ppo_clip": LossSpec(_ppo_clip),
    "loop_clip": LossSpec(_loop_clip),
    "decoupled_ppo": LossSpec(_decoupled_ppo, needs_proximal=True),
}

AGGREGATIONS: tuple[str, ...] = losses.AGGREGATION_MODES


def _keep_all(group_rewards: list[torch.Tensor]) -> torch.Tensor:
    return torch.arange(len(group_rewards))


def _ragen2_top_p(
    group_rewards: list[torch.Tensor], *, p: float = 0.9, eps: float = 0.01, include_zero: bool = False
) -> torch.Tensor:
    scores = filters.group_reward_std(group_rewards)
    return filters.ragen2_top_p_keep(scores, p, eps=eps, include_zero=include_zero)


#: name -> fn(group_rewards: list of (K_g,) tensors, **filter_params) -> kept group indices
GROUP_FILTERS: dict[str, Callable[..., torch.Tensor]] = {
    "none": _keep_all,
    "dapo": filters.dapo_keep,
    "starpo_s": filters.starpo_s_keep,
    "ragen2_top_p": _ragen2_top_p,
}

__all__ = [
    "ADVANTAGES",
    "ADVANTAGE_NEEDS_CRITIC",
    "AGGREGATIONS",
    "GROUP_FILTERS",
    "POLICY_LOSSES",
    "AdvantageInputs",
    "AdvantageOutput",
    "LossSpec",
    "PolicyLossInputs",
]
