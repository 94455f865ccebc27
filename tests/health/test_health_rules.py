"""Health signals, actions and rules (`steprl.health`, `training/controllers/health.py`): the
checkers over every registered signal and action, each signal's meaning on a window built to
show it, and the rule machinery (steps in a row, cooldown, budget then stop, observe mode)."""

from __future__ import annotations

import pytest

from steprl.config import ConfigError, load_config
from steprl.health.actions import ACTIONS, ActionCheckError, ActionSpec, Once, check_action
from steprl.health.signals import SIGNALS, SignalCheckError, SignalSpec, check_signal, signal_value
from steprl.training.controllers import StepReport
from steprl.training.controllers.health import HealthMonitor


@pytest.mark.parametrize("name", SIGNALS)
def test_every_signal_passes_the_checker(name):
    check_signal(name, SIGNALS[name])


@pytest.mark.parametrize("name", ACTIONS)
def test_every_action_passes_the_checker(name):
    check_action(name, ACTIONS[name])


def test_the_checkers_catch_an_impure_signal_and_an_action_that_does_nothing():
    calls = iter(range(10**6))
    sneaky = SignalSpec(lambda w: float(next(calls)), ("x",), "counts its calls")
    with pytest.raises(SignalCheckError, match="not pure"):
        check_signal("sneaky", sneaky)
    peeking = SignalSpec(lambda w: float(len(w[-1])) if w else None, ("x",), "reads every key")
    with pytest.raises(SignalCheckError, match="declare"):
        check_signal("peeking", peeking)
    with pytest.raises(ActionCheckError, match="did nothing"):
        check_action("idle", ActionSpec(lambda lv, p, s: (lv, Once(), "nothing"), {}))


def _rows(key, values):
    return [{key: float(v)} for v in values]


def test_entropy_drop_counts_a_sustained_fall_below_the_band_not_an_eruption():
    steady = [1.0, 1.05, 0.95, 1.0, 1.02, 0.98]
    assert signal_value("entropy_drop", _rows("actor/entropy", [*steady, 0.5, 0.45, 0.4])) == 3
    assert signal_value("entropy_drop", _rows("actor/entropy", [*steady, 0.5, 0.45, 1.0])) == 0  # recovered
    assert signal_value("entropy_drop", _rows("actor/entropy", [*steady, 3.0, 4.0, 5.0])) == 0  # eruption
    assert signal_value("entropy_drop", _rows("actor/entropy", steady[:5])) is None  # no band yet


def test_tool_call_fall_grad_norm_z_and_reward_slope():
    assert signal_value(
        "tool_call_fall", _rows("tools/call_rate", [0.4, 0.4, 0.4, 0.2, 0.0, 0.0])
    ) == pytest.approx(1 - (0.2 / 3) / 0.4)
    assert (
        signal_value("tool_call_fall", _rows("tools/call_rate", [0.01] * 6)) is None
    )  # never called: nothing to lose
    assert signal_value("grad_norm_z", _rows("actor/grad_norm_max", [1.0, 1.1, 0.9, 1.0, 1.05, 9.0])) > 50
    assert signal_value("reward_slope", _rows("reward/mean", [0, 0.1, 0.2, 0.3, 0.4])) == pytest.approx(0.1)


def test_proxy_gap_and_outcome_slope_tell_a_hacked_reward_from_a_learning_one():
    """The default `off_task_reward` and `reward_hacking` rules on the fixed-phrase recipe's
    shape: learning (both rise, a format penalty fading on top), then the total rising on a
    phrase while the outcome component stays flat (an alert), then falls (a stop)."""

    def rows(total, outcome):
        return [
            {"reward/mean": t, "reward_component/outcome": o} for t, o in zip(total, outcome, strict=True)
        ]

    learning = rows(
        [0.1, 0.2, 0.3, 0.35, 0.45, 0.5, 0.52, 0.56, 0.6], [0.4, 0.45, 0.5, 0.5, 0.55, 0.56, 0.55, 0.58, 0.6]
    )
    off_task = rows([0.7, 0.8, 0.9, 1.0, 1.1, 1.2], [0.6, 0.59, 0.6, 0.61, 0.6, 0.6])
    hacked = rows([1.3, 1.4, 1.5, 1.6, 1.7, 1.8], [0.55, 0.5, 0.45, 0.4, 0.35, 0.3])
    assert signal_value("proxy_gap", learning) == pytest.approx(0.036310, abs=1e-6)  # > 0.02 ...
    assert signal_value("outcome_slope", learning) == pytest.approx(0.019167, abs=1e-6)  # ... but it learns
    assert signal_value("proxy_gap", learning[:7]) is None  # 8 steps needed

    m = HealthMonitor.from_config(load_config(None, []))  # the default rules
    out = [m.observe(StepReport(s, r)) for s, r in enumerate([*learning, *off_task, *hacked], start=1)]
    fired = [(e["rule"], s) for s, a in enumerate(out, start=1) for e in a.events]
    assert fired[:2] == [("off_task_reward", 16), ("reward_hacking", 18)]
    assert out[15].stop is None and out[17].stop is not None and "'reward_hacking'" in out[17].stop


def test_a_fading_format_penalty_is_learning_not_an_off_task_reward():
    """The ordinary early-training pattern (envs/rewards.py): the format penalty fades while the
    outcome stays flat, with sampling noise. The total rises faster than the outcome, but what
    it rises on is a penalty's recovery: neither reward rule fires."""
    import random

    rng = random.Random(0)
    m = HealthMonitor.from_config(load_config(None, []))
    for step in range(1, 31):
        outcome = 0.3 + rng.gauss(0, 0.06)
        fmt = -0.3 * max(0.0, 1 - step / 10)
        row = {"reward/mean": outcome + fmt, "reward_component/outcome": outcome}
        row["reward_component/format"] = fmt
        out = m.observe(StepReport(step, row))
        assert signal_value("proxy_gap", m.history) in (None, pytest.approx(0.0, abs=1e-9))
        assert not [e for e in out.events if e["rule"] in ("off_task_reward", "reward_hacking")], step


def _monitor(rules, **kw):
    cfg = load_config(None, [f"health.rules={rules}", *[f"health.{k}={v}" for k, v in kw.items()]])
    return HealthMonitor.from_config(cfg)


def _step(monitor, step, kl):
    return monitor.observe(StepReport(step, {"actor/approx_kl": kl}))


def test_a_rule_needs_its_steps_in_a_row_waits_out_its_cooldown_and_stops_when_its_budget_is_spent():
    m = _monitor(
        "[{name: jump, when: [{signal: approx_kl, above: 1}], steps: 2, cooldown: 2, budget: 2, "
        "actions: [alert, {lr_scale: {factor: 0.5}}]}]"
    )
    fired = {s: _step(m, s, kl) for s, kl in enumerate([5, 0, 5, 5, 5, 5, 5, 5, 5, 5], start=1)}
    steps = [s for s, a in fired.items() if a.events]
    # 3-4 in a row; then 5-6 in a row but 6 is within the cooldown, so 7; then 8-9, 10
    assert steps == [4, 7, 10]
    assert fired[4].lr_scale == 0.5 and fired[7].lr_scale == 0.25 and fired[7].kl_scale == 1.0
    last = fired[10]
    assert last.stop is not None and "'jump'" in last.stop and "approx_kl=5" in last.stop
    assert last.events[0]["outcome"] == "budget of 2 spent: stop"
    assert last.events[0]["actions"] == ["alert", "stop"]  # what was done, not the rule's list
    assert last.metrics["health/firings"] == 1 and last.metrics["health/lr_scale"] == 0.25


def test_observe_mode_records_the_firing_and_changes_nothing():
    m = _monitor("[{name: jump, when: [{signal: approx_kl, above: 1}], actions: [stop]}]", act="false")
    out = _step(m, 1, 9.0)
    assert out.stop is None and out.rollback is None and out.snapshot is None
    assert (out.lr_scale, out.kl_scale, out.entropy_coef, out.min_group_std) == (1.0, 1.0, None, None)
    assert out.events == (
        {
            "step": 1,
            "rule": "jump",
            "signals": {"approx_kl": 9.0},
            "actions": ["stop"],
            "outcome": "observed (health.act=false)",
            "acted": False,
        },
    )


def test_rule_config_errors_name_the_key_and_the_allowed_values():
    with pytest.raises(ConfigError, match="unknown action 'reboot'; allowed values: \\['alert'"):
        load_config(
            None, ["health.rules=[{name: a, when: [{signal: approx_kl, above: 1}], actions: [reboot]}]"]
        )
    with pytest.raises(ConfigError, match="exactly one of above / below"):
        load_config(None, ["health.rules=[{name: a, when: [{signal: approx_kl}], actions: [alert]}]"])
    with pytest.raises(ConfigError, match="has no param 'q'"):
        load_config(
            None,
            [
                "health.rules=[{name: a, when: [{signal: approx_kl, above: 1}], "
                "actions: [{rollback: {q: 1}}]}]"
            ],
        )
    assert not load_config(None, ["health=off"]).health.enabled


def test_a_curriculum_hold_keeps_the_horizon_stage_while_it_lasts():
    from steprl.training.controllers import Controllers

    hold = (
        "[{name: wait, when: [{signal: approx_kl, above: 1}], cooldown: 9, "
        "actions: [{curriculum_hold: {steps: 2}}]}]"
    )
    cfg = load_config(
        None,
        [f"health.rules={hold}", "trainer.curriculum.rounds=[2,4,6]", "trainer.curriculum.stage_steps=1"],
    )
    run = Controllers.for_config(cfg)
    caps = [
        run.observe(StepReport(s, {"actor/approx_kl": 5.0 if s == 2 else 0.0})).max_turns for s in range(1, 6)
    ]
    assert caps == [4, 4, 4, 6, 6]  # steps 2 and 3 held: the stage moved on one step at a time after


def test_the_docs_name_every_signal_action_and_default_rule():
    from pathlib import Path

    from steprl.health.rules import DEFAULT_RULES

    text = (Path(__file__).resolve().parents[2] / "docs" / "health.md").read_text()
    for name in [*SIGNALS, *ACTIONS, *(r["name"] for r in DEFAULT_RULES)]:
        assert f"`{name}`" in text, name
