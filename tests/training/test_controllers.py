"""Controllers (`training/controllers/`): the checker over every registered one, that it catches
a controller whose state does not come back, and which controllers a config gives a run."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from steprl.config import load_config
from steprl.training.controllers import (
    CONTROLLERS,
    Adjustments,
    ControllerCheckError,
    Controllers,
    ControllerSpec,
    StepReport,
    check_controller,
)

#: a config that every registered controller is used by (the adaptive KL one needs KL in reward)
EVERY = ["algorithm.kl_coef=0.05", "algorithm.kl_in=reward", "algorithm.kl_ctrl=adaptive"]
#: what a controller that excludes another needs on top (a horizon curriculum is one kind)
ALSO = {
    "horizon_stepwise": ["trainer.curriculum.rounds=[2,4,6]", "trainer.curriculum.stage_steps=3"],
    "horizon_gated": ["trainer.curriculum.rounds=[2,4,6]", "trainer.curriculum.horizon=gated"],
}


@pytest.mark.parametrize("name", CONTROLLERS)
def test_every_registered_controller_passes_the_checker(name):
    check_controller(name, load_config(None, EVERY + ALSO.get(name, [])))


class _Forgetful:
    """Counts steps and adjusts by the count, but its state_dict carries nothing."""

    reads: tuple[str, ...] = ("x",)

    def __init__(self) -> None:
        self.n = 0

    def current(self) -> Adjustments:
        return Adjustments(kl_coef=float(self.n))

    def observe(self, report: StepReport) -> Adjustments:
        self.n += 1
        return self.current()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


def test_the_checker_catches_a_state_that_does_not_come_back(monkeypatch):
    monkeypatch.setitem(CONTROLLERS, "forgetful", ControllerSpec(lambda cfg: _Forgetful(), lambda cfg: True))
    with pytest.raises(ControllerCheckError, match="forgetful: after load_state_dict"):
        check_controller("forgetful", load_config(None, []))


def test_a_run_has_the_guards_always_and_adaptive_kl_and_health_when_configured():
    assert list(Controllers.for_config(load_config(None, ["health=off"])).members) == [
        "nonfinite_guard",
        "failure_guard",
    ]
    both = Controllers.for_config(load_config(None, EVERY))
    assert list(both.members) == ["health", "adaptive_kl", "nonfinite_guard", "failure_guard"]
    # the start values, before any step: the KL coefficient, the health levers untouched
    assert both.current() == Adjustments(kl_coef=0.05, lr_scale=1.0, kl_scale=1.0, hold_until=0)
