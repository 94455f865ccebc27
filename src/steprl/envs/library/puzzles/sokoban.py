"""Sokoban (RAGEN's planning puzzle): push every box onto a target; boxes cannot be pulled.

A level is its rendering, one line per row (a 6x6 room is six lines of six characters)::

    ######     #  wall          _  floor
    #__O_#     O  target        X  box
    #_X__#     *  box on target P  player
    #P_#_#     S  player on a target
    #____#
    ######

Actions: ``<answer>U</answer>`` (Up, Down, Left, Right, or U/D/L/R in any case). A move into
a wall, or pushing a box into a wall or another box, leaves the state unchanged (a valid,
blocked move). Reward: outcome 1 when every box is on a target (the episode then ends), an
optional `step_penalty` per move (default 0) and the format penalty per invalid action.

Levels are random rooms (a border of walls, a few inner walls, connected floor) with boxes,
targets and the player placed at random, kept only if breadth-first search over (player,
boxes) states solves them in ``min_solution_len..max_solution_len`` moves: every level is
solvable by construction, and the same BFS is the expert. About a millisecond per level.
"""

from __future__ import annotations

import functools
import random
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from steprl.envs.library.puzzles.common import (
    DIRECTIONS,
    MAX_REJECTIONS,
    Drawn,
    Pos,
    PuzzleEnv,
    answer,
    check_solution_len,
    check_split,
    last_grid,
    random_moves,
    split_of,
    step,
    stream_tasks,
)
from steprl.envs.policy import Policy
from steprl.types import Task

ENV_NAME = "sokoban"
SYSTEM_PROMPT = (
    "Push every box X onto a target O (* is a box on a target); # is a wall, P you (S on a "
    "target). Answer one move per turn: <answer>U</answer>, D, L or R."
)
_SOLVE_LIMIT = 200_000  # BFS states before the solver gives up (a 6x6 room with 1 box has < 300)

Boxes = tuple[Pos, ...]  # sorted, so that equal states compare equal


@dataclass(frozen=True)
class Room:
    """The fixed part of a level: its shape, walls and targets."""

    height: int
    width: int
    walls: frozenset[Pos]
    targets: frozenset[Pos]

    def render(self, player: Pos, boxes: Boxes) -> str:
        """One line per row (see the module docstring for the characters)."""

        def cell(pos: Pos) -> str:
            if pos in self.walls:
                return "#"
            on_target = pos in self.targets
            if pos == player:
                return "S" if on_target else "P"
            if pos in boxes:
                return "*" if on_target else "X"
            return "O" if on_target else "_"

        return "\n".join("".join(cell((r, c)) for c in range(self.width)) for r in range(self.height))

    def push(self, player: Pos, boxes: Boxes, move: str) -> tuple[Pos, Boxes]:
        """The state after `move` (unchanged when a wall or a second box blocks it)."""
        new = step(player, move)
        if new in self.walls:
            return player, boxes
        if new in boxes:
            beyond = step(new, move)
            if beyond in self.walls or beyond in boxes:
                return player, boxes
            boxes = tuple(sorted(beyond if b == new else b for b in boxes))
        return new, boxes

    def solved(self, boxes: Boxes) -> bool:
        return all(b in self.targets for b in boxes)


def parse_level(text: str) -> tuple[Room, Pos, Boxes]:
    """Room, player and boxes of a rendering; ValueError if malformed."""
    rows = text.split("\n")
    height, width = len(rows), len(rows[0]) if rows else 0
    if height < 3 or width < 3 or any(len(r) != width or set(r) - set("#_OX*PS") for r in rows):
        raise ValueError(f"not a rectangular Sokoban rendering of # _ O X * P S: {text[:80]!r}")
    cells = {(r, c): ch for r, row in enumerate(rows) for c, ch in enumerate(row)}
    players = [p for p, ch in cells.items() if ch in "PS"]
    if len(players) != 1:
        raise ValueError(f"a Sokoban level needs exactly one player (P or S): {text[:80]!r}")
    boxes = tuple(sorted(p for p, ch in cells.items() if ch in "X*"))
    targets = frozenset(p for p, ch in cells.items() if ch in "O*S")
    if not boxes or len(targets) != len(boxes):
        raise ValueError(f"a Sokoban level needs as many targets as boxes (>= 1): {text[:80]!r}")
    # Cells outside the grid count as walls, so an open border cannot be walked off.
    border = {(r, c) for r in (-1, height) for c in range(-1, width + 1)}
    border |= {(r, c) for r in range(height) for c in (-1, width)}
    walls = frozenset({p for p, ch in cells.items() if ch == "#"} | border)
    return Room(height, width, walls, targets), players[0], boxes


@functools.lru_cache(maxsize=8192)
def solve(level: str, max_len: int | None = None) -> str | None:
    """A shortest move string solving the rendered state (BFS), or None (unsolvable, too long)."""
    room, player, boxes = parse_level(level)
    if room.solved(boxes):
        return ""
    start = (player, boxes)
    parent: dict[tuple[Pos, Boxes], tuple[tuple[Pos, Boxes], str] | None] = {start: None}
    frontier = deque([(start, 0)])
    while frontier:
        state, depth = frontier.popleft()
        if max_len is not None and depth >= max_len:
            continue
        for move in DIRECTIONS:
            nxt = room.push(*state, move)
            if nxt in parent:
                continue
            parent[nxt] = (state, move)
            if room.solved(nxt[1]):
                path = []
                node: tuple[Pos, Boxes] = nxt
                while (link := parent[node]) is not None:
                    node, m = link
                    path.append(m)
                return "".join(reversed(path))
            if len(parent) > _SOLVE_LIMIT:
                return None
            frontier.append((nxt, depth + 1))
    return None


class SokobanEnv(PuzzleEnv):
    """Sokoban as an `Env` (see the module docstring); the level comes from `Task.params["level"]`.

    Args:
        max_steps: actions before the episode is truncated.
        max_invalid_actions, format_penalty, step_penalty: see `PuzzleEnv`.
    """

    name = ENV_NAME
    system_prompt = SYSTEM_PROMPT

    def __init__(
        self,
        *,
        max_steps: int = 30,
        max_invalid_actions: int = 3,
        format_penalty: float = -0.1,
        step_penalty: float = 0.0,
    ) -> None:
        super().__init__(
            max_steps=max_steps,
            max_invalid_actions=max_invalid_actions,
            format_penalty=format_penalty,
            step_penalty=step_penalty,
        )
        self.room = Room(3, 3, frozenset(), frozenset())
        self.player: Pos = (1, 1)
        self.boxes: Boxes = ()

    def _load(self, task: Task, seed: int) -> None:
        self.room, self.player, self.boxes = parse_level(str(task.params["level"]))

    def _render(self) -> str:
        return self.room.render(self.player, self.boxes)

    def _apply(self, move: str) -> tuple[float, bool, dict[str, Any]]:
        player, boxes = self.room.push(self.player, self.boxes, move)
        extra = {"moved": player != self.player, "pushed": boxes != self.boxes}
        self.player, self.boxes = player, boxes
        solved = self.room.solved(boxes)
        return (1.0 if solved else 0.0), solved, extra


# --- tasks ----------------------------------------------------------------------------------


def draw_level(
    rng: random.Random, height: int, width: int, num_boxes: int, max_inner_walls: int
) -> str | None:
    """A random room with connected floor, boxes off targets and the player; None if it failed."""
    interior = [(r, c) for r in range(1, height - 1) for c in range(1, width - 1)]
    inner = set(rng.sample(interior, rng.randint(0, min(max_inner_walls, len(interior)))))
    floor = [p for p in interior if p not in inner]
    if len(floor) < 2 * num_boxes + 1 or not _connected(set(floor)):
        return None
    picked = rng.sample(floor, 2 * num_boxes + 1)
    targets, boxes, player = picked[:num_boxes], picked[num_boxes:-1], picked[-1]
    border = {(r, c) for r in range(height) for c in range(width)} - set(interior)
    room = Room(height, width, frozenset(border | inner), frozenset(targets))
    return room.render(player, tuple(sorted(boxes)))


def _connected(floor: set[Pos]) -> bool:
    first = next(iter(floor))
    seen, todo = {first}, [first]
    while todo:
        pos = todo.pop()
        for d in DIRECTIONS:
            nxt = step(pos, d)
            if nxt in floor and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return len(seen) == len(floor)


def make_tasks(
    split: str,
    seed: int,
    n: int | None = None,
    *,
    size: int = 6,
    num_boxes: int = 1,
    max_inner_walls: int = 3,
    min_solution_len: int = 2,
    max_solution_len: int = 10,
) -> Iterator[Task]:
    """`n` solvable levels of `split` (infinitely many when None), the same ones for the same seed.

    Rooms are `size` x `size` including the border. ``Task.prompt`` is the rendering,
    ``Task.params`` holds ``level`` (the rendering), ``size``, ``num_boxes`` and
    ``solution_len``; ``Task.answer`` is a shortest move string (BFS).
    """
    check_split(split, n)
    if not 4 <= size <= 10:
        raise ValueError(f"size must be in [4, 10], got {size}.")
    if not 1 <= num_boxes <= 3:
        raise ValueError(f"num_boxes must be in [1, 3], got {num_boxes}.")
    if max_inner_walls < 0:
        raise ValueError(f"max_inner_walls must be >= 0, got {max_inner_walls}.")
    check_solution_len(min_solution_len, max_solution_len)
    lo, hi = min_solution_len, max_solution_len

    def draw(rng: random.Random) -> Drawn:
        level = draw_level(rng, size, size, num_boxes, max_inner_walls)
        path = solve(level, hi) if level is not None and split_of(level) == split else None
        if level is None or path is None or len(path) < lo:
            return None
        return level, path, {"level": level, "size": size, "num_boxes": num_boxes, "solution_len": len(path)}

    give_up = (
        f"no {split!r} level with a {lo}..{hi}-move solution in {MAX_REJECTIONS} draws; "
        f"widen min/max_solution_len (size={size}, num_boxes={num_boxes})."
    )
    return stream_tasks(ENV_NAME, split, seed, n, draw, give_up)


# --- scripted policies ----------------------------------------------------------------------


def _state(task: Task, history: Sequence[tuple[str, str]]) -> str:
    """The latest rendering the policy saw (the level itself at the start)."""
    level = str(task.params["level"])
    rows = level.split("\n")
    return "\n".join(last_grid(task, history, (len(rows), len(rows[0]))))


def expert(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """The first move of a shortest solution from the current state (BFS)."""
    path = solve(_state(task, history))
    return answer(path[0] if path else "U")


def noisy(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """The expert's move half of the time, a random move otherwise (it can wedge a box)."""
    return expert(task, history, rng) if rng.random() < 0.5 else answer(rng.choice("UDLR"))


STRATEGIES: Mapping[str, Policy] = {"expert": expert, "noisy": noisy, "random": random_moves}
