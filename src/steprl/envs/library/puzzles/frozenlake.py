"""FrozenLake (RAGEN's grid puzzle): walk to the goal over the ice without falling in a hole.

A level is its rendering, one line per row and one character per cell (a 4x4 lake is four
lines of four characters)::

    P_O_       P  the player (on the start cell at reset)
    __O_       G  the goal: reaching it ends the episode with outcome 1
    O___       O  a hole: falling in ends the episode with outcome 0
    ___G       _  frozen ice (walkable)

Actions: ``<answer>U</answer>`` (Up, Down, Left, Right, or U/D/L/R in any case). Walking off the
lake leaves the player where it is (a valid, blocked move). With ``slippery=True`` (a task
parameter, as in Gymnasium's ``is_slippery``) the intended move happens with probability 1/3
and each perpendicular one with 1/3, drawn from a `random.Random(seed)` made at reset, so an
episode is a pure function of task, seed and actions.

Tasks are random solvable lakes: each cell is a hole with probability ``1 - p_frozen``, start
and goal are distinct random ice cells, and the shortest path (BFS) must be between
``min_solution_len`` and ``max_solution_len`` moves. A lake belongs to one split by the hash
of its rendering. The expert walks a BFS shortest path (deterministic lakes) or follows a
value-iteration policy (slippery ones); `greedy` heads for the goal ignoring holes.
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

ENV_NAME = "frozenlake"
SYSTEM_PROMPT = (
    "Walk the player P to the goal G on the frozen lake; _ is ice, O is a hole. "
    "Answer one move per turn: <answer>U</answer>, D, L or R."
)
PERPENDICULAR: Mapping[str, tuple[str, str]] = {
    "U": ("L", "R"),
    "D": ("R", "L"),
    "L": ("D", "U"),
    "R": ("U", "D"),
}
_GAMMA = 0.99  # value iteration discount for the slippery expert: prefers shorter safe routes


@dataclass(frozen=True)
class Lake:
    """A square lake: its size, holes, start and goal cells (row, column)."""

    size: int
    holes: frozenset[Pos]
    start: Pos
    goal: Pos

    @classmethod
    def parse(cls, text: str) -> Lake:
        """The lake of a rendering (see the module docstring); ValueError if malformed."""
        rows = text.split("\n")
        size = len(rows)
        if size < 2 or any(len(r) != size or set(r) - set("PGO_") for r in rows):
            raise ValueError(f"not a square lake rendering of P G O _: {text[:80]!r}")
        cells = {(r, c): ch for r, row in enumerate(rows) for c, ch in enumerate(row)}
        starts = [p for p, ch in cells.items() if ch == "P"]
        goals = [p for p, ch in cells.items() if ch == "G"]
        if len(starts) != 1 or len(goals) != 1:
            raise ValueError(f"a lake needs exactly one P and one G: {text[:80]!r}")
        holes = frozenset(p for p, ch in cells.items() if ch == "O")
        return cls(size, holes, starts[0], goals[0])

    def render(self, player: Pos) -> str:
        """One line per row: P, G, O or _ per cell (the player is drawn over its cell)."""

        def cell(pos: Pos) -> str:
            if pos == player:
                return "P"
            return "G" if pos == self.goal else "O" if pos in self.holes else "_"

        return "\n".join("".join(cell((r, c)) for c in range(self.size)) for r in range(self.size))

    def move(self, pos: Pos, direction: str) -> Pos:
        """Where `direction` takes the player from `pos` (it stays put at the edge)."""
        r, c = step(pos, direction)
        return (r, c) if 0 <= r < self.size and 0 <= c < self.size else pos


@functools.lru_cache(maxsize=4096)
def _distances(level: str) -> dict[Pos, int]:
    """Moves from each cell to the goal avoiding holes (BFS from the goal; unreachable: absent)."""
    lake = Lake.parse(level)
    dist = {lake.goal: 0}
    queue = deque([lake.goal])
    while queue:
        pos = queue.popleft()
        for d in DIRECTIONS:
            prev = lake.move(pos, d)  # moves are symmetric away from the edge
            if prev not in dist and prev not in lake.holes and prev != pos:
                dist[prev] = dist[pos] + 1
                queue.append(prev)
    return dist


def shortest_path(level: str) -> str | None:
    """A shortest move string (e.g. "RRDD") from the start to the goal, or None if there is none."""
    lake = Lake.parse(level)
    dist = _distances(level)
    if lake.start not in dist:
        return None
    pos, path = lake.start, []
    while pos != lake.goal:
        move = next(d for d in DIRECTIONS if dist.get(lake.move(pos, d), -1) == dist[pos] - 1)
        pos = lake.move(pos, move)
        path.append(move)
    return "".join(path)


@functools.lru_cache(maxsize=1024)
def slippery_policy(level: str) -> dict[Pos, str]:
    """The greedy move of each ice cell under discounted value iteration (slippery dynamics)."""
    lake = Lake.parse(level)
    cells = [(r, c) for r in range(lake.size) for c in range(lake.size)]
    index = {p: i for i, p in enumerate(cells)}
    live = [index[p] for p in cells if p not in lake.holes and p != lake.goal]
    # outcomes[i][k]: the three cells move k of DIRECTIONS may lead to from cell i (1/3 each)
    outcomes = [
        [tuple(index[lake.move(p, d)] for d in (m, *PERPENDICULAR[m])) for m in DIRECTIONS] for p in cells
    ]
    value = [0.0] * len(cells)
    value[index[lake.goal]] = 1.0
    scale = _GAMMA / 3
    for _ in range(5000):  # Gauss-Seidel sweeps; converges in a few hundred on a 4x4 lake
        delta = 0.0
        for i in live:
            best = scale * max(value[a] + value[b] + value[c] for a, b, c in outcomes[i])
            delta = max(delta, abs(best - value[i]))
            value[i] = best
        if delta < 1e-10:
            break
    moves = list(DIRECTIONS)
    policy = {}
    for i in live:
        scores = [value[a] + value[b] + value[c] for a, b, c in outcomes[i]]
        policy[cells[i]] = moves[scores.index(max(scores))]  # ties: the first in DIRECTIONS order
    return policy


class FrozenLakeEnv(PuzzleEnv):
    """FrozenLake as an `Env` (see the module docstring); the level comes from `Task.params`.

    Args:
        max_steps: actions before the episode is truncated.
        max_invalid_actions, format_penalty, step_penalty: see `PuzzleEnv`.
    """

    name = ENV_NAME
    system_prompt = SYSTEM_PROMPT

    def __init__(
        self,
        *,
        max_steps: int = 20,
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
        self.lake = Lake(2, frozenset(), (0, 0), (0, 1))
        self.pos: Pos = (0, 0)
        self.slippery = False
        self._rng = random.Random(0)

    def _load(self, task: Task, seed: int) -> None:
        self.lake = Lake.parse(str(task.params["map"]))
        self.slippery = bool(task.params.get("slippery", False))
        self.pos = self.lake.start
        self._rng = random.Random(seed)

    def _render(self) -> str:
        return self.lake.render(self.pos)

    def _apply(self, move: str) -> tuple[float, bool, dict[str, Any]]:
        actual = (move, *PERPENDICULAR[move])[self._rng.randrange(3)] if self.slippery else move
        new = self.lake.move(self.pos, actual)
        moved = new != self.pos
        self.pos = new
        extra = {"moved": moved, "direction": actual}
        if new == self.lake.goal:
            return 1.0, True, extra
        return 0.0, new in self.lake.holes, {**extra, "fell": new in self.lake.holes}


# --- tasks ----------------------------------------------------------------------------------


def draw_lake(rng: random.Random, size: int, p_frozen: float) -> str:
    """A random lake rendering (not necessarily solvable): holes w.p. 1 - p_frozen, P and G apart."""
    cells = [(r, c) for r in range(size) for c in range(size)]
    holes = {p for p in cells if rng.random() >= p_frozen}
    ice = [p for p in cells if p not in holes]
    if len(ice) < 2:
        ice = cells[:2]
        holes -= set(ice)
    start, goal = rng.sample(ice, 2)
    return Lake(size, frozenset(holes), start, goal).render(start)


def make_tasks(
    split: str,
    seed: int,
    n: int | None = None,
    *,
    size: int = 4,
    p_frozen: float = 0.8,
    slippery: bool = False,
    min_solution_len: int = 2,
    max_solution_len: int = 8,
) -> Iterator[Task]:
    """`n` solvable lakes of `split` (infinitely many when None), the same ones for the same seed.

    ``Task.prompt`` is the rendering, ``Task.params`` holds ``map`` (the rendering),
    ``slippery``, ``size`` and ``solution_len``; ``Task.answer`` is a shortest move string.
    """
    check_split(split, n)
    if not 2 <= size <= 12:
        raise ValueError(f"size must be in [2, 12], got {size}.")
    if not 0.0 < p_frozen <= 1.0:
        raise ValueError(f"p_frozen must be in (0, 1], got {p_frozen}.")
    check_solution_len(min_solution_len, max_solution_len)
    lo, hi = min_solution_len, max_solution_len

    def draw(rng: random.Random) -> Drawn:
        level = draw_lake(rng, size, p_frozen)
        path = shortest_path(level) if split_of(level) == split else None
        if path is None or not lo <= len(path) <= hi:
            return None
        return level, path, {"map": level, "slippery": slippery, "size": size, "solution_len": len(path)}

    give_up = (
        f"no {split!r} lake with a {lo}..{hi}-move solution in {MAX_REJECTIONS} draws; "
        f"widen min/max_solution_len or raise p_frozen (size={size}, p_frozen={p_frozen})."
    )
    return stream_tasks(ENV_NAME, split, seed, n, draw, give_up)


# --- scripted policies ----------------------------------------------------------------------


def _where(task: Task, history: Sequence[tuple[str, str]]) -> tuple[Lake, Pos]:
    """The task's lake and the player's cell in the latest rendering the policy saw."""
    lake = Lake.parse(str(task.params["map"]))
    rows = last_grid(task, history, (lake.size, lake.size))
    pos = next(((r, row.index("P")) for r, row in enumerate(rows) if "P" in row), lake.start)
    return lake, pos


def expert(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """A shortest safe path (BFS); on a slippery lake, the value-iteration policy."""
    level = str(task.params["map"])
    lake, pos = _where(task, history)
    if task.params.get("slippery", False):
        return answer(slippery_policy(level).get(pos, "U"))
    dist = _distances(level)
    here = dist.get(pos)
    for d in DIRECTIONS:
        if here is not None and dist.get(lake.move(pos, d), -1) == here - 1:
            return answer(d)
    return answer("U")


def greedy(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """Head for the goal by a random move that shortens the Manhattan distance, ignoring holes."""
    lake, (r, c) = _where(task, history)
    gr, gc = lake.goal
    moves = [m for m, ok in (("D", gr > r), ("U", gr < r), ("R", gc > c), ("L", gc < c)) if ok]
    return answer(rng.choice(moves or ["U"]))


STRATEGIES: Mapping[str, Policy] = {"expert": expert, "greedy": greedy, "random": random_moves}
