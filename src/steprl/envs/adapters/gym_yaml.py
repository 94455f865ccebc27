"""`gym_spec(params)`: any Gymnasium env trained from YAML alone (``env: {name: gym, params: ...}``).

The registry's ``gym`` family calls `gym_spec` with the config's ``env.params``, and every
backend then calls ``spec.factory(**params)`` with the same dict. Params:

* ``id`` (required): a registered Gymnasium id, e.g. ``FrozenLake-v1``. A deprecated or unknown
  id is a `GymParamsError` carrying Gymnasium's own message.
* ``kwargs``: keyword arguments of ``gym.make``, e.g. ``{map_name: 4x4, is_slippery: true}``
  (``max_episode_steps`` too: a time limit ends the episode ``truncated``, not terminated).
* ``render``: how an observation becomes the text the policy sees. ``auto`` (default): the
  built-in renderer of a known env, else ``text`` for text observations, else ``ansi`` if the
  env supports it, else ``repr``. ``text``: the observation is a str. ``ansi``: ``env.render()``
  with ``render_mode="ansi"``, escape codes stripped (a highlight, e.g. FrozenLake's agent cell,
  kept as ``[S]``). ``repr``: ``str(obs)``. ``frozenlake`` | ``taxi`` | ``cliffwalking`` |
  ``blackjack``: clean built-in renderers (`gym_render.BUILTIN`). ``package.module:function``:
  your ``fn(env, obs) -> str``.
* ``action_names``: one name per action of a ``Discrete`` space (known envs have defaults);
  ``MultiDiscrete`` actions are integers ("1 2"); other spaces need ``action_parser``
  (and ``action_formatter``): import paths of ``text -> action`` and ``action -> text``.
* ``outcome``: the success signal, reward component ``outcome``: ``reward`` (the env reward),
  ``terminated`` (1 when the episode terminates: Taxi, CliffWalking) or ``win`` (1 when it
  terminates with reward > 0: Blackjack).
* ``expert``: ``auto`` (default): a built-in solver for known envs (a shortest path, or on
  slippery ice the policy with the best chance of the goal within ``max_turns``, over the
  transition table; basic strategy for Blackjack); or ``package.module:function``, your
  ``fn(raw observation) -> action``. The spec also offers ``guess`` (the expert's move half
  the time, else a random legal one: the imperfect warm start) and ``random``.
* ``max_turns``, ``eval_fraction`` (share of prompts in "eval"), ``description`` (opens the
  system prompt), ``max_invalid_actions``.
* ``split_by``: ``auto`` (default): ``prompt`` when the first 64 seeds give at least 16
  distinct start states, else ``seed`` (disjoint task-seed ranges: the start state is fixed
  and the env's own randomness, a slip or the dealer's cards, is the task variation).
* ``stochastic``, ``min_expert_success``, ``expert_seeds``: the `EnvSpec` rules for
  `check_env`. By default a tabular env is stochastic when its transition table is, and
  must then reach 80% of its expert's exact chance of success within ``max_turns``.

Defaults for known envs live in `KNOWN`, keyed by id prefix; params override them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from steprl.envs.adapters.gym_experts import (
    DecodingExpert,
    ExpertFn,
    ReplayExpert,
    best_tabular_expert,
    blackjack_basic_strategy,
    guess_policy,
    is_deterministic,
    random_policy_for,
)
from steprl.envs.adapters.gym_render import (
    BUILTIN,
    Renderer,
    blackjack_obs,
    render_ansi,
    render_repr,
    render_text,
)
from steprl.envs.adapters.gymnasium_env import (
    GymnasiumEnv,
    OutcomeFn,
    make_gym_spec,
    replay_sync,
    solved_on_termination,
    transition_table,
)
from steprl.envs.policy import Policy
from steprl.envs.spec import EnvSpec
from steprl.errors import UserError
from steprl.extras import require
from steprl.registry import load_attr
from steprl.types import Task

if TYPE_CHECKING:
    import gymnasium as gym
    from gymnasium import spaces
else:
    gym = require("gymnasium", extra="gym", feature="the Gymnasium adapter")
    spaces = require("gymnasium.spaces", extra="gym", feature="the Gymnasium adapter")

_TAXI_MAP = "+---------+\n|R: | : :G|\n| : | : : |\n| : : : : |\n| | : | : |\n|Y| : |B: |\n+---------+"

#: Defaults for known envs, by id prefix (``FrozenLake`` matches FrozenLake-v1 and FrozenLake8x8-v1).
KNOWN: dict[str, dict[str, Any]] = {
    "FrozenLake": {
        "render": "frozenlake",
        "action_names": ["left", "down", "right", "up"],
        "outcome": "reward",
        "max_turns": 16,
        "description": "Walk A over the frozen lake (S start, F ice) to the goal G; a hole H ends the "
        "episode. On slippery ice a move may go sideways.",
    },
    "Taxi": {
        "render": "taxi",
        "action_names": ["south", "north", "east", "west", "pickup", "dropoff"],
        "outcome": "terminated",
        "max_turns": 30,
        "description": "Drive the taxi on this map (| is a wall; row 0 is the top, column 0 the left), "
        f"pick up the passenger and drop them off at the destination:\n{_TAXI_MAP}",
    },
    "CliffWalking": {
        "render": "cliffwalking",
        "action_names": ["up", "right", "down", "left"],
        "outcome": "terminated",
        "max_turns": 30,
        "description": "Walk x along the grid to the goal T; stepping on the cliff C sends you back "
        "to the start.",
    },
    "Blackjack": {
        "render": "blackjack",
        "action_names": ["stick", "hit"],
        "outcome": "win",
        "max_turns": 8,
        "stochastic": True,
        # basic strategy wins about 43% of hands (random play 28%), but the odds of 20 sampled hands
        # vary widely: their mean ranged 0.29-0.61 over three check seeds
        "min_expert_success": 0.2,
        "expert_seeds": 10,
        "description": "Play a hand of Blackjack: hit takes a card, stick ends your turn; beat the "
        "dealer's sum without going over 21 (an ace counts 1 or 11).",
    },
}

#: Every param `gym_spec` reads (see the module docstring).
ALLOWED = (
    "id",
    "kwargs",
    "render",
    "action_names",
    "action_parser",
    "action_formatter",
    "outcome",
    "expert",
    "max_turns",
    "eval_fraction",
    "split_by",
    "stochastic",
    "min_expert_success",
    "expert_seeds",
    "description",
    "max_invalid_actions",
)
_TYPES: dict[str, type | tuple[type, ...]] = {
    "id": str,
    "kwargs": dict,
    "render": str,
    "action_names": list,
    "action_parser": str,
    "action_formatter": str,
    "outcome": str,
    "expert": str,
    "max_turns": int,
    "eval_fraction": (int, float),
    "split_by": str,
    "stochastic": (bool, str),
    "min_expert_success": (int, float),
    "expert_seeds": int,
    "description": str,
    "max_invalid_actions": int,
}
_CHOICES = {"outcome": ("reward", "terminated", "win"), "split_by": ("auto", "prompt", "seed")}
_PROBE_SEEDS, _MIN_DISTINCT = 64, 16  # split_by auto: >= 16 distinct start states in 64 seeds
_SHARE_OF_EXACT = 0.8  # default min_expert_success: this share of the expert's exact chance


class GymParamsError(UserError, ValueError):
    """A bad ``env.params`` for the ``gym`` family: the message names the key and how to fix it."""


def win_on_termination(reward: float, terminated: bool, truncated: bool) -> float:
    """Outcome 1 when the episode terminates with a positive reward (a won hand), else 0."""
    return 1.0 if terminated and reward > 0 else 0.0


_OUTCOMES: dict[str, OutcomeFn | None] = {
    "reward": None,
    "terminated": solved_on_termination,
    "win": win_on_termination,
}


def known_defaults(env_id: str) -> dict[str, Any]:
    """The `KNOWN` entry whose prefix starts the id's name (after any ``namespace/``), or {}."""
    name = env_id.rsplit("/", 1)[-1]
    return next((dict(v) for prefix, v in KNOWN.items() if name.startswith(prefix)), {})


def _validate(params: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(params) - set(ALLOWED))
    if unknown:
        raise GymParamsError(f"env.params.{unknown[0]}: unknown key; allowed keys: {', '.join(ALLOWED)}")
    if not isinstance(params.get("id"), str) or not params["id"]:
        raise GymParamsError("env.params.id: required, a registered Gymnasium id such as FrozenLake-v1")
    for key, value in params.items():
        wanted = _TYPES[key]
        if not isinstance(value, wanted) or (isinstance(value, bool) and wanted in (int, (int, float))):
            names = " or ".join(t.__name__ for t in (wanted if isinstance(wanted, tuple) else (wanted,)))
            raise GymParamsError(f"env.params.{key}: expected {names}, got {value!r}")
        if key in _CHOICES and value not in _CHOICES[key]:
            raise GymParamsError(f"env.params.{key}: {value!r} is not one of {', '.join(_CHOICES[key])}")
    if isinstance(params.get("stochastic"), str) and params["stochastic"] != "auto":
        raise GymParamsError(f"env.params.stochastic: true, false or auto, got {params['stochastic']!r}")
    return {**known_defaults(params["id"]), **params}


def _load(key: str, path: str) -> Any:
    """The object at import path ``package.module:attr`` (named by param `key` in errors)."""
    obj = load_attr(path, f"env.params.{key}", GymParamsError)
    if not callable(obj):
        raise GymParamsError(f"env.params.{key}: {path!r} is a {type(obj).__name__}, not a function")
    return obj


def _probe(env_id: str, kwargs: Mapping[str, Any]) -> gym.Env[Any, Any]:
    """`gym.make`, with Gymnasium's own message (deprecated, unknown id, bad kwargs) as a user error."""
    try:
        return gym.make(env_id, **kwargs)
    except gym.error.Error as exc:
        raise GymParamsError(f"env.params.id={env_id!r}: {exc}") from None
    except TypeError as exc:
        raise GymParamsError(
            f"env.params.kwargs: gym.make({env_id!r}, **{dict(kwargs)}) failed: {exc}"
        ) from None


def _renderer(name: str, probe: gym.Env[Any, Any]) -> tuple[Renderer, str]:
    """The renderer for the `render` param and its resolved name."""
    if name == "auto":
        modes = probe.metadata.get("render_modes", [])
        name = (
            "text"
            if isinstance(probe.observation_space, spaces.Text)
            else "ansi"
            if "ansi" in modes
            else "repr"
        )
    fixed: dict[str, Renderer] = {"text": render_text, "ansi": render_ansi, "repr": render_repr, **BUILTIN}
    if name in fixed:
        return fixed[name], name
    if ":" in name:
        return _load("render", name), name
    raise GymParamsError(
        f"env.params.render: {name!r} is not auto, text, ansi, repr, one of {', '.join(BUILTIN)}, "
        "or an import path package.module:function taking (env, obs)"
    )


@dataclasses.dataclass(frozen=True)
class _Resolved:
    """Params with every ``auto`` decided: what `GymnasiumEnv` is built from."""

    env_id: str
    kwargs: Mapping[str, Any]
    options: Mapping[str, Any]  # GymnasiumEnv keyword arguments
    params: Mapping[str, Any]  # the validated params, known-env defaults merged in
    render_name: str

    def env(self) -> GymnasiumEnv:
        return GymnasiumEnv(self.env_id, env_kwargs=dict(self.kwargs), **self.options)


def _resolve(params: Mapping[str, Any]) -> _Resolved:
    p = _validate(params)
    env_id, kwargs = p["id"], dict(p.get("kwargs", {}))
    probe = _probe(env_id, kwargs)
    try:
        render, render_name = _renderer(p.get("render", "auto"), probe)
        if render_name == "ansi":
            if "ansi" not in probe.metadata.get("render_modes", []):
                raise GymParamsError(
                    f"env.params.render: {env_id} has no ansi render mode (it has "
                    f"{probe.metadata.get('render_modes', [])}); pick repr or your own function"
                )
            kwargs.setdefault("render_mode", "ansi")
        names = p.get("action_names")
        if names is not None and not isinstance(probe.action_space, spaces.Discrete):
            names = None if "action_names" not in params else names  # a known default that does not fit
        options: dict[str, Any] = {
            "render": render,
            "action_names": names,
            "outcome": _OUTCOMES[p.get("outcome", "reward")],
            "description": p.get("description", ""),
            "max_invalid_actions": p.get("max_invalid_actions", 3),
        }
        for key in ("action_parser", "action_formatter"):
            if key in p:
                options[key] = _load(key, p[key])
        if isinstance(probe.action_space, spaces.Box) and "action_parser" not in options:
            raise GymParamsError(
                f"env.params.action_parser: {env_id} has a Box action space ({probe.action_space}), "
                "which has no text form by default; give action_parser: package.module:function "
                "(text -> action, raising ValueError for bad text) and action_formatter"
            )
    finally:
        probe.close()
    return _Resolved(env_id, kwargs, options, p, render_name)


def _build(resolved: _Resolved) -> GymnasiumEnv:
    try:
        return resolved.env()
    except (ValueError, TypeError) as exc:  # GymnasiumEnv's own checks, with how to fix them
        raise GymParamsError(f"env.params (id={resolved.env_id!r}): {exc}") from None


def gym_spec(params: Mapping[str, Any]) -> EnvSpec:
    """The `EnvSpec` of the Gymnasium env `params` describe (see the module docstring)."""
    resolved = _resolve(params)
    p = resolved.params
    name = f"gym:{resolved.env_id}"
    template = _build(resolved)
    max_turns = p.get("max_turns", 16)
    outcome = p.get("outcome", "reward")
    texts, start_obs = set(), set()  # the start states of the first seeds
    for seed in range(_PROBE_SEEDS):
        texts.add(template.reset(_probe_task(name, seed), seed).text)
        if isinstance(template.raw_obs, int | np.integer):
            start_obs.add(int(template.raw_obs))
    split_by = p.get("split_by", "auto")
    if split_by == "auto":
        split_by = "prompt" if len(texts) >= _MIN_DISTINCT else "seed"

    table = transition_table(template)
    stochastic, chance = p.get("stochastic", "auto"), 1.0
    expert_kind = p.get("expert", "auto")
    expert_policy: Policy | None = None
    if expert_kind != "auto":
        expert_fn: ExpertFn = _load("expert", expert_kind)
        expert_policy = ReplayExpert(_build(resolved), expert_fn, replay_sync(template))
    elif table is not None:
        is_goal: Callable[[float, bool], bool] = (
            (lambda r, t: t) if outcome == "terminated" else (lambda r, t: t and r > 0)
        )
        expert_fn, chance = best_tabular_expert(table, sorted(start_obs), max_turns, is_goal)
        if chance <= 0.0:
            raise GymParamsError(
                f"env.params.max_turns: the built-in expert cannot reach the goal of {resolved.env_id} "
                f"within {max_turns} turns; raise max_turns"
            )
        expert_policy = ReplayExpert(_build(resolved), expert_fn, replay_sync(template))
    elif resolved.env_id.rsplit("/", 1)[-1].startswith("Blackjack") and resolved.render_name in (
        "blackjack",
        "repr",
    ):
        expert_policy = DecodingExpert(template, blackjack_basic_strategy, blackjack_obs)
    if expert_policy is None:
        raise GymParamsError(
            f"env.params.expert: there is no built-in expert for {resolved.env_id} (render "
            f"{resolved.render_name}); give expert: package.module:function (raw observation -> action)"
        )
    if stochastic == "auto":
        stochastic = bool(table is not None and not is_deterministic(table))
    default_min = 1.0 if not stochastic else math.floor(100 * _SHARE_OF_EXACT * chance) / 100
    strategies = {
        "expert": expert_policy,
        "guess": guess_policy(expert_policy, random_policy_for(template, junk_rate=0.0)),
    }
    try:
        spec = make_gym_spec(
            name,
            resolved.env_id,
            max_turns=max_turns,
            eval_fraction=float(p.get("eval_fraction", 0.2)),
            description=p.get("description", ""),
            strategies=strategies,
            split_by=split_by,
            stochastic=bool(stochastic),
            min_expert_success=float(p.get("min_expert_success", max(0.01, default_min))),
            expert_seeds=p.get("expert_seeds", 5 if stochastic else 1),
            env_kwargs=dict(resolved.kwargs),
            **{k: v for k, v in resolved.options.items() if k != "description"},
        )
    except ValueError as exc:
        raise GymParamsError(f"env.params: {exc}") from None
    return dataclasses.replace(spec, factory=_factory(params, resolved))


def _probe_task(name: str, seed: int) -> Task:
    return Task(id=f"probe-{seed}", prompt="", env=name, seed=seed)


def _factory(params: Mapping[str, Any], resolved: _Resolved) -> Callable[..., GymnasiumEnv]:
    """``factory(**params)``: the env of the spec's params, or of other params given (validated)."""
    key = json.dumps(dict(params), sort_keys=True, default=repr)

    def factory(**given: Any) -> GymnasiumEnv:
        if not given or json.dumps(given, sort_keys=True, default=repr) == key:
            return _build(resolved)
        return _build(_resolve(given))

    return factory
