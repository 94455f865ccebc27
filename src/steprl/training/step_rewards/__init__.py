"""Step-reward models trained beside the policy (`algorithm.step_reward`, docs/algorithms.md).

A kind is a class `(ModelContext, **params)` following `StepRewardModel`: `score` gives one
reward per step of a step's groups, `fit` trains its own model on them, and its state round-trips
through a checkpoint. `StepCredit` (credit.py) wraps the kind the config names with its weight,
its fit cadence and the drift guard, and is the run component the checkpoint stores. To add a
kind: a file here and one entry in `STEP_REWARDS`; `training/commands/step_reward_check.py` (the tests run it
over every entry) checks it. A kind of your own needs no edit: `kind: package.module:attr`.
"""

from __future__ import annotations

from collections.abc import Callable

from steprl.config import ConfigError, StepRewardSection
from steprl.registry import Registry, class_with
from steprl.training.step_rewards.base import ModelContext, StepData, StepRewardModel
from steprl.training.step_rewards.credit import DriftGuard, Scored, StepCredit
from steprl.training.step_rewards.istar import IStar
from steprl.training.step_rewards.mc_value import MCValue
from steprl.training.step_rewards.policy_gain import PolicyGain
from steprl.training.step_rewards.progress import Progress

#: what a kind's class must define (`StepRewardModel`; `trains` may be set in `__init__`)
_METHODS = ("score", "fit", "state_dict", "load_state_dict")

#: kind name -> the class `(ModelContext, **params)` that makes it
STEP_REWARDS: Registry[Callable[..., StepRewardModel]] = Registry(
    {
        "istar": IStar,  # implicit PRM, trajectory-level DPO (arXiv 2509.19199)
        "progress": Progress,  # contributions summing to the outcome + grounding (SPA-RL, 2505.20732)
        "mc_value": MCValue,  # V regressed on Monte-Carlo returns, one-step advantages (AgentPRM, 2502.10325)
        "policy_gain": PolicyGain,  # log pi_theta - log pi_ref per step, no training (2606.26080)
    },
    key="algorithm.step_reward.kind",
    what="kind",
    accept=class_with(*_METHODS),
    expected=f"a step-reward class; name a class (ModelContext, **params) with {', '.join(_METHODS)} "
    "(StepRewardModel, docs/algorithms.md)",
    params=lambda cls: cls,
    params_key="algorithm.step_reward.params",
    checker="steprl.training.commands.step_reward_check:check_kind",
    cheap=False,  # a small model and its episodes per kind
)


def step_reward_class(kind: str) -> Callable[..., StepRewardModel]:
    """The kind `kind`: an entry of `STEP_REWARDS` or the import path of your own class. An
    import path to anything else (a function such as `os:system`) is one line now, not a crash
    when the run calls it with the model."""
    return STEP_REWARDS.lookup(kind)


def check_config(section: StepRewardSection) -> None:
    """The kind resolves and its params match its signature: one line, before a model loads."""
    STEP_REWARDS.check_params(section.kind, section.params)


def make_step_credit(section: StepRewardSection, ctx: ModelContext) -> StepCredit:
    cls = step_reward_class(section.kind)
    try:
        model = cls(ctx, **section.params)
    except ValueError as exc:
        raise ConfigError(f"algorithm.step_reward.params: {exc}") from None
    d = section.drift
    return StepCredit(
        section.kind,
        model,
        weight=section.weight,
        fit_every=section.fit_every,
        mode=section.mode,
        drift=DriftGuard(d.min_tau, d.patience, d.decay, d.after_fits),
    )


__all__ = [
    "STEP_REWARDS",
    "ModelContext",
    "Scored",
    "StepCredit",
    "StepData",
    "StepRewardModel",
    "check_config",
    "make_step_credit",
    "step_reward_class",
]
