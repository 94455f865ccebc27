"""`echo`: the trivial environment, for measuring transports (in-process, HTTP, Ray) and for
the backend conformance suite. Its work per step is negligible, so what a benchmark measures
is the cost of getting a call to the env and back.

Protocol: the task asks to repeat a word `turns` times. Each turn the agent answers
``<say>word</say>``; the env echoes ``<heard>word</heard>`` and, after `turns` correct turns,
ends with reward 1. Anything else is an invalid action (an error observation, reward 0, and
the episode goes on until `max_invalid_actions`).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Mapping, Sequence

from steprl.envs.base import NO_TOOLS, Observation, ToolSpec, Transition
from steprl.envs.spec import EnvSpec
from steprl.types import Task

_SAY = re.compile(r"\s*<say>(.*?)</say>\s*", re.DOTALL)
_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")


class EchoEnv:
    """Echo the agent's `<say>` text; succeed after `task.params["turns"]` correct turns."""

    stop_strings = ("</say>",)
    system_prompt = "Repeat the word as <say>word</say>, once per turn, as many times as asked."
    tools: Mapping[str, ToolSpec] = NO_TOOLS  # none for a chat template: the system prompt says how to act

    def __init__(self, *, max_invalid_actions: int = 3) -> None:
        if max_invalid_actions < 1:
            raise ValueError(f"max_invalid_actions must be >= 1, got {max_invalid_actions}.")
        self.max_invalid_actions = max_invalid_actions
        self._task: Task | None = None
        self._said = 0
        self._invalid = 0

    def reset(self, task: Task, seed: int) -> Observation:
        if "turns" not in task.params or task.answer is None:
            raise ValueError(f"task {task.id!r} lacks params['turns'] or an answer; use echo's make_tasks.")
        self._task, self._said, self._invalid = task, 0, 0
        return Observation(task.prompt, {"turns": int(task.params["turns"])})

    def step(self, action: str) -> Transition:
        task = self._task
        if task is None:
            raise RuntimeError("EchoEnv.step before reset(task, seed).")
        match = _SAY.fullmatch(action)
        if match is None or match.group(1) != task.answer:
            self._invalid += 1
            done = self._invalid >= self.max_invalid_actions
            info = {
                "action_kind": "invalid",
                "error": "expected <say>the word</say>",
                "reward_components": {"outcome": 0.0},
                "policy_error": done,
            }
            return Transition("<error>expected <say>the word</say></error>", 0.0, done, info=info)
        self._said += 1
        done = self._said >= int(task.params["turns"])
        reward = 1.0 if done else 0.0
        info = {
            "action_kind": "answer" if done else "tool_call",
            "tool_call_valid": True,
            "reward_components": {"outcome": reward},
        }
        return Transition("" if done else f"<heard>{match.group(1)}</heard>", reward, done, info=info)

    def close(self) -> None:
        self._task = None


def make_tasks(split: str, seed: int, n: int | None = None, *, turns: int = 4) -> Iterator[Task]:
    """Tasks "say <word> <turns> times"; words of even index are train, odd are eval."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}.")
    if turns < 1:
        raise ValueError(f"turns must be >= 1, got {turns}.")
    words = _WORDS[0::2] if split == "train" else _WORDS[1::2]
    rng = random.Random(seed)
    index = 0
    while n is None or index < n:
        word = rng.choice(words)
        yield Task(
            f"echo-{split}-{seed}-{index}",
            f"Say {word} {turns} times.",
            "echo",
            seed=(seed * 1_000_003 + index) % 2**31,
            answer=word,
            params={"turns": turns},
        )
        index += 1


def expert(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    return f"<say>{task.answer}</say>"


def random_policy(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    return rng.choice([f"<say>{rng.choice(_WORDS)}</say>", "say it", "<say>", ""])


SPEC = EnvSpec(
    name="echo",
    factory=EchoEnv,
    tasks=make_tasks,
    strategies={"expert": expert, "random": random_policy},
    max_turns=8,
    description="trivial echo env: measures env transports (in-process, HTTP, Ray)",
)
