"""The shape `vs_peers.py` compares at, shared by every side so they train the same thing.

TRL's GRPOTrainer baseline (`../shared/reference/models-templates-async.md` section 5): a tiny
Llama (hidden 128, 4 layers, ffn 512, random init), 8 prompts x 8 samples, at most 16 sampled
tokens, single turn, one optimizer step per RL step. The task rewards the share of digits in the
completion: a randomly initialised model starts near 10/116 and can learn it in 30 steps, so the
reward curves say whether each side learns, not only how fast it steps.

`SPEC` is the same task as a steprl env (`env.name=peer_shape:SPEC`), and `MULTI_TURN_SPEC` a
5-turn calculator-like episode for comparison (b): each action is answered with a fixed-length
tool result until the fifth turn ends it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from steprl.envs.base import Observation, Transition
from steprl.envs.spec import EnvSpec
from steprl.types import Task


@dataclass(frozen=True)
class Shape:
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    ffn: int = 512
    prompts: int = 8  # distinct prompts per RL step
    samples: int = 8  # completions per prompt (the GRPO group)
    max_new_tokens: int = 16
    lr: float = 3e-3
    turns: int = 5  # comparison (b)
    observation_chars: int = 12  # comparison (b): each tool result's length in tokens


SHAPE = Shape()
PROMPTS = tuple(f"Q{i}: {a}+{b}=" for i, (a, b) in enumerate([(3, 4), (12, 9), (7, 7), (25, 17)] * 16))


def digit_share(text: str) -> float:
    """The reward of both sides: the share of the completion's characters that are digits."""
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def prompt_stream(split: str, seed: int) -> Iterator[Task]:
    """The prompts in order, forever (both sides see prompt i at the same position)."""
    index = 0
    while True:
        yield Task(f"peer-{split}-{index}", PROMPTS[index % len(PROMPTS)], "peer_shape", seed=seed + index)
        index += 1


class DigitsEnv:
    """One turn: the completion is scored by `digit_share` and the episode ends."""

    system_prompt = ""
    stop_strings: tuple[str, ...] = ()

    def reset(self, task: Task, seed: int) -> Observation:
        return Observation(task.prompt, {})

    def step(self, action: str) -> Transition:
        return Transition("", digit_share(action), True, info={"action_kind": "answer"})

    def close(self) -> None:
        pass


class ToolTurnsEnv:
    """`turns` turns; each action gets a `<result>` of fixed length; the last turn is scored."""

    system_prompt = ""
    stop_strings = ("</calc>",)

    def __init__(self, turns: int = SHAPE.turns, observation_chars: int = SHAPE.observation_chars) -> None:
        self.turns, self.chars, self._turn = turns, observation_chars, 0
        self._rng = random.Random(0)

    def reset(self, task: Task, seed: int) -> Observation:
        self._turn, self._rng = 0, random.Random(seed)
        return Observation(task.prompt, {})

    def step(self, action: str) -> Transition:
        self._turn += 1
        if self._turn >= self.turns:
            return Transition("", digit_share(action), True, info={"action_kind": "answer"})
        digits = "".join(self._rng.choice("0123456789") for _ in range(self.chars - 2))
        return Transition(f"<result>{digits}</result>", 0.0, False, info={})  # `chars` tokens

    def close(self) -> None:
        pass


class LongTailTurnsEnv(ToolTurnsEnv):
    """`ToolTurnsEnv` whose actions also stop at any of 8 common characters: from a random
    model, turn lengths are then geometric (mean about 14 tokens) with a long tail up to the
    turn budget, the shape where a batch that waits for its longest row idles most."""

    stop_strings = ("</calc>", "a", "e", "i", "o", "u", " ", "0", "1")


def _any(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    return str(rng.randint(0, 99))


SPEC = EnvSpec("peer_shape", DigitsEnv, prompt_stream, {"expert": _any, "random": _any}, max_turns=1)
LONG_TAIL_SPEC = EnvSpec(
    "peer_long_tail", LongTailTurnsEnv, prompt_stream, {"expert": _any, "random": _any}, max_turns=SHAPE.turns
)
MULTI_TURN_SPEC = EnvSpec(
    "peer_turns", ToolTurnsEnv, prompt_stream, {"expert": _any, "random": _any}, max_turns=SHAPE.turns
)
