"""Algorithms: advantage estimators, policy losses, aggregations and group filters, each picked
by name from ONE dict below. The trainer looks names up here and never branches on them.

`algorithms/` imports only torch, the standard library, `steprl.types` and `steprl.registry` (each
dict is a `Registry`: a name or `package.module:attr`, its params checked, one checker).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from steprl.algorithms import estimators, filters, losses
from steprl.algorithms.inputs import AdvantageInputs, AdvantageOutput, PolicyLossInputs
from steprl.registry import Registry, instance_of

#: name -> fn(inputs: AdvantageInputs, **advantage_params) -> AdvantageOutput (token level)
ADVANTAGES: Registry[Callable[..., AdvantageOutput]] = Registry(
    {
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
    },
    key="algorithm.advantage",
    what="advantage estimator",
    accept=inspect.isfunction,  # a function written in Python: a builtin such as os:system is callable too
    expected="an advantage estimator; name a function (inputs: AdvantageInputs, **params) -> AdvantageOutput "
    "(docs/algorithms.md)",
    params=lambda fn: fn,
    checker="steprl.algorithms.check:check_advantage",
)

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
POLICY_LOSSES: Registry[LossSpec] = Registry(
    {
        "ppo_clip": LossSpec(_ppo_clip),
        "loop_clip": LossSpec(_loop_clip),
        "decoupled_ppo": LossSpec(_decoupled_ppo, needs_proximal=True),
    },
    key="algorithm.policy_loss",
    what="policy loss",
    accept=instance_of(LossSpec),
    expected="a LossSpec; name a LossSpec(fn) whose fn is (inputs: PolicyLossInputs, **params) "
    "(docs/algorithms.md)",
    params=lambda spec: spec.fn,
    params_key="algorithm.loss_params",
    checker="steprl.algorithms.check:check_policy_loss",
)

AGGREGATIONS: tuple[str, ...] = losses.AGGREGATION_MODES


def _keep_all(group_rewards: list[torch.Tensor]) -> torch.Tensor:
    return torch.arange(len(group_rewards))


def _ragen2_top_p(
    group_rewards: list[torch.Tensor], *, p: float = 0.9, eps: float = 0.01, include_zero: bool = False
) -> torch.Tensor:
    scores = filters.group_reward_std(group_rewards)
    return filters.ragen2_top_p_keep(scores, p, eps=eps, include_zero=include_zero)


#: name -> fn(group_rewards: list of (K_g,) tensors, **filter_params) -> kept group indices
GROUP_FILTERS: Registry[Callable[..., torch.Tensor]] = Registry(
    {
        "none": _keep_all,
        "dapo": filters.dapo_keep,
        "starpo_s": filters.starpo_s_keep,
        "ragen2_top_p": _ragen2_top_p,
    },
    key="algorithm.group_filter",
    what="group filter",
    accept=inspect.isfunction,
    expected="a group filter; name a function (group_rewards: list of tensors, **params) -> kept group "
    "indices (docs/algorithms.md)",
    params=lambda fn: fn,
    params_key="algorithm.filter_params",
    checker="steprl.algorithms.check:check_group_filter",
)

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
