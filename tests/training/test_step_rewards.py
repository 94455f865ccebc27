"""Learned step credit (issue 28): every kind of `STEP_REWARDS` on real rollouts of a real model,
the agreement measures, the drift guard, and the two ways the rewards enter the estimators.

The rollouts are gridwalk episodes of the small random model through the real HF engine
(`check.sample_data`); their outcomes are relabelled (one winner and one loser per task) so every
group carries a preference and every kind has something to fit.
"""

from __future__ import annotations

import math

import pytest
import torch

from steprl.algorithms.estimators import grpo
from steprl.config import ConfigError, StepRewardSection, load_config
from steprl.training import step_rewards
from steprl.training.commands.step_reward_check import check_kind, check_step_reward, sample_data
from steprl.training.step_rewards import STEP_REWARDS, ModelContext, StepCredit, StepData
from steprl.training.step_rewards.agreement import auroc, kendall_within_groups, positive_share_on_failures
from steprl.training.step_rewards.credit import DriftGuard


@pytest.fixture(scope="module")
def data(tokenizer, small_model) -> StepData:
    return sample_data(small_model, tokenizer)


@pytest.fixture(scope="module")
def ctx(small_model, tokenizer) -> ModelContext:
    return ModelContext(
        small_model, None, tokenizer.pad_token_id, micro_batch_size=2, temperature=1.0, grad_clip=1.0
    )


@pytest.mark.parametrize("name", sorted(STEP_REWARDS))
def test_every_kind_passes_the_checker_on_real_rollouts(name, ctx, data) -> None:
    assert data.num_steps > len(data.trajectories)  # multi-step episodes: credit has steps to tell apart
    assert {s.info.get("action_kind") for t in data.trajectories for s in t.steps} >= {"invalid"}
    check_step_reward(name, STEP_REWARDS[name], ctx, data)


def test_a_kind_of_your_own_is_checked_by_import_path(ctx, data) -> None:
    check_kind("steprl.training.step_rewards.policy_gain:PolicyGain")  # builds its own model and episodes
    # a kind that claims to train but whose fit changes nothing: the checker says so
    with pytest.raises(AssertionError, match="trains=True but a fit changed no score"):
        check_step_reward("fixed", lambda ctx: Fixed(), ctx, data)


def test_agreement_measures_on_known_cases() -> None:
    groups = torch.tensor([0, 0, 1, 1, 2])
    outcomes = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    assert kendall_within_groups(torch.tensor([2.0, 1.0, 0.0, 3.0, 9.0]), outcomes, groups) == 1.0
    assert kendall_within_groups(torch.tensor([1.0, 2.0, 0.0, 3.0, 9.0]), outcomes, groups) == 0.0
    assert kendall_within_groups(torch.tensor([1.0, 2.0, 3.0, 0.0, 9.0]), outcomes, groups) == -1.0
    assert kendall_within_groups(torch.zeros(5), outcomes, groups) == 0.0  # ties say nothing
    assert math.isnan(kendall_within_groups(torch.zeros(2), torch.ones(2), torch.zeros(2)))
    labels = torch.tensor([True, False, True, False])
    assert auroc(torch.tensor([3.0, 1.0, 2.0, 0.0]), labels) == 1.0
    assert auroc(torch.tensor([0.0, 1.0, 0.0, 1.0]), labels) == 0.0
    assert auroc(torch.tensor([1.0, 1.0, 2.0, 0.0]), labels) == 0.875  # the tie counts half
    # steps 0-1 of a success, 2-4 of a failure: one of the failure's three steps was paid
    share = positive_share_on_failures(
        torch.tensor([1.0, 1.0, 0.5, -1.0, 0.0]), torch.tensor([0, 0, 1, 1, 1]), torch.tensor([1.0, 0.0])
    )
    assert share == pytest.approx(1 / 3)


class Fixed:
    """A kind that scores what it is told: the guard's test, not a model's."""

    trains = True

    def __init__(self) -> None:
        self.sign = 1.0

    def score(self, data: StepData) -> torch.Tensor:
        return self.sign * data.x.rewards[data.x.step_traj]  # every step paid its outcome

    def fit(self, data: StepData) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict:
        return {"sign": self.sign}

    def load_state_dict(self, state) -> None:
        self.sign = state["sign"]


def test_the_drift_guard_cuts_alpha_on_a_flipped_reward_and_is_silent_while_it_agrees(data) -> None:
    kind = Fixed()
    credit = StepCredit("fixed", kind, weight=0.5, fit_every=1, mode="advantage", drift=DriftGuard())
    taus, alphas, alerts = [], [], []
    for step in range(1, 14):
        kind.sign = 1.0 if step <= 5 else -1.0  # the labels flip at step 6
        scored = credit.score(data, step)
        credit.fit(data, step)
        taus.append(scored.metrics["step_reward/kendall_tau"])
        alphas.append(scored.alpha)
        alerts += scored.alerts
    assert taus[:5] == [1.0] * 5 and taus[5:] == [-1.0] * 8
    assert alphas[:6] == [0.5] * 6  # patience 2: the second step below min_tau cuts
    assert alphas[6:9] == [0.25, 0.125, 0.0625] and alphas[-1] == 0.0
    assert alerts and all("drifts from the outcomes" in a and "'fixed'" in a for a in alerts)
    assert "for the rest of the run" in alerts[-1]
    assert len(alerts) == alphas.index(0.0) - 5  # one line per cut, silent once alpha is 0
    healthy = StepCredit("fixed", Fixed(), weight=0.5, fit_every=1, mode="advantage", drift=DriftGuard())
    assert not any(healthy.score(data, s).alerts for s in range(1, 8)) and healthy.alpha == 0.5
    resumed = StepCredit("fixed", Fixed(), weight=0.5, fit_every=1, mode="advantage", drift=DriftGuard())
    resumed.load_state_dict(credit.state_dict())
    assert (resumed.alpha, resumed.fits, resumed.below) == (credit.alpha, credit.fits, credit.below)


def test_step_rewards_enter_as_normalised_advantages_or_as_rewards(data) -> None:
    x = data.x
    r = torch.arange(data.num_steps, dtype=torch.float32)
    base = grpo(x)
    adv = step_rewards.Scored(r, 0.5, "advantage", {}, ()).into_advantages(x, base)
    extra = adv.advantages - base.advantages
    step_of = x.token_step
    for g in torch.unique(x.group_index):  # A_step: z-scored over the group's steps, times alpha
        steps = (x.group_index[x.step_traj] == g).nonzero().flatten()
        z = (r[steps] - r[steps].mean()) / r[steps].std(unbiased=False)
        for s, want in zip(steps.tolist(), (0.5 * z).tolist(), strict=True):
            got = extra[step_of == s]
            assert got.numel() > 0 and torch.allclose(got, torch.full_like(got, want), atol=1e-5)
    assert torch.equal(extra[step_of < 0], torch.zeros_like(extra[step_of < 0]))  # off the actions
    as_rewards = step_rewards.Scored(r, 0.5, "reward", {}, ()).into_rewards(x)
    assert torch.allclose(as_rewards.step_rewards, x.step_rewards + 0.5 * r)
    assert torch.allclose(as_rewards.token_rewards.sum(), x.token_rewards.sum() + 0.5 * r.sum())
    off = step_rewards.Scored(r, 0.0, "advantage", {}, ())
    assert off.into_advantages(x, base) is base and off.into_rewards(x) is x


def test_bad_step_reward_configs_are_one_line_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"algorithm\.step_reward\.kind: unknown kind 'istr'.*'istar'"):
        step_rewards.check_config(StepRewardSection(kind="istr"))
    with pytest.raises(
        ConfigError, match=r"algorithm\.step_reward\.params: unknown key\(s\) bta; allowed keys: beta"
    ):
        step_rewards.check_config(StepRewardSection(kind="istar", params={"bta": 0.1}))
    with pytest.raises(ConfigError, match=r"algorithm\.step_reward\.mode"):
        load_config(None, ["algorithm.step_reward={kind: istar, mode: rewards}"])
    with pytest.raises(ConfigError, match=r"algorithm\.step_reward\.params: istar needs"):
        ctx = ModelContext(torch.nn.Linear(1, 1), None, 0, 1, 1.0, 1.0)
        step_rewards.make_step_credit(StepRewardSection(kind="istar", params={"beta": -1.0}), ctx)
