"""What the three puzzles share: the action syntax, the step bookkeeping, splits and helpers.

Every puzzle action is one answer tag, RAGEN-style: ``<answer>L</answer>`` (``<think>``
blocks before it are skipped by `steprl.envs.parsing`). `PuzzleEnv` turns the parsed answer
into a move, prices the step and fills ``Transition.info`` the same way for every puzzle:

* a valid move has ``action_kind == "tool_call"`` (so the tool metrics count moves) and
  ``tool_call_valid=True``, even when a wall blocks it (the env accepted and executed it);
* anything else is ``"invalid"``: a short ``<error>`` observation and the format penalty
  (RAGEN's ``format_penalty: -0.1``); after more than `max_invalid_actions` of them the
  episode ends with ``info["policy_error"] = True``;
* ``info["anchor"]`` is the rendered state the action was taken in (GiGPO's anchor state).

Observations are ``"\\n" + rendering + "\\n"``, so that in the tiny model's plain format every
grid sits on its own lines and every action starts a line; they are empty once the episode
is over (terminated or truncated). Everything is ASCII (`printable`).
"""

from __future__ import annotations

import hashlib
import random
import string
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

from steprl.envs.base import NO_TOOLS, Observation, ToolSpec, Transition
from steprl.envs.parsing import ActionSyntax, FinalAnswer, InvalidAction
from steprl.envs.rewards import RewardBreakdown, RewardConfig, cost_component, format_component
from steprl.types import Task

Split = Literal["train", "eval"]

#: Only ``<answer>...</answer>``; no tools, no JSON calls. Generation stops at ``</answer>``.
ANSWER_SYNTAX = ActionSyntax(tag_tools={}, json_tools=frozenset())
STOP_STRINGS: tuple[str, ...] = ANSWER_SYNTAX.stop_strings

#: Canonical move letters and their (row, column) step; row 0 is the top line of a rendering.
DIRECTIONS: Mapping[str, tuple[int, int]] = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
_MOVE_NAMES = {"up": "U", "down": "D", "left": "L", "right": "R", "u": "U", "d": "D", "l": "L", "r": "R"}
_PRINTABLE = frozenset(string.printable) - frozenset("\x0b\x0c\r")

Pos = tuple[int, int]
#: A drawn task's (prompt, answer, params), or None when the draw is rejected (wrong split, ...).
Drawn = tuple[str, str, dict[str, Any]] | None
MAX_REJECTIONS = 100_000  # rejected draws in a row before a task stream gives up


def parse_direction(text: str) -> str | None:
    """The move letter (U, D, L or R) of Up/Down/Left/Right or U/D/L/R, any case; else None."""
    return _MOVE_NAMES.get(text.strip().lower())


def answer(move: str) -> str:
    """The canonical action text for a move or arm name, e.g. ``<answer>L</answer>``."""
    return f"<answer>{move}</answer>"


def split_of(level: str) -> Split:
    """sha256(level text) mod 5 == 0 -> "eval", else "train": stable, so splits are disjoint."""
    digest = hashlib.sha256(level.encode("utf-8")).digest()
    return "eval" if int.from_bytes(digest[:8], "big") % 5 == 0 else "train"


def check_split(split: str, n: int | None) -> None:
    """Refuse an unknown split or a negative count (the task factories' shared checks)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}.")
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0 or None, got {n}.")


def check_solution_len(min_solution_len: int, max_solution_len: int) -> None:
    """Refuse an empty or non-positive range of solution lengths (the grid puzzles' check)."""
    if not 1 <= min_solution_len <= max_solution_len:
        raise ValueError(
            f"need 1 <= min_solution_len <= max_solution_len, got {min_solution_len}, {max_solution_len}."
        )


def task_seed(seed: int, index: int) -> int:
    """The reset seed of task `index` in the stream of `seed` (as the calculator's tasks)."""
    return (seed * 1_000_003 + index) % 2**31


def stream_tasks(
    env: str, split: str, seed: int, n: int | None, draw: Callable[[random.Random], Drawn], give_up: str
) -> Iterator[Task]:
    """`n` tasks (infinitely many when None) from `draw`, fed by one `random.Random(seed)`, so the
    same seed gives the same tasks; after `MAX_REJECTIONS` rejected draws in a row, RuntimeError
    with `give_up`. Task `index` is ``{env}-{split}-{seed}-{index}`` with `task_seed`."""
    rng = random.Random(seed)
    index = rejected = 0
    while n is None or index < n:
        drawn = draw(rng)
        if drawn is None:
            rejected += 1
            if rejected > MAX_REJECTIONS:
                raise RuntimeError(give_up)
            continue
        rejected = 0
        prompt, solution, params = drawn
        yield Task(
            id=f"{env}-{split}-{seed}-{index}",
            prompt=prompt,
            env=env,
            seed=task_seed(seed, index),
            answer=solution,
            params=params,
        )
        index += 1


def ascii_only(text: str) -> str:
    """`text` with every character outside printable ASCII replaced by '?'."""
    return "".join(c if c in _PRINTABLE else "?" for c in text)


def step(pos: Pos, move: str) -> Pos:
    """The cell one `move` away from `pos` (no bounds check)."""
    dr, dc = DIRECTIONS[move]
    return pos[0] + dr, pos[1] + dc


def last_grid(task: Task, history: Sequence[tuple[str, str]], shape: tuple[int, int]) -> list[str]:
    """The latest rendering of a `shape` (rows, cols) grid in the history, else the task's prompt.

    Scripted policies read the state from what they were shown, like a model does; error
    observations (and the empty final one) are skipped.
    """
    for _, obs in reversed(history):
        rows = obs.strip("\n").split("\n")
        if len(rows) == shape[0] and all(len(r) == shape[1] for r in rows) and "<" not in obs:
            return rows
    return task.prompt.split("\n")


_JUNK = "UDLRudlr <>/answerthink{}0123456789"


def random_moves(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """Random moves in every accepted spelling, and malformed ones (junk, bad tags, no tags)."""
    move = rng.choice("UDLR")
    name = {"U": "Up", "D": "Down", "L": "Left", "R": "Right"}[move]

    def junk() -> str:
        return "".join(rng.choice(_JUNK) for _ in range(rng.randint(0, 12)))

    options = (
        lambda: answer(move),
        lambda: answer(name),
        lambda: answer(rng.choice([name.lower(), name.upper(), f" {move.lower()} "])),
        lambda: f"<think>{junk()}</think>{answer(move)}",
        lambda: answer(junk()),
        lambda: name,
        junk,
        lambda: f"<answer>{move}",
    )
    return rng.choice(options)()


class PuzzleEnv:
    """The episode bookkeeping of a puzzle; subclasses load a task, parse and apply moves.

    Subclass hooks: `_load(task, seed)`, `_render()` (the state as text), `_parse(text)`
    (the answer body -> a move, or None), `_apply(move)` -> (outcome, terminated, extra info).

    Args:
        max_steps: actions (valid or not) before the episode is truncated; None: no limit.
        max_invalid_actions: invalid actions tolerated; one more ends the episode (policy error).
        format_penalty: added to the reward of each invalid action (<= 0).
        step_penalty: added to the reward of each valid move (<= 0; RewardConfig.tool_call_cost).
    """

    name = "puzzle"
    tool_name = "move"
    move_hint = "answer U, D, L or R"
    unknown_move = "not a move"
    system_prompt = ""
    tools: Mapping[str, ToolSpec] = NO_TOOLS  # none for a chat template: the system prompt says how to act

    def __init__(
        self,
        *,
        max_steps: int | None,
        max_invalid_actions: int = 3,
        format_penalty: float = -0.1,
        step_penalty: float = 0.0,
    ) -> None:
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or None, got {max_steps}.")
        if max_invalid_actions < 0:
            raise ValueError(f"max_invalid_actions must be >= 0, got {max_invalid_actions}.")
        if step_penalty > 0:
            raise ValueError(
                f"step_penalty is added to each move's reward; give a value <= 0, got {step_penalty}."
            )
        self.rewards = RewardConfig(format_penalty=format_penalty, tool_call_cost=step_penalty)
        self.max_steps = max_steps
        self.max_invalid_actions = max_invalid_actions
        self.stop_strings: Sequence[str] = STOP_STRINGS
        self._task: Task | None = None
        self._done = True
        self._turn = 0
        self._invalid = 0

    # --- hooks ------------------------------------------------------------------------------

    def _load(self, task: Task, seed: int) -> None:
        raise NotImplementedError

    def _render(self) -> str:
        raise NotImplementedError

    def _parse(self, text: str) -> str | None:
        return parse_direction(text)

    def _apply(self, move: str) -> tuple[float, bool, dict[str, Any]]:
        raise NotImplementedError

    def _observe(self) -> str:
        """The observation after a valid move that did not end the episode."""
        return f"\n{self._render()}\n"

    # --- the Env protocol -------------------------------------------------------------------

    def reset(self, task: Task, seed: int) -> Observation:
        """Start an episode on `task`; the first observation is the rendered start state."""
        self._load(task, seed)
        self._task, self._done, self._turn, self._invalid = task, False, 0, 0
        text = self._render()
        return Observation(text=text, info={"task_id": task.id, "seed": seed, "anchor": text})

    def step(self, action: str) -> Transition:
        """Apply one action; model mistakes become `<error>` observations, never exceptions."""
        if self._task is None or self._done:
            raise RuntimeError(
                f"{type(self).__name__}.step() called before reset() or after the episode ended; "
                "call reset(task, seed)."
            )
        self._turn += 1
        anchor = self._render()
        parsed = ANSWER_SYNTAX.parse(action)
        move = self._parse(parsed.text) if isinstance(parsed, FinalAnswer) else None
        if move is None:
            reason = parsed.reason if isinstance(parsed, InvalidAction) else self.unknown_move
            reason = "no answer tag" if reason == "no call or answer" else reason
            return self._invalid_action(ascii_only(reason)[:60], anchor)
        outcome, terminated, extra = self._apply(move)
        truncated = not terminated and self._out_of_steps()
        self._done = terminated or truncated
        rewards = RewardBreakdown(
            {
                "outcome": outcome,
                "format": format_component("tool_call", self.rewards),
                "cost": cost_component("tool_call", self.rewards),
            }
        )
        observation = "" if self._done else self._observe()
        info = self._info(rewards, "tool_call", anchor, valid=True, success=terminated and outcome >= 1.0)
        return Transition(observation, rewards.total, terminated, truncated, {**info, **extra})

    def close(self) -> None:
        """Nothing to release; safe to call any number of times."""
        self._task, self._done = None, True

    # --- helpers ----------------------------------------------------------------------------

    def _out_of_steps(self) -> bool:
        return self.max_steps is not None and self._turn >= self.max_steps

    def _invalid_action(self, reason: str, anchor: str) -> Transition:
        self._invalid += 1
        give_up = self._invalid > self.max_invalid_actions
        truncated = not give_up and self._out_of_steps()
        self._done = give_up or truncated
        rewards = RewardBreakdown(
            {
                "outcome": 0.0,
                "format": format_component("invalid", self.rewards),
                "cost": cost_component("invalid", self.rewards),
            }
        )
        observation = "" if self._done else f"\n<error>{reason}; {self.move_hint}</error>\n"
        info = self._info(rewards, "invalid", anchor, error=reason, policy_error=give_up)
        return Transition(observation, rewards.total, give_up, truncated, info)

    def _info(
        self,
        rewards: RewardBreakdown,
        kind: str,
        anchor: str,
        *,
        valid: bool | None = None,
        error: str | None = None,
        policy_error: bool = False,
        success: bool = False,
    ) -> dict[str, Any]:
        return {
            "reward_components": rewards.as_dict(),
            "action_kind": kind,
            "tool_call_valid": valid,
            "tool_name": self.tool_name if kind == "tool_call" else None,
            "error": error,
            "policy_error": policy_error,
            "turn": self._turn,
            "invalid_actions": self._invalid,
            "anchor": anchor,
            "success": success,
        }
