"""A plugin module, as a user writes one: it registers an env whose system prompt is known only
after `reset` (as an MCP env learns its tools from the server). Used by test_plugins.py through
`--plugin`-style loading in the trainer's process, the HTTP env server and the Ray workers."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

from steprl.envs.base import Env, Observation, Transition
from steprl.envs.registry import ENVS, EnvSpec, register
from steprl.types import Task


class ToolsAtReset(Env):
    system_prompt = "no tools yet"

    def reset(self, task: Task, seed: int) -> Observation:
        self.system_prompt = f"tools for {task.id}"
        return Observation(task.prompt)

    def step(self, action: str) -> Transition:
        score = float(action.strip() == "<answer>ok</answer>")
        return Transition("", score, True, info={"reward_components": {"outcome": score}})

    def close(self) -> None:
        pass


def tasks(split: str, seed: int) -> Iterator[Task]:
    for i in range(10**6):
        yield Task(id=f"{split}-{seed}-{i}", prompt=f"say ok {split} {i}", env="tools_at_reset", seed=i)


def expert(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    return "<answer>ok</answer>"


def junk(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    return rng.choice(["", "ok", "<answer>"])


SPEC = EnvSpec("tools_at_reset", ToolsAtReset, tasks, {"expert": expert, "random": junk}, max_turns=2)
if SPEC.name not in ENVS:
    register(SPEC)
