"""RAGEN's multi-turn puzzles: FrozenLake, Sokoban and a k-armed bandit.

Each env speaks the same protocol (`common.py`): one ``<answer>...</answer>`` per turn, the
rendered state as the observation, ``info["anchor"]`` for GiGPO, RAGEN's -0.1 format penalty.
`SPECS` holds their `EnvSpec`s, built here and *not* registered (the registry lists built-ins).
"""

from steprl.envs.library.puzzles import bandit, frozenlake, sokoban
from steprl.envs.library.puzzles.bandit import BanditEnv
from steprl.envs.library.puzzles.common import ANSWER_SYNTAX, DIRECTIONS, STOP_STRINGS, PuzzleEnv, split_of
from steprl.envs.library.puzzles.frozenlake import FrozenLakeEnv, Lake
from steprl.envs.library.puzzles.sokoban import Room, SokobanEnv
from steprl.envs.spec import EnvSpec

SPECS: dict[str, EnvSpec] = {
    "frozenlake": EnvSpec(
        name="frozenlake",
        factory=FrozenLakeEnv,
        tasks=frozenlake.make_tasks,
        strategies=frozenlake.STRATEGIES,
        max_turns=10,
        description="RAGEN FrozenLake: walk a 4x4 lake to the goal avoiding holes (optionally slippery)",
    ),
    "sokoban": EnvSpec(
        name="sokoban",
        factory=SokobanEnv,
        tasks=sokoban.make_tasks,
        strategies=sokoban.STRATEGIES,
        max_turns=12,
        description="RAGEN Sokoban: push one box onto its target in a 6x6 room (BFS-solvable levels)",
    ),
    "bandit": EnvSpec(
        name="bandit",
        factory=BanditEnv,
        tasks=bandit.make_tasks,
        strategies=bandit.STRATEGIES,
        max_turns=4,
        description="RAGEN-style k-armed bandit: pull the arm with the best payout odds",
    ),
}

__all__ = [
    "ANSWER_SYNTAX",
    "DIRECTIONS",
    "SPECS",
    "STOP_STRINGS",
    "BanditEnv",
    "FrozenLakeEnv",
    "Lake",
    "PuzzleEnv",
    "Room",
    "SokobanEnv",
    "bandit",
    "frozenlake",
    "sokoban",
    "split_of",
]
