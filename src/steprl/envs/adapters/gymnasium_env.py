"""`GymnasiumEnv`: any Gymnasium env as a steprl text `Env`, and `make_gym_spec` for its tasks.

The policy sees the rendered observation (the env's own text observation, `render(env, obs)`,
or `render_obs(obs)`) and acts with ``<answer>k</answer>``: for a ``Discrete(n)`` action space
`k` is an integer, or one of `action_names`; ``MultiDiscrete`` takes integers ("1 2"); other
spaces need an `action_parser` (body text -> env action). The two error channels of
`base.py` stay apart:

* a model error (no tag, an unknown action, an action outside the space) is an
  ``<error>reason</error>`` observation with a format penalty, never an exception; after more
  than `max_invalid_actions` of them the episode ends with ``info["policy_error"] = True``;
* an exception from the Gymnasium env itself (or a renderer) propagates: infrastructure.

Seeding. A task *is* an initial state and a seed: `make_gym_spec` makes one task per seed, and
``reset(task, seed)`` calls ``env.reset(seed=task.seed)`` so every episode of a GRPO group
starts from the state shown in the task's prompt. When the episode `seed` differs from
``task.seed`` (as in `rollout_groups`), the env's RNG is then reseeded with `seed`, so the
stochastic dynamics (slippery ice) differ across the group, deterministically. With
``seed == task.seed`` (as in `check_env`) this is exactly ``env.reset(seed=seed)``. Splits are
kept apart by prompt (a stable hash of the rendered start state), or, for envs whose start
state is fixed (FrozenLake's map, CliffWalking), by disjoint task-seed ranges (``split_by="seed"``):
there the env's own randomness is the task variation.

Rewards: ``outcome`` is the env reward (or ``outcome(reward, terminated, truncated)``, e.g.
`solved_on_termination` for envs whose raw reward is shaping, like Taxi), ``format`` the
penalty for invalid actions, ``cost`` the turn / call costs of `RewardConfig`. A valid move is
reported as ``action_kind="tool_call"`` (an action on the environment); ``info["anchor"]`` is
the rendered state the action was taken in (the GiGPO anchor state).

This module is the adapter and its spec builder; the action codecs (text <-> action) are in
`gym_actions.py`, the scripted policies (expert, random) in `gym_experts.py`.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import islice
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from steprl.envs.adapters.gym_actions import ActionFormatter, ActionParser, action_codec, shorten
from steprl.envs.adapters.gym_experts import (
    ExpertFn,
    ReplayExpert,
    SyncFn,
    is_deterministic,
    random_policy_for,
    tabular_sync,
)
from steprl.envs.adapters.gym_render import Renderer
from steprl.envs.base import NO_TOOLS, Observation, ToolSpec, Transition
from steprl.envs.parsing import ActionKind, ActionSyntax, FinalAnswer, InvalidAction
from steprl.envs.policy import Policy
from steprl.envs.rewards import RewardBreakdown, RewardConfig, cost_component, format_component
from steprl.envs.spec import EnvSpec
from steprl.extras import require
from steprl.types import Task

if TYPE_CHECKING:
    import gymnasium as gym
    from gymnasium import spaces
    from gymnasium.utils import seeding
else:
    gym = require("gymnasium", extra="gym", feature="the Gymnasium adapter")
    spaces = require("gymnasium.spaces", extra="gym", feature="the Gymnasium adapter")
    seeding = require("gymnasium.utils.seeding", extra="gym", feature="the Gymnasium adapter")

#: Builds a Gymnasium env from keyword arguments (a registered id is passed to `gym.make`).
GymFactory = Callable[..., gym.Env[Any, Any]]
#: Raw observation -> the text the policy sees.
ObsRenderer = Callable[[Any], str]
#: (env reward, terminated, truncated) -> the step's `outcome` reward component.
OutcomeFn = Callable[[float, bool, bool], float]

_MAX_REJECTIONS = 10_000  # consecutive seeds outside the split before giving up
_SEED_SPLIT = 2**30  # split_by="seed": train task seeds below it, eval seeds from it up to 2**31
_ENV_CACHE = 4  # gym env instances kept per GymnasiumEnv (one per distinct env_kwargs)


def solved_on_termination(reward: float, terminated: bool, truncated: bool) -> float:
    """Outcome 1 when the episode terminates, else 0: for envs that end only on success (Taxi)."""
    return 1.0 if terminated else 0.0


def make_gym_env(env: str | GymFactory, **kwargs: Any) -> gym.Env[Any, Any]:
    """`gym.make(env, **kwargs)` for a registered id, `env(**kwargs)` for a factory."""
    return gym.make(env, **kwargs) if isinstance(env, str) else env(**kwargs)


def _kwargs_key(kwargs: Mapping[str, Any]) -> str:
    return json.dumps(kwargs, sort_keys=True, default=repr)


def _jsonable(value: Any) -> Any:
    """An env action as a JSON-friendly value for `info` (numpy scalars/arrays to Python)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value if isinstance(value, int | float | str | bool | type(None)) else repr(value)


class GymnasiumEnv:
    """Implements `Env` for a Gymnasium env, one episode at a time (see the module docstring).

    Args:
        env: a registered Gymnasium id (``"FrozenLake-v1"``) or a factory ``(**kwargs) -> gym.Env``.
        env_kwargs: passed to `gym.make` / the factory; a task's ``params["env_kwargs"]`` is
            merged over them (e.g. a per-task map), rebuilding the env when they change.
        render: (the Gymnasium env, raw observation) -> text, for envs whose state is not all
            in the observation (FrozenLake's map); see `gym_render` for ready ones.
        render_obs: raw observation -> text (instead of `render`); default: the observation
            itself, which must be a string (a ``spaces.Text`` observation space).
        action_names: names of the actions of a ``Discrete`` space, in order; the policy may use
            either the name or the integer.
        action_parser / action_formatter: the action protocol for other spaces (body text ->
            action, raising `ValueError` with a short reason; action -> body text).
        outcome: (env reward, terminated, truncated) -> the outcome component; default: the env
            reward itself.
        description: what the task is, opening the system prompt (e.g. the rules, the legend).
        system_prompt: replaces the default prompt entirely.
        rewards: the format penalty and costs (see `RewardConfig`).
        max_invalid_actions: invalid actions tolerated; one more ends the episode as a policy error.
        action_tag: the tag that wraps an action (default ``answer``).
        format_hint: appended to parse errors; default: the expected form of an action.
    """

    tools: Mapping[str, ToolSpec] = NO_TOOLS  # none for a chat template: the system prompt says how to act

    def __init__(
        self,
        env: str | GymFactory,
        *,
        env_kwargs: Mapping[str, Any] | None = None,
        render_obs: ObsRenderer | None = None,
        render: Renderer | None = None,
        action_names: Sequence[str] | None = None,
        action_parser: ActionParser | None = None,
        action_formatter: ActionFormatter | None = None,
        outcome: OutcomeFn | None = None,
        description: str = "",
        system_prompt: str | None = None,
        rewards: RewardConfig | None = None,
        max_invalid_actions: int = 3,
        action_tag: str = "answer",
        format_hint: str | None = None,
    ) -> None:
        if max_invalid_actions < 0:
            raise ValueError(f"max_invalid_actions must be >= 0, got {max_invalid_actions}.")
        self.env_id = env
        self.env_kwargs: dict[str, Any] = dict(env_kwargs or {})
        self._envs: OrderedDict[str, gym.Env[Any, Any]] = OrderedDict()
        base = self._gym_env(self.env_kwargs)
        self.action_space = base.action_space
        self.observation_space = base.observation_space
        if render is not None and render_obs is not None:
            raise ValueError("pass render=(env, obs) -> text or render_obs=obs -> text, not both.")
        if render is None and render_obs is None and not isinstance(self.observation_space, spaces.Text):
            raise ValueError(
                f"{env!r} has {self.observation_space} observations, not text; pass "
                "render=lambda env, obs: ... (or render_obs=lambda obs: ...) to turn an observation "
                "into the text the policy sees."
            )
        self.render_obs: ObsRenderer = render_obs if render_obs is not None else _render_text
        self.render = render
        self.parse_action, self.format_action, describe = action_codec(
            self.action_space, action_names, action_parser, action_formatter
        )
        self.outcome = outcome
        self.rewards = rewards if rewards is not None else RewardConfig()
        self.max_invalid_actions = max_invalid_actions
        self.syntax = ActionSyntax(answer_tag=action_tag)
        self.action_tag = action_tag
        self.stop_strings: Sequence[str] = self.syntax.stop_strings
        self.format_hint = (
            format_hint if format_hint is not None else f"act with <{action_tag}>a</{action_tag}>"
        )
        if system_prompt is None:
            system_prompt = (
                (description.strip() + "\n" if description.strip() else "")
                + f"Each turn, act with <{action_tag}>a</{action_tag}> where a is {describe}. "
                "You then see the new state; a mistake comes back as <error>...</error>."
            )
        self.system_prompt = system_prompt
        self._env: gym.Env[Any, Any] | None = None
        self._done = True
        self._invalid = 0
        self._turn = 0
        self.raw_obs: Any = None  # the current raw observation (for experts and debugging)
        self._rendered = ""

    def _gym_env(self, kwargs: Mapping[str, Any]) -> gym.Env[Any, Any]:
        """The env built with `kwargs`, from a small LRU cache (maps differ per task)."""
        key = _kwargs_key(kwargs)
        env = self._envs.get(key)
        if env is None:
            env = make_gym_env(self.env_id, **kwargs)
            self._envs[key] = env
            while len(self._envs) > _ENV_CACHE:
                self._envs.popitem(last=False)[1].close()
        self._envs.move_to_end(key)
        return env

    def reset(self, task: Task, seed: int) -> Observation:
        """Start an episode in the task's initial state (see the module docstring on seeding)."""
        kwargs = {**self.env_kwargs, **dict(task.params.get("env_kwargs", {}))}
        env = self._gym_env(kwargs)
        obs, _ = env.reset(seed=_seed(task.seed))
        if seed != task.seed:
            env.unwrapped.np_random = seeding.np_random(_seed(seed))[0]
        self._env, self._done, self._invalid, self._turn = env, False, 0, 0  # before rendering
        self.raw_obs, self._rendered = obs, self._render(obs)
        return Observation(self._rendered, {"task_id": task.id, "seed": seed, "anchor": self._rendered})

    def step(self, action: str) -> Transition:
        """Parse `action`, step the env, and price the step (see the module docstring)."""
        if self._env is None or self._done:
            raise RuntimeError(
                "GymnasiumEnv.step() called before reset() or after the episode ended; "
                "call reset(task, seed)."
            )
        self._turn += 1
        parsed = self.syntax.parse(action)
        if isinstance(parsed, InvalidAction):
            return self._invalid_action(parsed.reason)
        assert isinstance(parsed, FinalAnswer)  # no tools: the action tag is the only call
        try:
            move = self.parse_action(parsed.text)
        except (ValueError, TypeError) as exc:
            return self._invalid_action(str(exc) or "invalid action")
        try:
            allowed = bool(self.action_space.contains(move))
        except Exception:  # a custom parser's odd value: `contains` of some spaces raises on it
            allowed = False
        if not allowed:
            return self._invalid_action(f"action {shorten(parsed.text, 24)!r} is not in the action space")
        anchor = self._rendered
        obs, reward, terminated, truncated, _ = self._env.step(move)
        env_reward, terminated, truncated = float(reward), bool(terminated), bool(truncated)
        outcome = self.outcome(env_reward, terminated, truncated) if self.outcome else env_reward
        self.raw_obs, self._rendered = obs, self._render(obs)
        self._done = terminated or truncated
        breakdown = RewardBreakdown(
            {
                "outcome": float(outcome),
                "format": format_component("tool_call", self.rewards),
                "cost": cost_component("tool_call", self.rewards),
            }
        )
        return self._transition(
            "" if self._done else self._rendered,
            breakdown,
            kind="tool_call",
            anchor=anchor,
            terminated=terminated,
            truncated=truncated,
            valid=True,
            extra={"env_action": _jsonable(move), "env_reward": env_reward},
        )

    def close(self) -> None:
        """Close every cached Gymnasium env; safe to call any number of times."""
        while self._envs:
            self._envs.popitem()[1].close()
        self._env, self._done = None, True

    def set_tabular_state(self, state: int, last_action: int | None = None) -> str:
        """Move a toy-text env (state ``env.unwrapped.s``) to `state` mid-episode; its new rendering.

        For scripted policies only (`gym_experts.tabular_sync`): a replay that slipped elsewhere
        than the real episode is put back on its path.
        """
        if self._env is None:
            raise RuntimeError("set_tabular_state() needs an episode; call reset(task, seed) first.")
        inner = self._env.unwrapped
        inner.s = int(state)  # type: ignore[attr-defined]
        if last_action is not None and hasattr(inner, "lastaction"):
            inner.lastaction = int(last_action)
        self.raw_obs, self._rendered, self._done = int(state), self._render(int(state)), False
        return self._rendered

    def _render(self, obs: Any) -> str:
        text = self.render(self._env, obs) if self.render is not None else self.render_obs(obs)
        if not isinstance(text, str):
            raise TypeError(f"the renderer returned {type(text).__name__}; it must return str.")
        return text

    def _invalid_action(self, reason: str) -> Transition:
        self._invalid += 1
        give_up = self._invalid > self.max_invalid_actions
        self._done = give_up
        reason = shorten(reason)
        breakdown = RewardBreakdown(
            {
                "outcome": 0.0,
                "format": format_component("invalid", self.rewards),
                "cost": cost_component("invalid", self.rewards),
            }
        )
        return self._transition(
            "" if give_up else f"<error>{reason}; {self.format_hint}</error>",
            breakdown,
            kind="invalid",
            anchor=self._rendered,
            terminated=give_up,
            error=reason,
            policy_error=give_up,
        )

    def _transition(
        self,
        observation: str,
        rewards: RewardBreakdown,
        *,
        kind: ActionKind,
        anchor: str,
        terminated: bool = False,
        truncated: bool = False,
        valid: bool | None = None,
        error: str | None = None,
        policy_error: bool = False,
        extra: Mapping[str, Any] | None = None,
    ) -> Transition:
        info = {
            "reward_components": rewards.as_dict(),
            "action_kind": kind,
            "tool_call_valid": valid,
            "tool_name": None,
            "error": error,
            "policy_error": policy_error,
            "turn": self._turn,
            "invalid_actions": self._invalid,
            "anchor": anchor,
            **(extra or {}),
        }
        return Transition(observation, rewards.total, terminated, truncated, info)


def _render_text(obs: Any) -> str:
    if not isinstance(obs, str):
        raise TypeError(f"the observation is {type(obs).__name__}, not text; pass render_obs=... .")
    return obs


def _seed(seed: int) -> int:
    """Gymnasium wants a non-negative seed; fold any int into [0, 2**63)."""
    return int(seed) % 2**63


# --- the spec: one task per seed ------------------------------------------------------------------------


def split_of(prompt: str, eval_fraction: float) -> str:
    """The split of `prompt`: "eval" for a stable `eval_fraction` share of prompts (by sha256)."""
    digest = hashlib.sha256(prompt.encode("utf-8", "surrogatepass")).digest()
    return "eval" if int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction else "train"


def make_gym_spec(
    name: str,
    env: str | GymFactory,
    *,
    expert: ExpertFn | None = None,
    task_env_kwargs: Callable[[int], Mapping[str, Any]] | None = None,
    eval_fraction: float = 0.2,
    max_turns: int = 16,
    description: str = "",
    strategies: Mapping[str, Policy] | None = None,
    split_by: Literal["prompt", "seed"] = "prompt",
    stochastic: bool = False,
    min_expert_success: float = 1.0,
    expert_seeds: int = 1,
    **env_options: Any,
) -> EnvSpec:
    """An `EnvSpec` for a Gymnasium env: one task per seed, an expert and a random strategy.

    A task's prompt is the rendered initial observation of ``env.reset(seed=task.seed)``
    (with ``task_env_kwargs(task.seed)`` merged into the env kwargs when given, e.g. a random
    map per task). With ``split_by="prompt"`` it goes to "eval" for a stable `eval_fraction`
    share of prompts; with ``split_by="seed"`` (a fixed start state) train and eval draw task
    seeds from disjoint ranges. `expert` maps a raw observation to the action to take (required
    unless `strategies` has an "expert"); for a toy-text env with a transition table and
    ``Discrete`` observations its replay follows the real episode's slips (`tabular_sync`).
    `stochastic`, `min_expert_success` and `expert_seeds` are the `EnvSpec` rules `check_env`
    applies. `env_options` are `GymnasiumEnv` keyword arguments; ``factory(**env_params)``
    overrides them.
    """
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}.")
    if split_by not in ("prompt", "seed"):
        raise ValueError(f"split_by must be 'prompt' or 'seed', got {split_by!r}.")
    env_options = {"description": description, **env_options}  # it opens the system prompt too
    template = GymnasiumEnv(env, **env_options)

    def factory(**params: Any) -> GymnasiumEnv:
        return GymnasiumEnv(env, **{**env_options, **params})

    def tasks(split: str, seed: int, n: int | None = None) -> Iterator[Task]:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}.")
        stream = _task_stream(name, template, split, seed, task_env_kwargs, eval_fraction, split_by)
        return stream if n is None else islice(stream, n)

    policies: dict[str, Policy] = {"random": random_policy_for(template)}
    if expert is not None:
        policies["expert"] = ReplayExpert(GymnasiumEnv(env, **env_options), expert, replay_sync(template))
    policies.update(strategies or {})
    return EnvSpec(
        name=name,
        factory=factory,
        tasks=tasks,
        strategies=policies,
        max_turns=max_turns,
        description=description,
        stochastic=stochastic,
        min_expert_success=min_expert_success,
        expert_seeds=expert_seeds,
        split_by=split_by,
    )


def transition_table(env: GymnasiumEnv) -> Any:
    """The toy-text transition table ``P`` of `env` (None if it has none or its observations are
    not the state numbers)."""
    built = env._gym_env(env.env_kwargs)
    if not isinstance(env.observation_space, spaces.Discrete):
        return None
    return getattr(built.unwrapped, "P", None) if hasattr(built.unwrapped, "s") else None


def replay_sync(env: GymnasiumEnv) -> SyncFn | None:
    """`tabular_sync` for a toy-text env whose dynamics are random, else None (nothing to follow)."""
    table = transition_table(env)
    if table is None or is_deterministic(table):
        return None
    return tabular_sync(table)


def _task_stream(
    name: str,
    template: GymnasiumEnv,
    split: str,
    seed: int,
    task_env_kwargs: Callable[[int], Mapping[str, Any]] | None,
    eval_fraction: float,
    split_by: str = "prompt",
) -> Iterator[Task]:
    rng = random.Random(f"{name}-{seed}")
    index = rejected = 0
    while True:
        if split_by == "seed":  # disjoint ranges: eval seeds are at least _SEED_SPLIT
            task_seed = rng.randrange(_SEED_SPLIT) + (_SEED_SPLIT if split == "eval" else 0)
        else:
            task_seed = rng.randrange(2**31)
        kwargs = dict(task_env_kwargs(task_seed)) if task_env_kwargs is not None else {}
        probe = Task(id="probe", prompt="", env=name, seed=task_seed, params={"env_kwargs": kwargs})
        prompt = template.reset(probe, task_seed).text
        if split_by == "prompt" and split_of(prompt, eval_fraction) != split:
            rejected += 1
            if rejected > _MAX_REJECTIONS:
                raise RuntimeError(
                    f"{name}: no {split!r} task in {_MAX_REJECTIONS} seeds; the initial observations "
                    "barely vary with the seed. Split by seed (split_by='seed'), or pass "
                    "task_env_kwargs (e.g. a random map per seed)."
                )
            continue
        rejected = 0
        yield Task(
            id=f"{name}-{split}-{seed}-{index}",
            prompt=prompt,
            env=name,
            seed=task_seed,
            params={"env_kwargs": kwargs},
        )
        index += 1
