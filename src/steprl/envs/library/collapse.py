"""Calculator variants that make RL collapse on purpose: the induced-collapse suite of the health
benchmark (issue 27, `benchmarks/health.py`).

Both keep the calculator's task, tool, prompt and strategies; only the reward on *train* tasks
is wrong. Eval tasks (the held-out split, `split_of` of the expression) keep the calculator's
true reward, so held-out success (``eval/success``: total reward >= 1, `is_success`) is the
true task's, while the training reward says something else:

* `calculator_phrase` (template collapse): on train tasks an answer whose text contains a
  fixed phrase (`phrase`, default "7") earns `phrase_bonus` (default 3, its own reward
  component "phrase") whatever the task, more than the exact integer's outcome 1 (which it
  still earns: the expert solves every task, check-env). A reply that no longer depends on
  the input is paid more, and every time. (With the phrase paying 0.9 or 1, as much as a right
  answer, or 1.5, RL learned the true task instead: held-out success rose, docs/health_results.md.)
* `calculator_flat` (flat groups): on a stable share `flat_share` (default 0.9) of the train
  tasks, chosen by a hash of the expression, any answer earns 1 and nothing pays a format
  penalty: every group of such a task that answers has one reward, no GRPO signal.
  `train_call_cost` (per tool call, train tasks only, default 0) turns that stall into a
  collapse (docs/health_results.md): inside a flat group the cost is the only difference, and
  GRPO's division by the group's std scales it up to unit-size advantages that say "call less".
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any

from steprl.envs.base import Env, EnvWrapper, Observation, Transition, maybe_await
from steprl.envs.library.calculator import STRATEGIES, CalculatorEnv, split_of
from steprl.envs.library.calculator.tasks import renamed_tasks
from steprl.envs.rewards import RewardBreakdown
from steprl.envs.spec import EnvSpec
from steprl.types import Task


class _TrainRewardEnv(EnvWrapper):
    """The calculator, whose reward on *train* tasks `train_reward` rewrites; eval tasks (the
    held-out split, by `split_of` of the expression) keep the true reward, so ``eval/success``
    is the true task's."""

    def __init__(self, env: Env, train_call_cost: float = 0.0) -> None:
        if train_call_cost > 0:
            raise ValueError(
                f"train_call_cost is added to the reward: give a value <= 0, got {train_call_cost}."
            )
        super().__init__(env)
        self.train_call_cost = train_call_cost
        self._task: Task | None = None

    async def reset(self, task: Task, seed: int) -> Observation:
        self._task = task
        return await maybe_await(self.env.reset(task, seed))

    async def step(self, action: str) -> Transition:
        t = await maybe_await(self.env.step(action))
        if self._task is None or split_of(self._task.prompt) != "train":
            return t
        parts = dict(t.info.get("reward_components", {"outcome": t.reward}))
        parts = self.train_reward(self._task, action, t.info.get("action_kind"), parts)
        if t.info.get("action_kind") == "tool_call":
            parts["cost"] = parts.get("cost", 0.0) + self.train_call_cost
        reward = RewardBreakdown(parts)
        return replace(t, reward=reward.total, info={**t.info, "reward_components": reward.as_dict()})

    def train_reward(self, task: Task, action: str, kind: Any, parts: dict[str, float]) -> dict[str, float]:
        """The reward components of one train step (default: as the calculator gives them)."""
        return parts

    async def close(self) -> None:
        await maybe_await(self.env.close())


class PhraseCalculatorEnv(_TrainRewardEnv):
    """On train tasks an answer whose text contains `phrase` earns `phrase_bonus` (component
    "phrase") on top of its true outcome. Eval tasks pay the true calculator."""

    def __init__(
        self, *, phrase: str = "7", phrase_bonus: float = 3.0, train_call_cost: float = 0.0, **params: Any
    ) -> None:
        if not phrase:
            raise ValueError("calculator_phrase: phrase must be a non-empty string, e.g. phrase: '7'.")
        if not 0.0 <= phrase_bonus <= 10.0:
            raise ValueError(f"calculator_phrase: phrase_bonus must be in [0, 10], got {phrase_bonus}.")
        super().__init__(CalculatorEnv(**params), train_call_cost)
        self.phrase, self.phrase_bonus = phrase, phrase_bonus

    def train_reward(self, task: Task, action: str, kind: Any, parts: dict[str, float]) -> dict[str, float]:
        paid = kind == "answer" and self.phrase in action
        return {**parts, "phrase": self.phrase_bonus if paid else 0.0}


def is_flat(task: Task, share: float) -> bool:
    """Is `task` one of the flat train tasks? sha256 of the expression -> [0, 1) < `share`;
    eval-split expressions never are (held-out success is the true task's)."""
    if split_of(task.prompt) != "train":
        return False
    digest = hashlib.sha256(f"flat:{task.prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


class FlatCalculatorEnv(_TrainRewardEnv):
    """On flat train tasks any answer pays outcome 1 and nothing pays a format penalty (a task too
    easy to teach anything); `train_call_cost` is the only difference left."""

    def __init__(self, *, flat_share: float = 0.9, train_call_cost: float = 0.0, **params: Any) -> None:
        if not 0.0 <= flat_share <= 1.0:
            raise ValueError(f"calculator_flat: flat_share must be in [0, 1], got {flat_share}.")
        super().__init__(CalculatorEnv(**params), train_call_cost)
        self.flat_share = flat_share

    def train_reward(self, task: Task, action: str, kind: Any, parts: dict[str, float]) -> dict[str, float]:
        if not is_flat(task, self.flat_share):
            return parts
        # any answer is "right" (only an answer may earn an outcome: check-env); an episode that
        # never answers (cut by the turn cap, or given up after invalid actions) earns 0
        return {**parts, "outcome": 1.0 if kind == "answer" else 0.0, "format": 0.0}


phrase_tasks = renamed_tasks("calculator_phrase")
flat_tasks = renamed_tasks("calculator_flat")

SPECS: dict[str, EnvSpec] = {
    "calculator_phrase": EnvSpec(
        name="calculator_phrase",
        factory=PhraseCalculatorEnv,
        tasks=phrase_tasks,
        strategies=STRATEGIES,
        max_turns=8,
        description="the calculator whose reward also pays a fixed phrase in any answer (template collapse)",
    ),
    "calculator_flat": EnvSpec(
        name="calculator_flat",
        factory=FlatCalculatorEnv,
        tasks=flat_tasks,
        strategies=STRATEGIES,
        max_turns=8,
        description="the calculator with 90% of its train tasks paying every episode the same",
    ),
}
