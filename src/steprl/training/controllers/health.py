"""The health monitor (`health:`): after each step it computes the health signals over the last
`health.window` steps' metrics (`health/signals.py`), logs them as `health/<signal>`, and checks
every rule (`health.rules`, default `health/rules.py: DEFAULT_RULES`). A rule whose conditions
held for its `steps` steps in a row, out of its cooldown, fires: its actions change the levers
(learning-rate and KL scales, entropy bonus, group filter, curriculum hold: they stay set) or
act once (alert, snapshot, rollback, stop; `training/loop/health_run.py` carries those out), and
the firing becomes one `health.jsonl` record. A rule that has fired `budget` times does `then`
(stop or alert) instead. With `health.act: false` rules fire and are recorded, nothing acts.

Its state (the metrics window, each rule's streak, last firing and count, the levers) is
checkpointed under `controller:health`, so a resume continues every band, cooldown and budget
exactly."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from steprl.config import Config
from steprl.config.health import RuleSection
from steprl.health.actions import ACTIONS, Levers, Once
from steprl.health.rules import holds
from steprl.health.signals import SIGNALS, compute_signals, signal_value
from steprl.training.controllers.base import Adjustments, Rollback, StepReport


class HealthMonitor:
    reads: tuple[str, ...] = tuple(dict.fromkeys(k for s in SIGNALS.values() for k in s.reads))

    def __init__(self, rules: list[RuleSection], *, window: int, act: bool) -> None:
        self.rules = rules
        self.window = window
        self.act = act
        self.history: list[dict[str, float]] = []  # the last `window` steps' metrics it reads
        self.streak = {r.name: 0 for r in rules}  # steps in a row its conditions held
        self.last_fired: dict[str, int] = {}  # rule -> the step it last fired
        self.fired = {r.name: 0 for r in rules}
        self.levers = Levers()

    @staticmethod
    def from_config(cfg: Config) -> HealthMonitor:
        h = cfg.health
        return HealthMonitor(h.effective_rules(), window=h.window, act=h.act)

    def current(self) -> Adjustments:
        return _standing(self.levers)

    def observe(self, report: StepReport) -> Adjustments:
        step = report.step
        row = {k: float(report.metrics[k]) for k in self.reads if k in report.metrics}
        self.history = [*self.history, row][-self.window :]
        values = {name: signal_value(name, self.history) for name in SIGNALS}
        metrics = compute_signals(self.history)
        once, events, stop = Once(), [], None
        for rule in self.rules:
            self.streak[rule.name] = self.streak[rule.name] + 1 if holds(_conds(rule), values) else 0
            last = self.last_fired.get(rule.name)
            if self.streak[rule.name] < rule.steps or (last is not None and step - last <= rule.cooldown):
                continue
            self.streak[rule.name] = 0
            self.last_fired[rule.name] = step
            self.fired[rule.name] += 1
            rule_once, outcome, taken = self._fire(rule, step)
            once = once.merge(rule_once)
            seen = {c.signal: values[c.signal] for c in rule.when}
            events.append(
                {
                    "step": step,
                    "rule": rule.name,
                    "signals": seen,
                    "actions": taken,
                    "outcome": outcome,
                    "acted": self.act,
                }
            )
            if rule_once.stop and stop is None:
                shown = ", ".join(f"{k}={v:.3g}" for k, v in seen.items() if v is not None)
                stop = f"health rule {rule.name!r} stopped the run at step {step} ({shown})"
        metrics |= {
            "health/firings": float(len(events)),
            "health/lr_scale": self.levers.lr_scale,
            "health/kl_scale": self.levers.kl_scale,
        }
        return replace(
            _standing(self.levers),
            rollback=Rollback(once.rollback, once.replay) if once.rollback else None,
            snapshot=once.snapshot or None,
            stop=stop,
            metrics=metrics,
            events=tuple(events),
        )

    def _fire(self, rule: RuleSection, step: int) -> tuple[Once, str, list[str]]:
        """Take the rule's actions (or its `then`, its budget spent): what happens once, the
        outcome text, and the actions taken (observe mode: none taken; the record names the
        rule's actions, what would have been done)."""
        if not self.act:
            return Once(), "observed (health.act=false)", [a.name for a in rule.actions]
        if self.fired[rule.name] > rule.budget:
            if rule.then == "stop":
                return Once(alert=True, stop=True), f"budget of {rule.budget} spent: stop", ["alert", "stop"]
            return Once(alert=True), f"budget of {rule.budget} spent: alert", ["alert"]
        once, outcomes = Once(), list[str]()
        for action in rule.actions:
            self.levers, act_once, outcome = ACTIONS[action.name].fn(self.levers, action.params, step)
            once, outcomes = once.merge(act_once), [*outcomes, outcome]
        return once, "; ".join(outcomes), [a.name for a in rule.actions]

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": [dict(r) for r in self.history],
            "streak": dict(self.streak),
            "last_fired": dict(self.last_fired),
            "fired": dict(self.fired),
            "levers": self.levers.to_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.history = [{str(k): float(v) for k, v in r.items()} for r in state["history"]]
        self.streak = {r.name: int(state["streak"].get(r.name, 0)) for r in self.rules}
        self.last_fired = {str(k): int(v) for k, v in state["last_fired"].items()}
        self.fired = {r.name: int(state["fired"].get(r.name, 0)) for r in self.rules}
        self.levers = replace(Levers(), **state["levers"])


def _standing(levers: Levers) -> Adjustments:
    """The levers the rules' actions have set, as the trainer's named levers."""
    return Adjustments(
        lr_scale=levers.lr_scale,
        kl_scale=levers.kl_scale,
        entropy_coef=levers.entropy_coef,
        min_group_std=levers.min_group_std,
        hold_until=levers.hold_until,
    )


def _conds(rule: RuleSection) -> list[dict[str, Any]]:
    return [c.model_dump() for c in rule.when]


__all__ = ["HealthMonitor"]
