"""A horizon curriculum on step count alone (AgentGym-RL's ScalingInter-RL,
`StepRoundsScheduler`): the turn cap of the tasks admitted for step s is
rounds[min((s - 1) // stage_steps, len(rounds) - 1)]. Used when `trainer.curriculum.horizon`
is `stepwise`. The cap is fixed when a task is admitted (`training/loop/pipeline.py`), so a group
admitted ahead (asynchronous training) keeps the cap it ran under."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from steprl.config import Config
from steprl.training.controllers.base import Adjustments, StepReport


class HorizonStepwise:
    reads: tuple[str, ...] = ()  # the step number only

    def __init__(self, rounds: Sequence[int], stage_steps: int) -> None:
        self.rounds, self.stage_steps = tuple(rounds), stage_steps
        self.done = 0  # the last finished step
        self.held = 0  # steps a health rule held the curriculum (they do not count)

    @staticmethod
    def from_config(cfg: Config) -> HorizonStepwise:
        cur = cfg.trainer.curriculum
        assert cur is not None  # `used` checks it
        return HorizonStepwise(cur.rounds, cur.stage_steps)

    def current(self) -> Adjustments:
        stage = min((self.done - self.held) // self.stage_steps, len(self.rounds) - 1)
        return Adjustments(max_turns=self.rounds[stage])

    def observe(self, report: StepReport) -> Adjustments:
        self.done = report.step
        self.held += report.hold_curriculum
        return self.current()

    def state_dict(self) -> dict[str, Any]:
        return {"done": self.done, "held": self.held}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.done = int(state["done"])
        self.held = int(state.get("held", 0))


__all__ = ["HorizonStepwise"]
