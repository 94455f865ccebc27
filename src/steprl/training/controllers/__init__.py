"""Controllers: run components that read each finished step's metrics and change what the next
step does (the reward-KL coefficient, the turn cap of the tasks admitted next), or stop the run
with a reason.

A run's controllers are derived from its config (`ControllerSpec.used`); the trainer asks them
once per step (`Controllers.observe`) and passes the merged `Adjustments` to the next step. Each
one's state is checkpointed under its name, so a resume continues it exactly. To add one: a file
here with a class that follows `Controller`, and one entry in `CONTROLLERS`;
`check_controller` (run by the tests over every entry) checks it. A controller of your own
needs no edit here: `trainer.controllers: [package.module:attr]` names a factory (cfg) ->
controller, or a `ControllerSpec` (docs/components.md).
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from steprl.config import Config
from steprl.registry import Registry, class_with
from steprl.training.components import Stateful
from steprl.training.controllers.adaptive_kl import AdaptiveKL
from steprl.training.controllers.base import Adjustments, Controller, Rollback, StepReport
from steprl.training.controllers.failure_guard import FailureGuard
from steprl.training.controllers.health import HealthMonitor
from steprl.training.controllers.horizon_gated import HorizonGated
from steprl.training.controllers.horizon_stepwise import HorizonStepwise
from steprl.training.controllers.nonfinite_guard import NonfiniteGuard


@dataclass(frozen=True)
class ControllerSpec:
    make: Callable[[Config], Controller]
    used: Callable[[Config], bool]  # whether a run with this config has it


#: name -> how to make it and when a run has it; the name keys its state in the checkpoint.
#: Order matters only for a stop: the first controller's reason is the one reported.
CONTROLLERS: Registry[ControllerSpec] = Registry(
    {
        # health rules over the recent steps' signals (`health:`; first: its hold reaches the others)
        "health": ControllerSpec(HealthMonitor.from_config, lambda cfg: cfg.health.enabled),
        "adaptive_kl": ControllerSpec(
            AdaptiveKL.from_config, lambda cfg: cfg.algorithm.kl_ctrl == "adaptive"
        ),
        "nonfinite_guard": ControllerSpec(NonfiniteGuard.from_config, lambda cfg: True),
        "failure_guard": ControllerSpec(FailureGuard.from_config, lambda cfg: True),
        # trainer.curriculum: the turn cap of the tasks admitted next
        "horizon_stepwise": ControllerSpec(
            HorizonStepwise.from_config, lambda cfg: _horizon(cfg) == "stepwise"
        ),
        "horizon_gated": ControllerSpec(HorizonGated.from_config, lambda cfg: _horizon(cfg) == "gated"),
    },
    key="trainer.controllers",
    what="controller",
    accept=lambda obj: _controller_factory(obj),
    expected="a controller factory; name a function (cfg) -> controller, a controller class (cfg) "
    "with current, observe, state_dict, load_state_dict, or a ControllerSpec (docs/components.md)",
    checker=None,
    checked_by="check_controller, with a config that uses each one (tests/training/test_controllers.py)",
)


def _horizon(cfg: Config) -> str | None:
    return cfg.trainer.curriculum.horizon if cfg.trainer.curriculum is not None else None


def controller_spec(name: str) -> ControllerSpec:
    """The controller `name`: an entry of `CONTROLLERS`, or the import path of your own (a
    `ControllerSpec`, or a factory (cfg) -> controller, used whenever it is named)."""
    obj: Any = CONTROLLERS.lookup(name)  # a ControllerSpec, or what `_controller_factory` accepts
    return obj if isinstance(obj, ControllerSpec) else ControllerSpec(obj, lambda cfg: True)


def _controller_factory(obj: object) -> bool:
    # a function written in Python (a builtin such as os:system is callable too, and was called)
    return (
        isinstance(obj, ControllerSpec)
        or inspect.isfunction(obj)
        or class_with("current", "observe", "state_dict", "load_state_dict")(obj)
    )


_GATHERED = ("metrics", "events")  # gathered from every controller, not first-wins


def merge(adjustments: Sequence[Adjustments]) -> Adjustments:
    """One record: for each field the first value set (None: the config's value stays);
    `metrics` and `events` from every controller."""
    return Adjustments(
        **{
            f.name: next((v for a in adjustments if (v := getattr(a, f.name)) is not None), None)
            for f in dataclasses.fields(Adjustments)
            if f.name not in _GATHERED
        },
        metrics={k: v for a in adjustments for k, v in a.metrics.items()},
        events=tuple(e for a in adjustments for e in a.events),
    )


class Controllers:
    """The run's controllers, by name."""

    def __init__(self, members: Mapping[str, Controller]) -> None:
        self.members = dict(members)

    @staticmethod
    def for_config(cfg: Config) -> Controllers:
        """The registered controllers the config uses, then those `trainer.controllers` names
        (in its order; the first stop reported wins)."""
        named = {name: controller_spec(name) for name in cfg.trainer.controllers}
        specs = {name: spec for name, spec in CONTROLLERS.items() if spec.used(cfg)} | named
        return Controllers({name: spec.make(cfg) for name, spec in specs.items()})

    def components(self) -> dict[str, Stateful]:
        """By the name their states are checkpointed under."""
        return {f"controller:{name}": c for name, c in self.members.items()}

    def current(self) -> Adjustments:
        return merge([c.current() for c in self.members.values()])

    def observe(self, report: StepReport) -> Adjustments:
        """Every controller takes the step (a stop does not skip the others' updates), in
        order: a health rule's curriculum hold reaches the horizon controllers after it."""
        out: list[Adjustments] = []
        for c in self.members.values():
            # the `hold_until` lever acts here: the controllers after a health rule see its hold
            hold = merge(out).hold_until
            held = hold is not None and hold >= report.step
            out.append(c.observe(dataclasses.replace(report, hold_curriculum=held) if held else report))
        return merge(out)


class ControllerCheckError(Exception):
    pass


def check_controller(name: str, cfg: Config, *, seed: int = 0, steps: int = 24, split: int = 9) -> None:
    """Check the controller `name` (registered, or an import path) on a random metrics sequence
    of what it reads (now and then none of it, as on a step that trained nothing): the same sequence
    gives the same adjustments; its state survives `torch.save`/`torch.load(weights_only=True)`;
    and a fresh one loaded with the state after `split` steps gives the same adjustments for
    the rest. Raises `ControllerCheckError` naming what failed."""
    spec = controller_spec(name)
    if not spec.used(cfg):
        raise ControllerCheckError(f"{name}: the config given does not use it; pass one that does")
    reports = _reports(spec.make(cfg).reads, seed, steps)
    first, second = spec.make(cfg), spec.make(cfg)
    expected = [first.observe(r) for r in reports]
    if [second.observe(r) for r in reports] != expected:
        raise ControllerCheckError(f"{name}: the same metrics sequence gave different adjustments")
    before = spec.make(cfg)
    for r in reports[:split]:
        before.observe(r)
    buffer = io.BytesIO()
    torch.save(before.state_dict(), buffer)
    buffer.seek(0)
    try:
        state = torch.load(buffer, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - what torch refuses, named
        raise ControllerCheckError(f"{name}: its state_dict is not weights_only-loadable ({exc})") from exc
    after = spec.make(cfg)
    after.load_state_dict(state)
    if after.current() != before.current():
        raise ControllerCheckError(f"{name}: after load_state_dict, current() differs")
    if [after.observe(r) for r in reports[split:]] != expected[split:]:
        raise ControllerCheckError(f"{name}: after a state_dict round trip the adjustments differ")


def _reports(reads: Sequence[str], seed: int, steps: int) -> list[StepReport]:
    rng = random.Random(seed)
    values = lambda: rng.choice([0.0, 0.0, 1.0, 2.0, 8.0, rng.random()])  # noqa: E731
    return [
        StepReport(step, {key: values() for key in reads} if rng.random() < 0.9 else {})
        for step in range(1, steps + 1)
    ]


__all__ = [
    "CONTROLLERS",
    "Adjustments",
    "Rollback",
    "Controller",
    "ControllerCheckError",
    "ControllerSpec",
    "Controllers",
    "StepReport",
    "check_controller",
    "controller_spec",
    "merge",
]
