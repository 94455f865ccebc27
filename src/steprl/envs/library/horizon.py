"""A corridor of k rooms (a synthetic horizon env): a task that needs exactly k turns.

Each room has two doors, left and right, each with a number, shown as ``3 7``; the agent opens
the door with the higher number, ``<answer>R</answer>`` (L or R, any case, or left / right),
and the next room is shown. A wrong door keeps it in the same room (the turn is spent), so a
perfect episode takes exactly k turns and every mistake costs one more. (Doors named by random
keys to copy were tried first: the tiny char-level model did not learn to copy them in a short
warm start.) Reaching the end of the
corridor is the only reward (1). `k` is drawn per task from ``k_min..k_max`` (task params),
and the prompt says how many rooms there are.

The env has no turn limit of its own: the agent loop's turn cap (`rollout.max_turns`, or a
horizon curriculum's, `training/controllers/horizon_*.py`) ends an episode that has not
reached the end ``truncated``, a failure (reward 0). That is the fixed-cap failure mode the
curriculum experiments (`benchmarks/steering_horizon.py`) study: under a cap below k a task
cannot be solved at all.

Strategies: `expert` opens the higher door in every room (k turns); `guess` opens a random
door (each room is passed with probability 1/2 per turn); `random` sends any text.
"""

from __future__ import annotations

import random
import string
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from steprl.envs.library.puzzles.common import PuzzleEnv, answer, check_split, split_of, task_seed
from steprl.envs.policy import Policy
from steprl.envs.spec import EnvSpec
from steprl.types import Task

ENV_NAME = "corridor"
SYSTEM_PROMPT = (
    "Walk through every room of the corridor. Each room shows the numbers on its left and right "
    "doors; open the one with the higher number: <answer>L</answer> or <answer>R</answer>."
)
_MAX_REJECTIONS = 100_000

Room = tuple[int, int]  # the numbers on the left and the right door
_DOORS = {"l": "L", "left": "L", "r": "R", "right": "R"}


def render_room(room: Room) -> str:
    return f"{room[0]} {room[1]}"


def render_prompt(rooms: Sequence[Room]) -> str:
    return f"{len(rooms)} rooms\n{render_room(rooms[0])}"


def right_key(room: Room) -> str:
    return "L" if room[0] > room[1] else "R"


class CorridorEnv(PuzzleEnv):
    """The corridor as an `Env`; the rooms come from ``Task.params["rooms"]``.

    Args:
        max_invalid_actions, format_penalty: see `PuzzleEnv`.
    """

    name = ENV_NAME
    tool_name = "open"
    move_hint = "answer L or R"
    unknown_move = "no such door"
    system_prompt = SYSTEM_PROMPT

    def __init__(self, *, max_invalid_actions: int = 3, format_penalty: float = -0.1) -> None:
        super().__init__(
            max_steps=None, max_invalid_actions=max_invalid_actions, format_penalty=format_penalty
        )
        self.rooms: list[Room] = []
        self.at = 0  # the room the agent is in

    def _load(self, task: Task, seed: int) -> None:
        self.rooms = [(int(x), int(y)) for x, y in task.params["rooms"]]
        if not self.rooms:
            raise ValueError(f"corridor task {task.id!r} has no rooms.")
        self.at = 0

    def _render(self) -> str:
        return render_room(self.rooms[self.at])

    def _parse(self, text: str) -> str | None:
        return _DOORS.get(text.strip().lower())

    def _apply(self, move: str) -> tuple[float, bool, dict[str, Any]]:
        right = move == right_key(self.rooms[self.at])
        self.at += right
        done = self.at == len(self.rooms)
        return float(done), done, {"door": move, "right_door": right, "room": self.at}


# --- tasks ----------------------------------------------------------------------------------


def make_tasks(
    split: str, seed: int, n: int | None = None, *, k_min: int = 1, k_max: int = 6
) -> Iterator[Task]:
    """`n` corridors of `split` (infinitely many when None), the same ones for the same seed.

    Each has k rooms, k uniform in ``k_min..k_max``; a room's two numbers are distinct digits.
    The split is decided by the hash of the prompt (the room count and the first room), so a
    first room may recur in both splits with other rooms after it. ``Task.params``: ``rooms`` (a
    tuple of (left, right) numbers), ``k``; ``Task.answer``: the last room's door (L or R).
    """
    check_split(split, n)
    if not 1 <= k_min <= k_max <= 20:
        raise ValueError(f"need 1 <= k_min <= k_max <= 20, got k_min={k_min}, k_max={k_max}.")
    return _stream(split, seed, n, k_min, k_max)


def _stream(split: str, seed: int, n: int | None, k_min: int, k_max: int) -> Iterator[Task]:
    rng = random.Random(seed)
    index = rejected = 0
    while n is None or index < n:
        k = rng.randint(k_min, k_max)
        rooms = tuple(_room(rng) for _ in range(k))
        prompt = render_prompt(rooms)
        if split_of(prompt) != split:
            rejected += 1
            if rejected > _MAX_REJECTIONS:
                raise RuntimeError(f"no {split!r} corridor in {_MAX_REJECTIONS} draws.")
            continue
        rejected = 0
        yield Task(
            id=f"{ENV_NAME}-{split}-{seed}-{index}",
            prompt=prompt,
            env=ENV_NAME,
            seed=task_seed(seed, index),
            answer=right_key(rooms[-1]),
            params={"rooms": rooms, "k": k},
        )
        index += 1


def _room(rng: random.Random) -> Room:
    x, y = rng.sample(range(10), 2)
    return (x, y)


# --- scripted policies ----------------------------------------------------------------------


def _current(task: Task, history: Sequence[tuple[str, str]]) -> Room:
    """The room the agent is in, read from the last room shown (as a model reads it)."""
    shown = [task.prompt.split("\n")[-1]] + [obs.strip("\n") for _, obs in history]
    for text in reversed(shown):
        parts = text.split()
        if len(parts) == 2 and all(p.isdigit() for p in parts):
            return (int(parts[0]), int(parts[1]))
    raise ValueError(f"no room shown in task {task.id!r}")


def expert(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """Open the door with the higher number: k turns."""
    return answer(right_key(_current(task, history)))


def guess(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """Open either door at random."""
    return answer(rng.choice("LR"))


def random_policy(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """Doors in every spelling, numbers, unknown words and malformed text."""
    room = _current(task, history)
    options = (
        lambda: answer(rng.choice(["L", "r", " left ", "RIGHT"])),
        lambda: answer(str(room[1])),
        lambda: answer("".join(rng.choices(string.ascii_lowercase, k=2))),
        lambda: "R",
        lambda: "<answer>L",
        lambda: "".join(rng.choice("abcdefgh <>/0123") for _ in range(rng.randint(0, 10))),
    )
    return rng.choice(options)()


STRATEGIES: Mapping[str, Policy] = {"expert": expert, "guess": guess, "random": random_policy}

SPEC = EnvSpec(
    name=ENV_NAME,
    factory=CorridorEnv,
    tasks=make_tasks,
    strategies=STRATEGIES,
    max_turns=6,  # the expert needs k turns: k_max (6) by default
    description="a corridor of k rooms: exactly k turns to solve, k per task (horizon curricula)",
)

__all__ = ["SPEC", "STRATEGIES", "CorridorEnv", "make_tasks"]
