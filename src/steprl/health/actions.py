"""Health actions: what a rule does when it fires (`health.rules[].actions`).

An action is a pure function (levers, params, step) -> (levers, once, outcome):
- `Levers` persist after the firing and are checkpointed with the rule states: the learning-rate
  and KL scales, an entropy bonus, a minimum in-group reward std (the filter's strength), a
  curriculum hold;
- `Once` happens at this step only: an alert line, a snapshot checkpoint, a rollback, a stop;
- the outcome is the text of the firing's record in `health.jsonl` (the trainer completes a
  rollback's, a snapshot's and a stop's).

To add one: a function here and one entry in `ACTIONS` (its params with their defaults);
`check_action` (run by the tests over every entry) checks it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from steprl.registry import Registry, instance_of

Params = Mapping[str, Any]


@dataclass(frozen=True)
class Levers:
    """What the actions have set and what stays set: the trainer applies them every step."""

    lr_scale: float = 1.0  # times trainer.lr
    kl_scale: float = 1.0  # times the KL coefficient (algorithm.kl_coef, or the adaptive one)
    entropy_coef: float | None = None  # replaces algorithm.entropy_coef
    min_group_std: float | None = None  # groups whose reward std is below it are not trained on
    hold_until: int = 0  # the horizon curriculum does not advance through this step

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Once:
    """What happens at the firing's step only."""

    alert: bool = False
    snapshot: bool = False
    # restore the weights and optimizer of this many steps back; the task stream goes on (the
    # tasks that led there are not trained again), or, with `replay`, they are served again first
    rollback: int | None = None
    replay: bool = False
    stop: bool = False

    def merge(self, other: Once) -> Once:
        return Once(
            alert=self.alert or other.alert,
            snapshot=self.snapshot or other.snapshot,
            rollback=max(self.rollback or 0, other.rollback or 0) or None,
            replay=self.replay or other.replay,
            stop=self.stop or other.stop,
        )


Result = tuple[Levers, Once, str]


@dataclass(frozen=True)
class ActionSpec:
    fn: Callable[[Levers, Params, int], Result]
    params: Mapping[str, Any] = field(default_factory=dict)  # name -> default (its type is the type)
    doc: str = ""


def alert(levers: Levers, p: Params, step: int) -> Result:
    return levers, Once(alert=True), "alert"


def snapshot(levers: Levers, p: Params, step: int) -> Result:
    return levers, Once(snapshot=True), "snapshot"


def rollback(levers: Levers, p: Params, step: int) -> Result:
    k, replay = int(p["k"]), bool(p["replay"])
    then = "their tasks served again" if replay else "their tasks skipped"
    return levers, Once(rollback=k, replay=replay), f"rollback {k} step(s), {then}"


def lr_scale(levers: Levers, p: Params, step: int) -> Result:
    new = max(levers.lr_scale * float(p["factor"]), float(p["min"]))
    return dataclasses.replace(levers, lr_scale=new), Once(), f"lr scale {levers.lr_scale:g} -> {new:g}"


def kl_scale(levers: Levers, p: Params, step: int) -> Result:
    new = min(levers.kl_scale * float(p["factor"]), float(p["max"]))
    return dataclasses.replace(levers, kl_scale=new), Once(), f"kl scale {levers.kl_scale:g} -> {new:g}"


def entropy_bonus(levers: Levers, p: Params, step: int) -> Result:
    new = max(levers.entropy_coef or 0.0, float(p["coef"]))
    return dataclasses.replace(levers, entropy_coef=new), Once(), f"entropy coef -> {new:g}"


def filter_groups(levers: Levers, p: Params, step: int) -> Result:
    new = max(levers.min_group_std or 0.0, float(p["min_group_std"]))
    return (
        dataclasses.replace(levers, min_group_std=new),
        Once(),
        f"groups with reward std < {new:g} not trained on",
    )


def curriculum_hold(levers: Levers, p: Params, step: int) -> Result:
    until = max(levers.hold_until, step + int(p["steps"]) - 1)  # `steps` steps, this one the first
    return dataclasses.replace(levers, hold_until=until), Once(), f"curriculum held through step {until}"


def stop(levers: Levers, p: Params, step: int) -> Result:
    return levers, Once(stop=True), "stop"


ACTIONS: Registry[ActionSpec] = Registry(
    {
        "alert": ActionSpec(alert, {}, "one ALERT line naming the rule and its signals"),
        "snapshot": ActionSpec(snapshot, {}, "a checkpoint of this step (trainer.keep_last applies)"),
        "rollback": ActionSpec(
            rollback,
            {"k": 1, "replay": False},
            "restore the weights and optimizer of k steps back (the in-memory ring, health.snapshots); "
            "replay: the undone steps' tasks are served again first (else skipped)",
        ),
        "lr_scale": ActionSpec(
            lr_scale, {"factor": 0.5, "min": 0.01}, "multiply the learning rate (floored)"
        ),
        "kl_scale": ActionSpec(
            kl_scale, {"factor": 2.0, "max": 100.0}, "multiply the KL coefficient (needs kl_coef > 0)"
        ),
        "entropy_bonus": ActionSpec(entropy_bonus, {"coef": 0.01}, "an entropy bonus in the policy loss"),
        "filter": ActionSpec(filter_groups, {"min_group_std": 0.05}, "drop groups with little reward spread"),
        "curriculum_hold": ActionSpec(curriculum_hold, {"steps": 5}, "the horizon curriculum waits"),
        "stop": ActionSpec(stop, {}, "stop the run: one line naming the rule and the last good checkpoint"),
    },
    key="health.rules.actions",
    what="action",
    accept=instance_of(ActionSpec),
    expected="an ActionSpec (health/actions.py)",
    params=lambda spec: spec.params,
    checker="steprl.health.actions:check_action",
)


def resolve_params(name: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """The action's params: its defaults overridden by `given`; unknown names or wrong types
    raise ValueError naming the allowed ones."""
    return ACTIONS.check_params(name, given)


class ActionCheckError(Exception):
    pass


def check_action(name: str, spec: ActionSpec | None = None) -> None:
    """An action is pure (the same levers and params give the same result twice), leaves the
    levers it does not own alone only through its result, and says what it did. `spec`: the
    entry `name` of `ACTIONS` unless given."""
    spec = spec if spec is not None else ACTIONS.lookup(name)
    params = dict(spec.params)
    for levers in (
        Levers(),
        Levers(lr_scale=0.25, kl_scale=4.0, entropy_coef=0.02, min_group_std=0.1, hold_until=3),
    ):
        first, second = spec.fn(levers, params, 7), spec.fn(levers, params, 7)
        if first != second:
            raise ActionCheckError(f"action {name!r}: the same input gave different results")
        new, once, outcome = first
        if not isinstance(new, Levers) or not isinstance(once, Once):
            raise ActionCheckError(f"action {name!r}: must return (Levers, Once, str)")
        if not outcome:
            raise ActionCheckError(f"action {name!r}: its outcome text is empty")
        if levers == Levers() and new == levers and once == Once():
            raise ActionCheckError(f"action {name!r} did nothing at its defaults")


__all__ = [
    "ACTIONS",
    "ActionCheckError",
    "ActionSpec",
    "Levers",
    "Once",
    "check_action",
    "resolve_params",
]
