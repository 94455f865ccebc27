"""Every registered estimator, loss and filter keeps its contract (`steprl.algorithms.check`),
parametrized from the dicts so that a new entry is covered as soon as it is registered; and the
checker itself catches the breakages it names (each on a deliberately broken entry)."""

from __future__ import annotations

import pytest
import torch

from steprl.algorithms import (
    ADVANTAGE_NEEDS_CRITIC,
    ADVANTAGES,
    GROUP_FILTERS,
    POLICY_LOSSES,
    advantages,
    estimators,
)
from steprl.algorithms.check import (
    AlgorithmCheckError,
    check_advantage,
    check_group_filter,
    check_policy_loss,
)
from steprl.algorithms.inputs import AdvantageInputs, AdvantageOutput
from steprl.config import load_config

# Group-relative estimators: a flat group gets exactly 0 whatever the rest of the batch holds.
# The registry has no field for this yet (ADVANTAGE_NEEDS_CRITIC is its only metadata), so it is
# listed here; the others whiten over the whole batch (reinforce_pp, reinforce_pp_baseline) or
# read a critic (the GAE family), which moves a flat group with the rest of the batch.
GROUP_RELATIVE = {"grpo", "dr_grpo", "rloo", "loop", "grpo_env_std", "gigpo"}


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_every_estimator_keeps_the_contract(name):
    report = check_advantage(name)
    common = {"shapes", "finite", "masked", "pure", "layouts", "ordered"}
    kind = {"critic"} if ADVANTAGE_NEEDS_CRITIC.get(name) else {"no_signal"}
    assert set(report.ran) == common | kind
    if name in GROUP_RELATIVE:
        assert report.zero_on_flat_groups, f"{name}: a flat group beside groups with spread got advantages"


def test_the_group_relative_list_names_registered_estimators():
    assert set(ADVANTAGES) >= GROUP_RELATIVE


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_every_estimator_name_loads_from_the_config(name):
    """The config accepts each name with its defaults (with a critic where it needs one); the
    trainer then calls ADVANTAGES[name] (e2e: test_algorithm_combinations)."""
    extra = ["algorithm.critic=separate"] if ADVANTAGE_NEEDS_CRITIC.get(name) else []
    cfg = load_config(None, [f"algorithm.advantage={name}", "algorithm.advantage_params={}", *extra])
    assert cfg.algorithm.advantage == name


@pytest.mark.parametrize(
    ("key", "name", "params"),
    [
        *(pytest.param("policy_loss", n, "loss_params", id=n) for n in sorted(POLICY_LOSSES)),
        *(pytest.param("group_filter", n, "filter_params", id=n) for n in sorted(GROUP_FILTERS)),
    ],
)
def test_every_loss_and_filter_name_loads_from_the_config(key, name, params):
    cfg = load_config(None, [f"algorithm.{key}={name}", f"algorithm.{params}={{}}"])
    assert getattr(cfg.algorithm, key) == name


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_policy_loss_keeps_the_contract(name):
    assert check_policy_loss(name) == ("shapes", "finite", "masked_grad", "no_signal", "on_policy")


@pytest.mark.parametrize("name", sorted(GROUP_FILTERS))
def test_every_group_filter_keeps_the_contract(name):
    assert check_group_filter(name) == ("indices", "pure", "empty")


# ---- the checker catches what it names -------------------------------------------------------


def _std_norm_without_guard(x: AdvantageInputs) -> AdvantageOutput:
    r, g = x.rewards, x.group_index
    a = torch.stack([(r[i] - r[g == g[i]].mean()) / r[g == g[i]].std() for i in range(r.numel())])
    tok = a[x.row_traj][:, None] * x.mask
    return AdvantageOutput(tok, tok)


def _leaks_onto_observations(x: AdvantageInputs) -> AdvantageOutput:
    out = estimators.grpo(x)
    return AdvantageOutput(out.advantages + 0.1 * (1 - x.mask), out.returns)


def _batch_mean_baseline(x: AdvantageInputs) -> AdvantageOutput:
    # subtracts the mean of the batch plus a small bias: the flat batch gets non-zero advantages
    a = x.rewards - x.rewards.mean() + 0.01
    tok = a[x.row_traj][:, None] * x.mask
    return AdvantageOutput(tok, tok)


def _return_restarts_at_every_row(x: AdvantageInputs) -> AdvantageOutput:
    # REINFORCE++ as it was: on step rows the earlier steps never see the outcome
    a, ret = advantages.reinforce_pp(x.token_rewards, x.mask)
    return AdvantageOutput(a, ret)


def _gae_restarts_at_every_row(x: AdvantageInputs) -> AdvantageOutput:
    # GAE as it was: on step rows a step's last token bootstraps from 0, not the next step's value
    a, ret = advantages.gae(x.token_rewards, estimators._need_values(x, "broken"), x.mask)
    return AdvantageOutput(a, ret)


def _baseline_per_row(x: AdvantageInputs) -> AdvantageOutput:
    # REINFORCE++-baseline as it was: a trajectory counted once per step row in its group's mean
    a = advantages.reinforce_pp_baseline(x.rewards[x.row_traj], x.group_index[x.row_traj], x.mask)
    return AdvantageOutput(a, a)


def _inverted(x: AdvantageInputs) -> AdvantageOutput:
    out = estimators.grpo(x)
    return AdvantageOutput(-out.advantages, -out.returns)


def _in_place(x: AdvantageInputs) -> AdvantageOutput:
    x.mask[0, 0] = 1.0  # writes the caller's mask
    return estimators.grpo(x)


def _ignores_the_critic(x: AdvantageInputs) -> AdvantageOutput:
    if x.values is None:
        raise ValueError("needs a critic: set algorithm.critic")
    return estimators.grpo(x)


@pytest.mark.parametrize(
    ("fn", "critic", "broken"),
    [
        (_std_norm_without_guard, False, "finite"),
        (_leaks_onto_observations, False, "masked"),
        (_batch_mean_baseline, False, "no_signal"),
        (_return_restarts_at_every_row, False, "layouts"),
        (_gae_restarts_at_every_row, True, "layouts"),
        (_baseline_per_row, False, "layouts"),
        (_inverted, False, "ordered"),
        (_in_place, False, "pure"),
        (_ignores_the_critic, True, "critic"),
        (estimators.grpo, True, "critic"),  # marked as needing a critic, runs without one
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_the_advantage_checker_catches_a_broken_estimator(monkeypatch, fn, critic, broken):
    monkeypatch.setitem(ADVANTAGES, "broken", fn)
    monkeypatch.setitem(ADVANTAGE_NEEDS_CRITIC, "broken", critic)
    with pytest.raises(AlgorithmCheckError, match=f"broken: {broken}:"):
        check_advantage("broken")


def test_the_loss_and_filter_checkers_catch_broken_entries(monkeypatch):
    spec = POLICY_LOSSES["ppo_clip"]

    def unclamped(x, **kw):  # exp of an unclamped log-ratio: inf off the mask, NaN gradients
        out = spec.fn(x, **kw)
        return type(out)(-(x.logp - x.behav_logp).exp() * x.advantages, out.clipped, out.log_ratio)

    def pushes_down(x, **kw):
        out = spec.fn(x, **kw)
        return type(out)(-out.loss_per_token, out.clipped, out.log_ratio)

    for fn, broken in ((unclamped, "masked_grad"), (pushes_down, "on_policy")):
        monkeypatch.setitem(POLICY_LOSSES, "broken", type(spec)(fn))
        with pytest.raises(AlgorithmCheckError, match=f"broken: {broken}:"):
            check_policy_loss("broken")

    monkeypatch.setitem(GROUP_FILTERS, "broken", lambda groups: torch.tensor([2, 0][: len(groups)]))
    with pytest.raises(AlgorithmCheckError, match="broken: indices:"):
        check_group_filter("broken")
    monkeypatch.setitem(
        GROUP_FILTERS, "broken", lambda groups: torch.arange(len(groups), dtype=torch.float32)
    )
    with pytest.raises(AlgorithmCheckError, match="broken: indices:"):
        check_group_filter("broken")


def test_an_unknown_name_lists_the_registered_ones():
    with pytest.raises(KeyError, match="registered"):
        check_advantage("no_such_estimator")
