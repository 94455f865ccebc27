"""`EnvSpec`: how to build an environment, its tasks and its scripted policies.

Kept apart from the registry so that environment packages can describe themselves without
importing the registry (which imports them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from steprl.envs.base import Env
from steprl.envs.policy import Policy
from steprl.types import Task

#: (split, seed, **task_params) -> tasks of split "train" | "eval" (may be infinite).
TaskFactory = Callable[..., Iterator[Task]]


@dataclass(frozen=True)
class EnvSpec:
    """How to build an environment, its tasks, and its scripted policies.

    `factory(**env_params)` builds one env instance (one episode at a time).
    `tasks(split, seed, **task_params)` yields tasks (possibly forever), a pure function of its arguments,
    with disjoint "train" and "eval" splits. `strategies` must include "expert" (solves every
    task within `max_turns` steps) and "random" (must never crash the env).
    """

    name: str
    factory: Callable[..., Env]
    tasks: TaskFactory
    strategies: Mapping[str, Policy]
    max_turns: int = 8
    description: str = ""

    def __post_init__(self) -> None:
        missing = {"expert", "random"} - set(self.strategies)
        if missing:
            raise ValueError(
                f"EnvSpec {self.name!r} lacks strategies {sorted(missing)}; add an 'expert' policy that "
                "solves every task and a 'random' one that sends malformed actions."
            )
        if self.max_turns < 1:
            raise ValueError(f"EnvSpec {self.name!r}: max_turns must be >= 1, got {self.max_turns}.")
        object.__setattr__(self, "strategies", MappingProxyType(dict(self.strategies)))
