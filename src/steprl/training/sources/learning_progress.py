"""`learning_progress`: a mixture whose env weights follow each env's recent change in success.

Each position's env is drawn as `mixture` draws it (from `random.Random(f"{seed}-{p}")`), but
by weights that move: an env whose success is changing (up or down) is drawn more, one that has
stopped changing (mastered, or hopeless for now) less. Per env, two exponential moving averages
of the group success rate (the share of a trained group's episodes that succeeded, from
`observe`), a fast one and a slow one; the env's progress is |fast - slow|. The weights:

    w_e = floor * base_e + (1 - floor) * progress_e / sum(progress)

where base_e is the env's configured weight over their sum. So every env keeps at least `floor`
of its configured share (an env that has stopped moving is still seen, and can be noticed when
it moves again), and until any progress is measured the weights are the configured ones (with
floor = 1 this is `mixture`, position for position).

Both averages start at an env's first observed group, so progress starts at 0, not at the first
success rate. Rates are per observed group of that env (the pipeline observes every trained
group, in stream order), not per RL step.

State: `mixture`'s, plus each env's two averages and groups seen; a resume restores the weights
exactly. Synchronous runs are deterministic; with `rollout.max_staleness` > 0, which tasks are
drawn before which groups are observed depends on timing (as evictions do).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from steprl.diagnostics.metrics import is_success
from steprl.training.sources.mixture import MixtureSource
from steprl.training.sources.splits import TaskSplits
from steprl.types import Group, Task


class LearningProgressSource(MixtureSource):
    """`mixture` with weights proportional to each env's |EMA_fast - EMA_slow| of success, floored."""

    def __init__(
        self,
        tasks: TaskSplits,
        seed: int = 0,
        *,
        fast_rate: float = 0.2,
        slow_rate: float = 0.05,
        floor: float = 0.2,
    ) -> None:
        if not 0 < slow_rate < fast_rate <= 1:
            raise ValueError(
                f"learning_progress: need 0 < slow_rate < fast_rate <= 1, got {slow_rate}, {fast_rate}"
            )
        if not 0 < floor <= 1:
            # a floor of 0 would let an env's weight reach 0: it would never be seen again
            raise ValueError(f"learning_progress: floor must be in (0, 1], got {floor}")
        super().__init__(tasks, seed)
        self._configured = tasks  # the configured weights (base_e); self._splits carries the current
        self.fast_rate, self.slow_rate, self.floor = fast_rate, slow_rate, floor
        self.fast: dict[str, float] = {}  # env -> EMA of group success (absent: no group seen)
        self.slow: dict[str, float] = {}
        self.seen = dict.fromkeys(self._keys, 0)

    def weights(self) -> dict[str, float]:
        """The current draw weights (they sum to 1)."""
        base = self._configured.weights
        total = sum(base.values())
        progress = {k: abs(self.fast.get(k, 0.0) - self.slow.get(k, 0.0)) for k in self._keys}
        moving = sum(progress.values())
        if moving <= 0:
            return {k: base[k] / total for k in self._keys}
        return {k: self.floor * base[k] / total + (1 - self.floor) * progress[k] / moving for k in self._keys}

    def next(self) -> tuple[int, Task] | None:
        # mixture's draw reads self._splits.weights: hand it the current ones
        self._splits = dataclasses.replace(self._configured, weights=self.weights())
        return super().next()

    def observe(self, group: Group) -> None:
        key = group.task.env
        episodes = [t for t in group.trajectories if t.trainable]
        if key not in self.seen or not episodes:
            return  # an env outside the mixture (cannot happen in a run), or nothing to learn from
        rate = sum(map(is_success, episodes)) / len(episodes)
        if key not in self.fast:
            self.fast[key] = self.slow[key] = rate
        else:
            self.fast[key] += self.fast_rate * (rate - self.fast[key])
            self.slow[key] += self.slow_rate * (rate - self.slow[key])
        self.seen[key] += 1

    def metrics(self) -> dict[str, float]:
        """Logged with each step: each env's current weight and progress."""
        out = {f"source/weight/{k}": w for k, w in self.weights().items()}
        return out | {
            f"source/progress/{k}": abs(self.fast.get(k, 0.0) - self.slow.get(k, 0.0)) for k in self._keys
        }

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {
            "fast": dict(self.fast),
            "slow": dict(self.slow),
            "seen": dict(self.seen),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.fast = {str(k): float(v) for k, v in state["fast"].items()}
        self.slow = {str(k): float(v) for k, v in state["slow"].items()}
        self.seen = {str(k): int(v) for k, v in state["seen"].items()}
