"""gridwalk: walk to a goal cell on a small grid; every step carries a ground-truth optimality label.

The env of issue 28 (deliverable 3) on which a step-reward model's credit is scored: each state
has a known set of optimal moves, so the AUROC of a model's step reward for "this step was
optimal" measures whether it credits the right steps.

A state is shown as two row-column digit pairs, the agent's cell and the goal's (row 0 is the
top line): ``12 30`` means the agent is at row 1, column 2 and the goal at row 3, column 0. The
first observation (the task's prompt) adds a header line with the grid's size and its walls, if
any: ``4x4`` or ``4x4 walls 01 22``. Actions are ``<answer>U</answer>`` (U, D, L or R; any case,
or Up/Down/Left/Right), the puzzles' syntax (`puzzles/common.py`). A move into a wall or off the
grid leaves the agent where it is: a valid move, and a wasted step.

An episode has a step budget of the shortest (BFS) distance plus `slack` (a task param, 2 by
default); every action counts, malformed ones too (they are error observations with the format
penalty, and more than `max_invalid_actions` of them end the episode). Reaching the goal within
the budget pays outcome 1; running out of budget ends the episode ``truncated`` with 0.

Ground-truth labels, on every `Transition.info` (valid and malformed actions alike):

* ``"optimal_actions"``: the sorted move letters that shorten the BFS distance to the goal from
  the state the action was taken in (one or two on an open grid, never empty before the goal);
* ``"step_optimal"``: whether the action taken was one of them (False for a malformed action
  and for a bump into a wall or the border, which never shortens the distance);
* ``"distance"``: the BFS distance to the goal after the step.

A step-reward model's credit is scored against ``step_optimal``. The grid is bipartite, so a
non-optimal valid move either bumps (one step wasted) or moves away (two: there and back): an
episode succeeds exactly when bumps + malformed actions + 2 x moves away <= slack, which makes
the label "this step did not waste budget", a quantity the outcome depends on and nothing else.

Strategies: `expert` takes a random optimal move (every step optimal; solves every task);
`epsilon` takes a random non-optimal move with probability 0.25 (`make_epsilon` for another
rate), so its episodes mix both labels and often still succeed within the slack; `random`
sends moves in every spelling and malformed text.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import re
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from steprl.envs.base import Observation, Transition
from steprl.envs.library.puzzles.common import (
    DIRECTIONS,
    Pos,
    PuzzleEnv,
    answer,
    check_split,
    random_moves,
    split_of,
    step,
    task_seed,
)
from steprl.envs.policy import Policy
from steprl.envs.spec import EnvSpec
from steprl.types import Task

ENV_NAME = "gridwalk"
SYSTEM_PROMPT = (
    "Walk to the goal on the grid. A state shows your cell and the goal's as row-column digits "
    "(row 0 is the top): '12 30' means you are at row 1, column 2 and the goal at row 3, column 0; "
    "walls block moves. Answer one move per turn: <answer>U</answer>, D, L or R."
)
EPSILON = 0.25  # the `epsilon` strategy's rate of non-optimal moves: both labels, often a success
_MAX_REJECTIONS = 100_000
_STATE = re.compile(r"(\d)(\d) (\d)(\d)")


@dataclass(frozen=True)
class Grid:
    """A square grid: its size, wall cells and goal cell (row, column)."""

    size: int
    walls: frozenset[Pos]
    goal: Pos

    def move(self, pos: Pos, direction: str) -> Pos:
        """Where `direction` takes the agent from `pos` (it stays put at a wall or the border)."""
        r, c = step(pos, direction)
        inside = 0 <= r < self.size and 0 <= c < self.size
        return (r, c) if inside and (r, c) not in self.walls else pos

    def distances(self) -> Mapping[Pos, int]:
        """Moves from each cell to the goal (unreachable cells and walls are absent)."""
        return _distances(self)

    def optimal_moves(self, pos: Pos) -> tuple[str, ...]:
        """The sorted move letters that shorten the distance to the goal from `pos` (none at the goal)."""
        dist = self.distances()
        here = dist.get(pos)
        if here is None:
            return ()
        return tuple(sorted(d for d in DIRECTIONS if dist.get(self.move(pos, d), here) == here - 1))


@functools.lru_cache(maxsize=4096)
def _distances(grid: Grid) -> dict[Pos, int]:
    """BFS from the goal: moves are symmetric, so the distance to the goal is the distance from it."""
    dist = {grid.goal: 0}
    queue = deque([grid.goal])
    while queue:
        pos = queue.popleft()
        for d in DIRECTIONS:
            nxt = grid.move(pos, d)
            if nxt not in dist:
                dist[nxt] = dist[pos] + 1
                queue.append(nxt)
    return dist


def render_state(pos: Pos, goal: Pos) -> str:
    return f"{pos[0]}{pos[1]} {goal[0]}{goal[1]}"


def render_prompt(grid: Grid, start: Pos) -> str:
    walls = "".join(f" {r}{c}" for r, c in sorted(grid.walls))
    header = f"{grid.size}x{grid.size}" + (f" walls{walls}" if walls else "")
    return f"{header}\n{render_state(start, grid.goal)}"


def grid_of(task: Task) -> Grid:
    """The task's grid; lists are accepted for pairs (a task that went through JSON)."""
    p = task.params
    walls = frozenset((int(r), int(c)) for r, c in p.get("walls", ()))
    return Grid(int(p["size"]), walls, (int(p["goal"][0]), int(p["goal"][1])))


class GridWalkEnv(PuzzleEnv):
    """gridwalk as an `Env` (see the module docstring); the grid comes from ``Task.params``.

    Args:
        max_invalid_actions, format_penalty, step_penalty: see `PuzzleEnv`. The step budget is
            the task's (``Task.params["budget"]``), not an env param.
    """

    name = ENV_NAME
    system_prompt = SYSTEM_PROMPT

    def __init__(
        self, *, max_invalid_actions: int = 3, format_penalty: float = -0.1, step_penalty: float = 0.0
    ) -> None:
        super().__init__(
            max_steps=None,
            max_invalid_actions=max_invalid_actions,
            format_penalty=format_penalty,
            step_penalty=step_penalty,
        )
        self.grid = Grid(2, frozenset(), (0, 1))
        self.pos: Pos = (0, 0)

    def _load(self, task: Task, seed: int) -> None:
        self.grid = grid_of(task)
        self.pos = (int(task.params["start"][0]), int(task.params["start"][1]))
        if self.pos not in self.grid.distances():
            raise ValueError(f"gridwalk task {task.id!r}: the goal cannot be reached from the start.")
        budget = int(task.params["budget"])
        if budget < 1:
            raise ValueError(f"gridwalk task {task.id!r}: budget must be >= 1, got {budget}.")
        self.max_steps = budget  # per task: the shortest distance plus the task's slack

    def reset(self, task: Task, seed: int) -> Observation:
        """The prompt (header and start state) first, so a model sees the walls; the anchor
        stays the bare state, as on every step."""
        first = super().reset(task, seed)
        return Observation(text=render_prompt(self.grid, self.pos), info=first.info)

    def _render(self) -> str:
        return render_state(self.pos, self.grid.goal)

    def _apply(self, move: str) -> tuple[float, bool, dict[str, Any]]:
        new = self.grid.move(self.pos, move)
        moved, self.pos = new != self.pos, new
        done = new == self.grid.goal
        return float(done), done, {"direction": move, "moved": moved}

    def step(self, action: str) -> Transition:
        """`PuzzleEnv.step`, with the labels of the state the action was taken in."""
        live = self._task is not None and not self._done
        optimal = self.grid.optimal_moves(self.pos) if live else ()
        t = super().step(action)  # raises before reset or after the end, as every puzzle does
        taken = t.info.get("direction") if t.info.get("action_kind") == "tool_call" else None
        labels = {
            "optimal_actions": list(optimal),
            "step_optimal": taken in optimal,
            "distance": self.grid.distances()[self.pos],
        }
        return dataclasses.replace(t, info={**t.info, **labels})


# --- tasks ----------------------------------------------------------------------------------


def make_tasks(
    split: str,
    seed: int,
    n: int | None = None,
    *,
    size: int = 4,
    walls: int = 0,
    slack: int = 2,
    min_distance: int = 2,
    max_distance: int | None = None,
) -> Iterator[Task]:
    """`n` grids of `split` (infinitely many when None), the same ones for the same seed.

    Each has `walls` wall cells, a start and a goal, all drawn at random, with the goal reachable
    in ``min_distance..max_distance`` moves (no upper bound when None). The split is decided by
    the hash of the prompt. ``Task.params``: ``size``, ``walls``, ``start``, ``goal`` (cells as
    (row, column)), ``distance``, ``budget`` (distance + slack); ``Task.answer``: a shortest
    move string, e.g. ``"DDL"``. With walls a path can outgrow the spec's turn cap (8: the
    longest open 4x4 walk plus the slack): set ``max_distance`` or raise ``rollout.max_turns``.
    """
    check_split(split, n)
    if not 2 <= size <= 10:
        raise ValueError(f"size must be in [2, 10] (a cell is two digits), got {size}.")
    if not 0 <= walls <= size * size - 2:
        raise ValueError(f"walls must be in [0, {size * size - 2}] on a {size}x{size} grid, got {walls}.")
    if slack < 0:
        raise ValueError(f"slack is the spare steps of the budget; give a value >= 0, got {slack}.")
    if min_distance < 1 or (max_distance is not None and max_distance < min_distance):
        raise ValueError(
            f"need 1 <= min_distance <= max_distance, got min_distance={min_distance}, "
            f"max_distance={max_distance}."
        )
    return _stream(split, seed, n, size, walls, slack, min_distance, max_distance)


def _stream(
    split: str, seed: int, n: int | None, size: int, walls: int, slack: int, lo: int, hi: int | None
) -> Iterator[Task]:
    rng = random.Random(seed)
    cells = [(r, c) for r in range(size) for c in range(size)]
    index = rejected = 0
    while n is None or index < n:
        drawn = rng.sample(cells, walls + 2)
        start, goal = drawn[0], drawn[1]
        grid = Grid(size, frozenset(drawn[2:]), goal)
        distance = grid.distances().get(start)
        prompt = render_prompt(grid, start)
        if (
            distance is None
            or distance < lo
            or (hi is not None and distance > hi)
            or split_of(prompt) != split
        ):
            rejected += 1
            if rejected > _MAX_REJECTIONS:
                raise RuntimeError(
                    f"no {split!r} {size}x{size} grid with {walls} walls and a goal {lo}..{hi} moves away "
                    f"in {_MAX_REJECTIONS} draws; lower min_distance or walls, or raise size."
                )
            continue
        rejected = 0
        yield Task(
            id=f"{ENV_NAME}-{split}-{seed}-{index}",
            prompt=prompt,
            env=ENV_NAME,
            seed=task_seed(seed, index),
            answer=shortest_path(grid, start),
            params={
                "size": size,
                "walls": tuple(sorted(grid.walls)),
                "start": start,
                "goal": goal,
                "distance": distance,
                "budget": distance + slack,
            },
        )
        index += 1


def shortest_path(grid: Grid, start: Pos) -> str:
    """A shortest move string from `start` to the goal (the first optimal move, alphabetically)."""
    pos, path = start, []
    while pos != grid.goal:
        move = grid.optimal_moves(pos)[0]
        pos = grid.move(pos, move)
        path.append(move)
    return "".join(path)


# --- scripted policies ----------------------------------------------------------------------


def position(task: Task, history: Sequence[tuple[str, str]]) -> Pos:
    """The agent's cell in the latest state shown (as a model reads it); errors are skipped."""
    shown = [task.prompt.split("\n")[-1]] + [obs.strip("\n") for _, obs in history]
    for text in reversed(shown):
        m = _STATE.fullmatch(text)
        if m is not None:
            return (int(m.group(1)), int(m.group(2)))
    raise ValueError(f"no state shown in task {task.id!r}")


def expert(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
    """A random optimal move: every step shortens the distance, so every task is solved."""
    return answer(rng.choice(grid_of(task).optimal_moves(position(task, history)) or ("U",)))


def make_epsilon(epsilon: float) -> Policy:
    """A policy that takes a random non-optimal move with probability `epsilon`, else an optimal one."""
    if not 0.0 <= epsilon <= 1.0:
        raise ValueError(f"epsilon is a probability; give a value in [0, 1], got {epsilon}.")

    def noisy(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
        optimal = grid_of(task).optimal_moves(position(task, history)) or ("U",)
        wrong = [d for d in sorted(DIRECTIONS) if d not in optimal]
        # a cell walled in so that every move is optimal has no wrong move to take
        pool = wrong if wrong and rng.random() < epsilon else list(optimal)
        return answer(rng.choice(pool))

    return noisy


STRATEGIES: Mapping[str, Policy] = {
    "expert": expert,
    "epsilon": make_epsilon(EPSILON),
    "random": random_moves,
}

SPEC = EnvSpec(
    name=ENV_NAME,
    factory=GridWalkEnv,
    tasks=make_tasks,
    strategies=STRATEGIES,
    max_turns=8,  # the longest budget on the default open 4x4 grid: distance 6 + slack 2
    description="walk to a goal on a 4x4 grid; every step labelled optimal or not (step-credit scoring)",
)

__all__ = ["SPEC", "STRATEGIES", "Grid", "GridWalkEnv", "make_epsilon", "make_tasks", "shortest_path"]
