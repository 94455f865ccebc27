"""`Policy`: a scripted policy, the type of every env's `strategies` (expert, random, ...).

Scripted policies make an environment testable without a model: `check_env` requires the
expert to solve every sampled task and the random policy to run without exceptions, and the
expert's transcripts are what a tiny model is warm-started on.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

from steprl.types import Task


class Policy(Protocol):
    """Next action text from the task and the (action, observation) pairs so far.

    Must be a pure function of its arguments (all randomness from `rng`), so a transcript
    can be replayed exactly.
    """

    def __call__(self, task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str: ...
