"""`EnvSpec`: how to build an environment, its tasks and its scripted policies.

Kept apart from the registry so that environment packages can describe themselves without
importing the registry (which imports them).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from steprl.envs.base import Env
from steprl.envs.policy import Policy
from steprl.types import Task

#: (split, seed, **task_params) -> tasks of split "train" | "eval" (may be infinite).
TaskFactory = Callable[..., Iterator[Task]]


@dataclass(frozen=True)
class Harness:
    """A user's agent harness: `run(task, client) -> reward`, an async function that calls the
    policy through an OpenAI-compatible client (`client` is an `openai.AsyncOpenAI` on the
    run's gateway) and returns the episode's reward (`envs/harness.py`)."""

    run: Callable[[Task, Any], Awaitable[float]]
    path: str  # where it was imported from (module:function), for messages
    timeout_s: float  # an episode still running after this ends env_timeout


@dataclass(frozen=True)
class EnvSpec:
    """How to build an environment, its tasks, and its scripted policies.

    `factory(**env_params)` builds one env instance (one episode at a time).
    `tasks(split, seed, **task_params)` yields tasks (possibly forever), a pure function of its
    arguments, with disjoint "train" and "eval" splits. `strategies` must include "expert" and
    "random" (which must never crash the env).

    The rules `check_env` holds the env to (the defaults suit a deterministic, offline env):

    * `stochastic`: the env's own randomness (slippery ice, the dealer's cards) can change the
      outcome of the same actions, so the expert cannot always win;
    * `min_expert_success`: the share of episodes the expert must solve within `max_turns`
      (in (0, 1]); below 1, or when `stochastic`, it is measured over tasks x `expert_seeds`
      episode seeds instead of once per task;
    * `replayable`: the same task, seed and actions give the same observations and rewards;
      an env that cannot promise it (a live service, the wall clock) sets it False and says
      why in `not_replayable_because`;
    * `split_by`: how "train" and "eval" are kept disjoint: by prompt text, or ("seed") by
      disjoint task-seed ranges, for envs whose start state is fixed so that every prompt is
      the same and only the seed (the env's randomness) varies.
    """

    name: str
    factory: Callable[..., Env]
    tasks: TaskFactory
    strategies: Mapping[str, Policy]
    max_turns: int = 8
    description: str = ""
    stochastic: bool = False
    min_expert_success: float = 1.0
    expert_seeds: int = 1
    replayable: bool = True
    not_replayable_because: str = ""
    split_by: Literal["prompt", "seed"] = "prompt"
    #: set: RL and eval episodes run the harness against the gateway instead of the agent loop
    #: (the factory and strategies still serve demonstrations and check-env)
    harness: Harness | None = None

    def __post_init__(self) -> None:
        missing = {"expert", "random"} - set(self.strategies)
        if missing:
            raise ValueError(
                f"EnvSpec {self.name!r} lacks strategies {sorted(missing)}; add an 'expert' policy that "
                "solves every task and a 'random' one that sends malformed actions."
            )
        if self.max_turns < 1:
            raise ValueError(f"EnvSpec {self.name!r}: max_turns must be >= 1, got {self.max_turns}.")
        if not 0.0 < self.min_expert_success <= 1.0:
            raise ValueError(
                f"EnvSpec {self.name!r}: min_expert_success must be in (0, 1], got "
                f"{self.min_expert_success}; it is the share of episodes the expert must solve."
            )
        if self.expert_seeds < 1:
            raise ValueError(f"EnvSpec {self.name!r}: expert_seeds must be >= 1, got {self.expert_seeds}.")
        if not self.replayable and not self.not_replayable_because.strip():
            raise ValueError(
                f"EnvSpec {self.name!r}: replayable=False needs not_replayable_because, e.g. "
                "'reads the wall clock' (check_env reports it when it skips the replay check)."
            )
        if self.split_by not in ("prompt", "seed"):
            raise ValueError(
                f"EnvSpec {self.name!r}: split_by must be 'prompt' or 'seed', got {self.split_by!r}."
            )
        object.__setattr__(self, "strategies", MappingProxyType(dict(self.strategies)))
