"""`check_env`: the conformance checker every registered environment must pass (in CI).

Like Gymnasium's ``env_checker`` and dm_env's ``EnvironmentTestMixin``, but for text agents.
Each check has a name (`CHECKS`); the report lists those that ran as specified (`ran`) and
those the spec's declared rules relaxed, with why (`relaxed`; see `EnvSpec`):

1. ``api``: the env has every `Env` member the core reads (`system_prompt`, a str;
   `stop_strings`, a sequence of non-empty strings, possibly empty; `reset`, `step`, `close`);
   `reset` returns an `Observation`, `step` a `Transition` that keeps the contract the agent
   loop enforces in training too (`envs/contract.py`: a finite number for a reward, equal to
   the sum of ``info["reward_components"]`` when the env reports them). Sync and async methods
   are both accepted; every call answers within ``call_timeout_s`` (`envs/deadline.py`).
2. ``tasks``: the task stream is a pure function of (split, seed), of `Task` records whose
   ``env`` is the spec's name. Always checked.
3. ``split``: train and eval share no prompt on a sample; with ``split_by="seed"`` (a fixed
   start state) they share no task seed instead.
4. ``replay``: the same task, seed and actions give the same observations and rewards
   (replayed in a fresh instance); skipped for ``replayable=False``, with the spec's reason.
5. ``robustness``: malformed actions give an error observation, never an exception.
6. ``solvability``: the "expert" policy gets outcome reward 1 on every sampled task within
   `EnvSpec.max_turns` steps; for a `stochastic` env, or ``min_expert_success < 1``, on at
   least that share of tasks x `expert_seeds` episodes (seeds derived from the task seed).
7. ``strategies``: the "random" policy (and every other strategy) runs without exceptions.
8. ``close``: `close()` can be called twice.

The first failure raises `EnvCheckError`, saying what is wrong and how to fix it; so does an
env call, or a task factory's next task, that takes longer than ``call_timeout_s``.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NoReturn

from steprl.envs.base import Env, EnvTimeout, Transition, maybe_await, missing_members
from steprl.envs.contract import observation_problem, reward_components, text_problem, transition_problem
from steprl.envs.deadline import DeadlineEnv, take_tasks
from steprl.envs.policy import Policy
from steprl.envs.registry import EnvSpec, get_spec
from steprl.types import Task

# Actions no env protocol accepts: empty, control characters and a lone surrogate, a flood.
MALFORMED_ACTIONS = ("", "\x00\ud800 not an action", "<" * 1000 + ">" * 1000)


#: The checks, in the order they run (see the module docstring).
CHECKS = ("api", "tasks", "split", "replay", "robustness", "solvability", "strategies", "close")


class EnvCheckError(Exception):
    """An environment broke the `Env` contract; the message says what and how to fix it."""


@dataclass(frozen=True)
class EnvCheckReport:
    """What `check_env` measured (only returned when every check passed).

    `ran` names the checks that ran as specified; `relaxed` maps the others to why the spec's
    declared rules relaxed them (e.g. ``"replay": "not replayable: reads the wall clock"``).
    """

    name: str
    n_tasks: int
    seed: int
    expert_success_rate: float
    random_success_rate: float
    mean_expert_tool_calls: float
    mean_expert_turns: float
    strategy_success: Mapping[str, float] = field(default_factory=dict)
    ran: tuple[str, ...] = ()
    relaxed: Mapping[str, str] = field(default_factory=dict)
    expert_episodes: int = 0

    def summary(self) -> str:
        """A short human report: the checks that ran, those relaxed and why, the success rates."""
        lines = [f"check_env {self.name!r}: passed on {self.n_tasks} tasks (seed {self.seed})"]
        lines.append("  ran: " + (", ".join(self.ran) or "(none)"))
        for check, why in self.relaxed.items():
            lines.append(f"  relaxed {check}: {why}")
        rates = ", ".join(f"{name} {rate:.2f}" for name, rate in sorted(self.strategy_success.items()))
        lines.append(f"  success: {rates}")
        lines.append(
            f"  expert: {self.expert_episodes} episodes, {self.mean_expert_turns:.1f} turns and "
            f"{self.mean_expert_tool_calls:.1f} tool calls per episode"
        )
        return "\n".join(lines)


@dataclass
class _Episode:
    task: Task
    seed: int
    first: str
    actions: list[str]
    transitions: list[Transition]

    @property
    def outcome(self) -> float:
        return sum(reward_components(t).get("outcome", 0.0) for t in self.transitions)

    @property
    def ended(self) -> bool:
        return bool(self.transitions) and (self.transitions[-1].terminated or self.transitions[-1].truncated)

    def trace(self) -> list[tuple[str, float, bool, bool, dict[str, float]]]:
        return [
            (t.observation, t.reward, t.terminated, t.truncated, dict(reward_components(t)))
            for t in self.transitions
        ]


def check_env(
    name: str,
    *,
    n_tasks: int = 20,
    seed: int = 0,
    env_params: Mapping[str, Any] | None = None,
    task_params: Mapping[str, Any] | None = None,
    call_timeout_s: float = 30.0,
) -> EnvCheckReport:
    """Run every check on the registered env `name` (see the module docstring)."""
    return check_spec(
        get_spec(name, env_params),
        n_tasks=n_tasks,
        seed=seed,
        env_params=env_params,
        task_params=task_params,
        call_timeout_s=call_timeout_s,
    )


def check_spec(
    spec: EnvSpec,
    *,
    n_tasks: int = 20,
    seed: int = 0,
    env_params: Mapping[str, Any] | None = None,
    task_params: Mapping[str, Any] | None = None,
    call_timeout_s: float = 30.0,
) -> EnvCheckReport:
    """`check_env` for a spec that need not be registered.

    Runs its own event loop (`asyncio.run`); inside a running loop, await `acheck_spec` instead.
    """
    return asyncio.run(
        acheck_spec(
            spec,
            n_tasks=n_tasks,
            seed=seed,
            env_params=env_params,
            task_params=task_params,
            call_timeout_s=call_timeout_s,
        )
    )


async def acheck_spec(
    spec: EnvSpec,
    *,
    n_tasks: int = 20,
    seed: int = 0,
    env_params: Mapping[str, Any] | None = None,
    task_params: Mapping[str, Any] | None = None,
    call_timeout_s: float = 30.0,
) -> EnvCheckReport:
    """`check_spec` for callers already inside an event loop."""
    if n_tasks < 1:
        raise ValueError(f"n_tasks must be >= 1, got {n_tasks}.")
    name, env_kw, task_kw = spec.name, dict(env_params or {}), dict(task_params or {})
    relaxed: dict[str, str] = {}
    tasks = _check_tasks(spec, n_tasks, seed, task_kw, relaxed, call_timeout_s)

    env = _make(spec, env_kw, call_timeout_s)
    replay_env = _make(spec, env_kw, call_timeout_s)
    exact = not spec.stochastic and spec.min_expert_success >= 1.0
    per_task = 1 if exact else spec.expert_seeds
    experts = [
        await _episode(spec, env, task, spec.strategies["expert"], _policy_rng(seed, i, k), "expert", s)
        for i, task in enumerate(tasks)
        for k, s in enumerate(episode_seeds(task.seed, per_task))
    ]
    for episode in experts:
        if "outcome" not in reward_components(episode.transitions[-1]):
            _fail(
                name,
                f"the last step of task {episode.task.id!r} has no 'outcome' reward component; "
                "report the verifier's score as reward_components['outcome'].",
            )
        if exact and not _solved(episode):
            _fail(
                name,
                f"the expert did not solve task {episode.task.id!r} ({episode.task.prompt[:80]!r}) "
                f"within {spec.max_turns} turns: outcome={episode.outcome}, "
                f"actions={episode.actions}. Fix the expert, the verifier, or raise "
                "EnvSpec.max_turns.",
            )
    expert_rate = sum(map(_solved, experts)) / len(experts)
    if not exact:
        _check_expert_rate(spec, experts, expert_rate, len(tasks), per_task, relaxed)

    if spec.replayable:
        for episode in experts:
            replay = await _replay(spec, replay_env, episode)
            if replay.first != episode.first or replay.trace() != episode.trace():
                _fail(
                    name,
                    f"replaying task {episode.task.id!r} with the same seed ({episode.seed}) and actions "
                    "gave different observations or rewards; draw all randomness from the seed passed "
                    "to reset(), or declare EnvSpec(replayable=False, not_replayable_because=...).",
                )
    else:
        relaxed["replay"] = f"not replayable: {spec.not_replayable_because.strip()}"

    for action in MALFORMED_ACTIONS:
        await _check_malformed(spec, env, tasks[0], action)

    success = {"expert": expert_rate}
    for strategy, policy in spec.strategies.items():
        if strategy != "expert":
            episodes = [
                await _episode(spec, env, task, policy, random.Random(seed + i), strategy, task.seed)
                for i, task in enumerate(tasks)
            ]
            success[strategy] = sum(map(_solved, episodes)) / len(episodes)

    for instance in (env, replay_env):
        for attempt in ("first", "second"):
            try:
                await maybe_await(instance.close())
            except Exception as exc:
                _fail(name, f"close() raised {exc!r} on the {attempt} call; make close() idempotent.")

    calls = [sum(t.info.get("action_kind") == "tool_call" for t in e.transitions) for e in experts]
    return EnvCheckReport(
        name=name,
        n_tasks=len(tasks),
        seed=seed,
        expert_success_rate=success["expert"],
        random_success_rate=success["random"],
        mean_expert_tool_calls=sum(calls) / len(calls),
        mean_expert_turns=sum(len(e.transitions) for e in experts) / len(experts),
        strategy_success=MappingProxyType(success),
        ran=tuple(c for c in CHECKS if c not in relaxed),
        relaxed=MappingProxyType(relaxed),
        expert_episodes=len(experts),
    )


def episode_seeds(task_seed: int, count: int) -> list[int]:
    """The episode seeds the expert is measured on for one task: the task's own seed first, then
    `count - 1` more derived from it (a pure function, so a failing episode can be rerun)."""
    return [task_seed] + [random.Random(f"{task_seed}/{k}").randrange(2**31) for k in range(1, count)]


def _policy_rng(seed: int, index: int, k: int) -> random.Random:
    return random.Random(seed + index) if k == 0 else random.Random(f"{seed}/{index}/{k}")


def _solved(episode: _Episode) -> bool:
    return episode.ended and math.isclose(episode.outcome, 1.0)


def _check_expert_rate(
    spec: EnvSpec, experts: list[_Episode], rate: float, n: int, per_task: int, relaxed: dict[str, str]
) -> None:
    """The declared success rule for stochastic envs: the expert's share of solved episodes."""
    where = f"over {n} tasks x {per_task} seeds"
    if rate + 1e-12 < spec.min_expert_success:
        bad = next(e for e in experts if not _solved(e))
        _fail(
            spec.name,
            f"the expert solved {rate:.2f} of its episodes {where}, below min_expert_success="
            f"{spec.min_expert_success:.2f} (e.g. task {bad.task.id!r}, seed {bad.seed}: "
            f"outcome={bad.outcome}, actions={bad.actions[:12]}). Fix the expert, raise "
            "EnvSpec.max_turns, or lower min_expert_success to what the env's randomness allows.",
        )
    relaxed["solvability"] = f"expert success {rate:.2f} >= {spec.min_expert_success:.2f} {where}"


def _fail(name: str, message: str) -> NoReturn:
    raise EnvCheckError(f"env {name!r}: {message}")


def _check_tasks(
    spec: EnvSpec, n: int, seed: int, params: dict[str, Any], relaxed: dict[str, str], timeout_s: float
) -> list[Task]:
    """The sampled train tasks, after checking types, determinism and split disjointness."""
    name = spec.name

    def sample(split: str, count: int) -> list[Task]:
        what = f"tasks({split!r}, {seed})"
        try:  # each task within the deadline: a factory that never yields one must not hang us
            return take_tasks(lambda: spec.tasks(split, seed, **params), count, timeout_s, what)
        except EnvTimeout as exc:
            _fail(
                name,
                f"{exc} (--call-timeout-s); a task factory must yield each task promptly: one that "
                f"filters an endless stream for the {split!r} split and never finds one hangs",
            )
        except Exception as exc:
            raise EnvCheckError(f"env {name!r}: {what} raised {exc!r}.") from exc

    train = sample("train", n)
    if not train:
        _fail(name, "the train split is empty; the task factory must yield tasks for 'train'.")
    for task in train:
        if not isinstance(task, Task):
            _fail(name, f"the task factory yielded {type(task).__name__}; yield steprl.types.Task records.")
        if task.env != name:
            _fail(
                name, f"task {task.id!r} has env={task.env!r}; set Task.env to the registered name {name!r}."
            )
    by_id: dict[str, Task] = {}
    for task in train:
        if by_id.setdefault(task.id, task) != task:
            _fail(name, f"task id {task.id!r} names two different tasks; include an index in Task.id.")
    if sample("train", n) != train:
        _fail(
            name,
            f"tasks('train', {seed}) differ between two calls; seed a local random.Random(seed) "
            "instead of using global or time-based randomness.",
        )
    evals = sample("eval", n)
    if not evals:
        _fail(name, "the eval split is empty; the task factory must yield tasks for 'eval'.")
    many = sample("train", max(5 * n, 100))
    if spec.split_by == "seed":
        shared = {t.seed for t in many} & {t.seed for t in evals}
        if shared:
            _fail(
                name,
                f"train and eval share task seeds such as {min(shared)} (split_by='seed'); draw "
                "the two splits' seeds from disjoint ranges.",
            )
        prompts = len({t.prompt for t in many})
        relaxed["split"] = (
            f"by task seed, not prompt ({prompts} distinct prompt(s) in {len(many)} train tasks)"
        )
        return _distinct(train, relaxed)
    overlap = {t.prompt for t in many} & {t.prompt for t in evals}
    if overlap:
        _fail(
            name,
            f"train and eval share prompts such as {sorted(overlap)[0][:80]!r}; assign each task "
            "to one split by a stable hash of its content (or, if every start state is the same, "
            "split by seed: EnvSpec(split_by='seed')).",
        )
    return _distinct(train, relaxed)


def _distinct(train: list[Task], relaxed: dict[str, str]) -> list[Task]:
    """The sample without repeats: a finite train set (tasks from a file) cycles, and a task
    that comes back is the same task (checked above), so it is run once."""
    unique = list({t.id: t for t in train}.values())
    if len(unique) < len(train):
        relaxed["tasks"] = f"the train split has {len(unique)} tasks, fewer than the {len(train)} asked for"
    return unique


def _make(spec: EnvSpec, params: dict[str, Any], call_timeout_s: float) -> Env:
    try:
        env = spec.factory(**params)
    except Exception as exc:
        raise EnvCheckError(f"env {spec.name!r}: factory(**{params}) raised {exc!r}.") from exc
    problem = missing_members(env)
    if problem or not isinstance(env, Env):
        _fail(spec.name, f"factory returned {problem or type(env).__name__ + ', not an Env'}.")
    stops = env.stop_strings
    if (
        isinstance(stops, str)
        or not isinstance(stops, Sequence)
        or not all(isinstance(s, str) and s for s in stops)
    ):
        _fail(
            spec.name,
            f"stop_strings={stops!r}; give a list of non-empty strings, e.g. the close tags of the "
            "calls and the answer (steprl.envs.parsing.stop_strings), or () to stop only at EOS.",
        )
    if not isinstance(env.system_prompt, str):
        _fail(spec.name, f"system_prompt={env.system_prompt!r}; give a str ('' for none).")
    if (odd := text_problem("the env's system_prompt", env.system_prompt)) is not None:
        _fail(spec.name, odd.message)
    return DeadlineEnv(env, call_timeout_s, setting="--call-timeout-s")


async def _reset(spec: EnvSpec, env: Env, task: Task, seed: int) -> str:
    try:
        first = await maybe_await(env.reset(task, seed))
    except EnvTimeout as exc:
        _fail(spec.name, f"reset() on task {task.id!r}: {exc}.")
    except Exception as exc:
        raise EnvCheckError(f"env {spec.name!r}: reset() raised {exc!r} on task {task.id!r}.") from exc
    problem = observation_problem(first)
    if problem is not None:
        _fail(spec.name, problem.message)
    return first.text


async def _step(spec: EnvSpec, env: Env, task: Task, action: str, who: str) -> Transition:
    try:
        result = await maybe_await(env.step(action))
    except EnvTimeout as exc:
        _fail(
            spec.name,
            f"step({action[:80]!r}) by the {who} policy on task {task.id!r}: {exc}.",
        )
    except Exception as exc:
        raise EnvCheckError(
            f"env {spec.name!r}: step({action[:80]!r}) by the {who} policy raised {exc!r} on task "
            f"{task.id!r}. "
            "Model mistakes must become error observations (tools raise ToolError), not exceptions."
        ) from exc
    _check_transition(spec.name, result)
    return result


def _check_transition(name: str, t: object) -> None:
    problem = transition_problem(t)  # the same check as the agent loop's (train, eval, demos)
    if problem is not None:
        _fail(name, problem.message)


async def _episode(
    spec: EnvSpec, env: Env, task: Task, policy: Policy, rng: random.Random, who: str, seed: int
) -> _Episode:
    episode = _Episode(task, seed, await _reset(spec, env, task, seed), [], [])
    history: list[tuple[str, str]] = []
    for _ in range(spec.max_turns):
        try:
            action = policy(task, history, rng)
        except Exception as exc:
            raise EnvCheckError(
                f"env {spec.name!r}: the {who} policy raised {exc!r} on task {task.id!r}."
            ) from exc
        if not isinstance(action, str):
            _fail(spec.name, f"the {who} policy returned {type(action).__name__}; policies return str.")
        transition = await _step(spec, env, task, action, who)
        episode.actions.append(action)
        episode.transitions.append(transition)
        history.append((action, transition.observation))
        if transition.terminated or transition.truncated:
            break
    return episode


async def _replay(spec: EnvSpec, env: Env, episode: _Episode) -> _Episode:
    first = await _reset(spec, env, episode.task, episode.seed)
    replay = _Episode(episode.task, episode.seed, first, list(episode.actions), [])
    for action in episode.actions:
        replay.transitions.append(await _step(spec, env, episode.task, action, "replayed expert"))
    return replay


async def _check_malformed(spec: EnvSpec, env: Env, task: Task, action: str) -> None:
    await _reset(spec, env, task, task.seed)
    t = await _step(spec, env, task, action, "malformed-action")
    if t.info.get("action_kind", "invalid") != "invalid":
        _fail(spec.name, f"malformed action {action[:40]!r} was taken as {t.info.get('action_kind')!r}.")
    if reward_components(t).get("outcome", 0.0) != 0.0:
        _fail(spec.name, f"malformed action {action[:40]!r} earned an outcome reward.")
    if not t.terminated and not t.observation:
        _fail(
            spec.name,
            f"malformed action {action[:40]!r} got an empty observation; tell the model what "
            "was wrong, e.g. '<error>no tool call or answer</error>'.",
        )
