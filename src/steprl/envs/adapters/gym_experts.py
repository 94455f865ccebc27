"""Scripted policies for Gymnasium envs: a shortest-path expert, the replaying bridge, a random policy.

`shortest_path_expert` solves tabular envs from their transition table; `ReplayExpert` turns
any expert on raw observations into a text `Policy`; `random_policy_for` samples the action
space. They act on a `GymnasiumEnv` through the small `ScriptableEnv` protocol (declared here,
so that `gymnasium_env.py` imports this module and not the reverse); none of them imports
Gymnasium itself.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from steprl.envs.base import Observation, Transition
from steprl.envs.policy import Policy
from steprl.types import Task

if TYPE_CHECKING:
    from gymnasium import spaces

#: Raw observation -> the env action an expert takes there.
ExpertFn = Callable[[Any], Any]

_JUNK = "0123456789 <>/answr{}-_:abcdefghijklmnopqrstuvwxyz"


class ScriptableEnv(Protocol):
    """What the scripted policies use of a `GymnasiumEnv`."""

    @property
    def action_space(self) -> spaces.Space[Any]: ...

    @property
    def action_tag(self) -> str: ...

    @property
    def raw_obs(self) -> Any: ...

    def format_action(self, action: Any) -> str: ...

    def reset(self, task: Task, seed: int) -> Observation: ...

    def step(self, action: str) -> Transition: ...


def shortest_path_expert(
    transitions: Mapping[int, Mapping[int, Sequence[tuple[float, int, float, bool]]]],
    is_goal: Callable[[float, bool], bool] = lambda reward, terminated: terminated and reward > 0,
) -> ExpertFn:
    """An expert for tabular envs with a transition table (Gymnasium toy_text ``env.unwrapped.P``).

    ``P[s][a] = [(prob, next_state, reward, terminated), ...]``; the expert follows the most
    likely outcome of each action along a shortest path (BFS) to a transition that
    `is_goal(reward, terminated)`, avoiding other terminal transitions.
    """
    cache: dict[int, int] = {}

    def first_move(state: int) -> int:
        start = int(state)
        if start in cache:
            return cache[start]
        seen = {start}
        queue: deque[tuple[int, int | None]] = deque([(start, None)])
        while queue:
            s, first = queue.popleft()
            for a, outcomes in sorted(transitions[s].items()):
                _, nxt, reward, terminated = max(outcomes, key=lambda o: o[0])
                move = a if first is None else first
                if is_goal(float(reward), bool(terminated)):
                    cache[start] = int(move)
                    return int(move)
                if not terminated and int(nxt) not in seen:
                    seen.add(int(nxt))
                    queue.append((int(nxt), move))
        raise ValueError(f"no path to a goal from state {start}; check is_goal.")

    return first_move


class ReplayExpert:
    """A `Policy` from an `ExpertFn` on raw observations.

    Policies see text only, so the raw observation is recovered by replaying the episode's
    actions in a private env (`shadow`, not shared with any episode) reset with ``task.seed``
    (exact when the real episode used that seed, or the dynamics are deterministic). Replays
    extend incrementally.
    """

    def __init__(self, shadow: ScriptableEnv, expert: ExpertFn) -> None:
        self.shadow, self.expert = shadow, expert
        self._task: Task | None = None
        self._done: list[str] = []

    def __call__(self, task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
        actions = [a for a, _ in history]
        if self._task != task or actions[: len(self._done)] != self._done:
            self.shadow.reset(task, task.seed)
            self._task, self._done = task, []
        for action in actions[len(self._done) :]:
            self.shadow.step(action)
            self._done.append(action)
        move = self.expert(self.shadow.raw_obs)
        tag = self.shadow.action_tag
        return f"<{tag}>{self.shadow.format_action(move)}</{tag}>"


def random_policy_for(template: ScriptableEnv, junk_rate: float = 0.15) -> Policy:
    """Samples the action space (seeded from `rng`); a `junk_rate` share of malformed text."""
    space, tag = template.action_space, template.action_tag

    def random_policy(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
        if rng.random() < junk_rate:
            return "".join(rng.choice(_JUNK) for _ in range(rng.randint(0, 24)))
        space.seed(rng.getrandbits(32))
        return f"<{tag}>{template.format_action(space.sample())}</{tag}>"

    return random_policy
