"""Scripted policies for Gymnasium envs: experts, the bridges from raw observations to text, a random policy.

`shortest_path_expert` solves deterministic tabular envs from their transition table,
`max_success_expert` stochastic ones (slippery ice), `blackjack_basic_strategy` Blackjack.
`ReplayExpert` turns any expert on raw observations into a text `Policy` by replaying the
episode in a private env (`tabular_sync` keeps that replay on the real episode's path when
the dynamics are random); `DecodingExpert` reads the raw observation back from its text
instead. `random_policy_for` samples the action space; `guess_policy` mixes an expert with
legal random moves (an imperfect demonstrator for the SFT warm start). They act on a
`GymnasiumEnv` through the small `ScriptableEnv` protocol (declared here, so that
`gymnasium_env.py` imports this module and not the reverse); none of them imports Gymnasium.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from steprl.envs.base import Observation, Transition
from steprl.envs.policy import Policy
from steprl.types import Task

if TYPE_CHECKING:
    from gymnasium import spaces

#: Raw observation -> the env action an expert takes there.
ExpertFn = Callable[[Any], Any]
#: ``P[s][a] = [(prob, next_state, reward, terminated), ...]`` (Gymnasium toy_text ``env.unwrapped.P``).
TransitionTable = Mapping[int, Mapping[int, Sequence[tuple[float, int, float, bool]]]]

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

    def set_tabular_state(self, state: int, last_action: int | None = None) -> str: ...


#: (the replaying env, its state before the step, the env action, the observed text) -> None:
#: moves the replaying env to the state the real episode reached (see `tabular_sync`).
SyncFn = Callable[[ScriptableEnv, Any, Any, str], None]


def is_deterministic(transitions: TransitionTable) -> bool:
    """Every action of every state has one outcome."""
    return all(len(outcomes) == 1 for actions in transitions.values() for outcomes in actions.values())


def shortest_path_expert(
    transitions: TransitionTable,
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


def max_success_expert(
    transitions: TransitionTable,
    is_goal: Callable[[float, bool], bool] = lambda reward, terminated: terminated and reward > 0,
    gamma: float = 0.999,
) -> ExpertFn:
    """An expert for stochastic tabular envs: the action maximising the chance of reaching a goal.

    Value iteration on ``V(s) = max_a sum_o p_o * (1 if goal else 0 if terminal else gamma * V(s'))``;
    `gamma` just below 1 breaks ties towards shorter paths (so with deterministic dynamics it
    walks a shortest path) without giving up much success for speed. Ties go to the lowest action.
    """
    states = sorted(int(s) for s in transitions)
    index = {s: i for i, s in enumerate(states)}
    n_actions = max(len(actions) for actions in transitions.values())
    goal = np.zeros((len(states), n_actions))
    moves = np.zeros((len(states), n_actions, len(states)))
    for s, actions in transitions.items():
        for a, outcomes in actions.items():
            for prob, nxt, reward, terminated in outcomes:
                if is_goal(float(reward), bool(terminated)):
                    goal[index[int(s)], int(a)] += prob
                elif not terminated:
                    moves[index[int(s)], int(a), index[int(nxt)]] += prob
    values = np.zeros(len(states))
    for _ in range(100_000):
        q = goal + gamma * moves @ values
        new = q.max(axis=1)
        if np.abs(new - values).max() < 1e-12:
            break
        values = new
    # the lowest action within rounding of the best, so ties do not depend on float noise
    policy = {s: int(np.flatnonzero(q[index[s]] >= q[index[s]].max() - 1e-9)[0]) for s in states}
    if not any(v > 0 for v in values):
        raise ValueError("no state can reach a goal; check is_goal.")
    return lambda state: policy[int(state)]


def tabular_sync(transitions: TransitionTable) -> SyncFn:
    """Keeps a replay on the real episode's path when a tabular env's dynamics are random.

    The replaying env draws its own slips, so after each step its state may differ from the
    real episode's; among the outcomes of the action taken (``P[s][a]``), pick the state whose
    rendering is the text the policy saw.
    """

    def sync(shadow: ScriptableEnv, before: Any, action: Any, observed: str) -> None:
        outcomes = transitions[int(before)][int(action)]
        for _, nxt, _, _ in sorted(outcomes, key=lambda o: -o[0]):
            if shadow.set_tabular_state(int(nxt), int(action)) == observed:
                return
        raise ValueError(
            f"no outcome of action {action} in state {before} renders as the observed {observed[:60]!r}"
        )

    return sync


class ReplayExpert:
    """A `Policy` from an `ExpertFn` on raw observations.

    Policies see text only, so the raw observation is recovered by replaying the episode's
    actions in a private env (`shadow`, not shared with any episode) reset with ``task.seed``:
    exact when the real episode used that seed or the dynamics are deterministic, and, given a
    `sync` (e.g. `tabular_sync`), whenever the replay's text differs from what the policy saw.
    Replays extend incrementally.
    """

    def __init__(self, shadow: ScriptableEnv, expert: ExpertFn, sync: SyncFn | None = None) -> None:
        self.shadow, self.expert, self.sync = shadow, expert, sync
        self._task: Task | None = None
        # the (action, observation) pairs replayed so far: episodes of one task run concurrently
        # (demos, groups) and may share actions but not slips, so the observations must match too
        self._done: list[tuple[str, str]] = []

    def __call__(self, task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
        if self._task != task or [tuple(h) for h in history[: len(self._done)]] != self._done:
            self.shadow.reset(task, task.seed)
            self._task, self._done = task, []
        for action, observed in history[len(self._done) :]:
            before = self.shadow.raw_obs
            t = self.shadow.step(action)
            # an empty observation ends the real episode: no later step needs the state;
            # an invalid action ("env_action" absent) moved neither env
            if self.sync is not None and observed and t.observation != observed and "env_action" in t.info:
                self.sync(self.shadow, before, t.info["env_action"], observed)
            self._done.append((action, observed))
        move = self.expert(self.shadow.raw_obs)
        tag = self.shadow.action_tag
        return f"<{tag}>{self.shadow.format_action(move)}</{tag}>"


class DecodingExpert:
    """A `Policy` from an `ExpertFn`, reading the raw observation back from the last text seen.

    For envs whose randomness a replay cannot follow (Blackjack's cards) but whose rendering
    holds the whole observation; `decode` is the renderer's inverse.
    """

    def __init__(self, template: ScriptableEnv, expert: ExpertFn, decode: Callable[[str], Any]) -> None:
        self.template, self.expert, self.decode = template, expert, decode

    def __call__(self, task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
        text = history[-1][1] if history else task.prompt
        tag = self.template.action_tag
        return f"<{tag}>{self.template.format_action(self.expert(self.decode(text)))}</{tag}>"


def blackjack_basic_strategy(obs: Any) -> int:
    """Hit (1) or stick (0) by the basic strategy for a game with no doubling or splitting."""
    total, dealer, usable_ace = (int(v) for v in obs)
    weak_dealer = 2 <= dealer <= 6
    if usable_ace:
        stick = total >= 19 or (total == 18 and 2 <= dealer <= 8)
    else:
        stick = total >= 17 or (13 <= total <= 16 and weak_dealer) or (total == 12 and 4 <= dealer <= 6)
    return 0 if stick else 1


def guess_policy(expert: Policy, legal: Policy, expert_rate: float = 0.5) -> Policy:
    """The expert's move with probability `expert_rate`, else `legal`'s (an imperfect demonstrator)."""

    def guess(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
        return expert(task, history, rng) if rng.random() < expert_rate else legal(task, history, rng)

    return guess


def random_policy_for(template: ScriptableEnv, junk_rate: float = 0.15) -> Policy:
    """Samples the action space (seeded from `rng`); a `junk_rate` share of malformed text."""
    space, tag = template.action_space, template.action_tag

    def random_policy(task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
        if rng.random() < junk_rate:
            return "".join(rng.choice(_JUNK) for _ in range(rng.randint(0, 24)))
        space.seed(rng.getrandbits(32))
        return f"<{tag}>{template.format_action(space.sample())}</{tag}>"

    return random_policy


def success_probability(
    transitions: TransitionTable,
    expert: ExpertFn,
    start: int,
    horizon: int,
    is_goal: Callable[[float, bool], bool] = lambda reward, terminated: terminated and reward > 0,
) -> float:
    """The exact chance that `expert` reaches a goal from `start` within `horizon` steps."""
    moves: dict[int, int | None] = {}
    for state in transitions:
        try:
            moves[int(state)] = int(expert(state))
        except ValueError:  # the expert knows no way on from here (a hole, the goal itself)
            moves[int(state)] = None
    reach = dict.fromkeys(moves, 0.0)  # chance of a goal within the steps left
    for _ in range(horizon):
        reach = {
            s: 0.0
            if a is None
            else sum(
                p * (1.0 if is_goal(float(r), bool(t)) else 0.0 if t else reach[int(nxt)])
                for p, nxt, r, t in transitions[s][a]
            )
            for s, a in moves.items()
        }
    return reach[int(start)]


def best_tabular_expert(
    transitions: TransitionTable,
    starts: Sequence[int],
    horizon: int,
    is_goal: Callable[[float, bool], bool] = lambda reward, terminated: terminated and reward > 0,
) -> tuple[ExpertFn, float]:
    """The tabular expert with the best chance of a goal within `horizon` steps, and that chance
    (the mean over `starts`).

    A shortest path is best when the dynamics are deterministic; on slippery ice the
    probability-maximising policy is, but which discount suits a short horizon depends on the
    map, so a few are tried (a stationary policy cannot see the steps left).
    """
    candidates = [shortest_path_expert(transitions, is_goal)]
    if not is_deterministic(transitions):
        candidates += [max_success_expert(transitions, is_goal, g) for g in (0.8, 0.9, 0.95, 0.99, 0.999)]
    scored = []
    for expert in candidates:
        chance = sum(success_probability(transitions, expert, s, horizon, is_goal) for s in starts)
        scored.append((chance / max(1, len(starts)), expert))
    chance, expert = max(scored, key=lambda pair: pair[0])  # the first of equals: the shortest path
    return expert, chance
