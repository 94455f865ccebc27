"""The `health:` config section: signals over the recent steps, rules that act on them
(docs/health.md). `health: off` (or false) turns it off; unset, the default rules
(`health/rules.py: DEFAULT_RULES`) are on."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from steprl.config.sections import Section
from steprl.health.actions import ACTIONS, resolve_params
from steprl.health.rules import DEFAULT_RULES
from steprl.health.signals import SIGNALS


class ConditionSection(Section):
    """`signal` above `above` or below `below` (exactly one of them)."""

    signal: str
    above: float | None = None
    below: float | None = None

    @field_validator("signal")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in SIGNALS:
            raise ValueError(f"unknown signal {v!r}; allowed values: {sorted(SIGNALS)}")
        return v

    @model_validator(mode="after")
    def _one_bound(self) -> ConditionSection:
        if (self.above is None) == (self.below is None):
            raise ValueError(f"give exactly one of above / below for signal {self.signal!r}")
        return self


class ActionItem(Section):
    name: str
    params: dict[str, Any] = {}


class RuleSection(Section):
    """A rule fires when all its conditions hold for `steps` steps in a row and its cooldown
    (steps since it last fired) has passed; it then takes its actions in order. After `budget`
    firings, the next one does `then` instead (stop: the run stops naming the rule)."""

    name: str
    when: list[ConditionSection] = Field(min_length=1)
    steps: int = Field(1, gt=0)
    actions: list[ActionItem] = Field(min_length=1)
    cooldown: int = Field(5, ge=0)
    budget: int = Field(3, gt=0)
    then: Literal["stop", "alert"] = "stop"

    @field_validator("actions", mode="before")
    @classmethod
    def _actions(cls, v: Any) -> Any:
        """`alert` or `{rollback: {k: 2}}` (one key: the action, its value: its params)."""
        if not isinstance(v, list):
            return v
        out: list[Any] = []
        for item in v:
            params: Any
            if isinstance(item, ActionItem):
                out.append(item)
                continue
            if isinstance(item, str):
                name, params = item, {}
            elif isinstance(item, dict) and len(item) == 1:
                name, params = next(iter(item.items()))
                params = params if params is not None else {}
            elif isinstance(item, dict) and "name" in item:
                name, params = item["name"], item.get("params", {})
            else:
                raise ValueError(f"an action is a name or {{name: {{params}}}} (got {item!r})")
            if name not in ACTIONS:
                raise ValueError(f"unknown action {name!r}; allowed values: {sorted(ACTIONS)}")
            if not isinstance(params, dict):
                raise ValueError(f"action {name!r}: its params are a mapping (got {params!r})")
            out.append({"name": name, "params": resolve_params(name, params)})
        return out


class HealthSection(Section):
    enabled: bool = True
    act: bool = True  # false: rules fire and are recorded ("observed"), no action is taken
    window: int = Field(20, ge=8)  # steps of metrics the signals read
    rules: list[RuleSection] | None = None  # None: the default rules (health/rules.py)
    extra_rules: list[RuleSection] = []  # added to the rules
    # RAGEN-2's mutual-information probe on the step's rollouts, every N steps (0: off)
    mi_every: int = Field(0, ge=0)
    mi_prompts: int = Field(8, ge=2, le=16)  # N prompts (the step's first N groups)
    mi_samples: int = Field(4, ge=1, le=4)  # K first-turn actions of each
    # rollback: the last N steps' weights and optimizer kept in memory (and in checkpoints)
    snapshots: int = Field(2, ge=0)

    def effective_rules(self) -> list[RuleSection]:
        base = (
            self.rules if self.rules is not None else [RuleSection.model_validate(r) for r in DEFAULT_RULES]
        )
        rules = [*base, *self.extra_rules]
        names = [r.name for r in rules]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"health: two rules are named {dup!r}; give each its own name")
        return rules

    @model_validator(mode="after")
    def _rules_fit(self) -> HealthSection:
        rules = self.effective_rules()
        deepest = max(
            (a.params.get("k", 0) for r in rules for a in r.actions if a.name == "rollback"), default=0
        )
        if self.enabled and self.act and deepest > self.snapshots:
            raise ValueError(
                f"health.snapshots={self.snapshots} keeps too few steps for a rollback of {deepest}; "
                f"set health.snapshots >= {deepest}"
            )
        return self


def health_value(v: Any) -> Any:
    """`health: off` / `false` -> disabled; `on` / `true` -> the defaults."""
    if v is False or v == "off":
        return {"enabled": False}
    if v is True or v == "on" or v is None:
        return {}
    return v


__all__ = ["ActionItem", "ConditionSection", "HealthSection", "RuleSection", "health_value"]
