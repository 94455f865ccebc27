"""Demonstrations through the one agent loop: an env's scripted strategies play `run_episode`.

The SFT warm start needs transcripts of the env's strategies (expert, guess, ...). They are
played by the same `run_episode` as RL and evaluation, with a `StrategyEngine` in place of
the model, so every env the trainer can run (sync or async, MCP, behind HTTP or Ray) gives
demonstrations, tokenized exactly as rollouts are, and many episodes run concurrently
(bounded by the env pool behind `make_env`).

A strategy is a `Policy`: (task, history of (action, observation), rng) -> next action text.
The engine learns the observations through `_Recorder`, which wraps the episode's env: the
engine only ever sees token ids, and decoding the context back to text would re-tokenize.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypedDict, Unpack

from steprl.engines.base import Generation, SamplingParams
from steprl.engines.weights import AnyUpdate
from steprl.envs.base import Env, EnvWrapper, Observation, Transition, maybe_await
from steprl.envs.policy import Policy
from steprl.rollout import seeds
from steprl.rollout.chat import PromptFormat
from steprl.rollout.context import ContextRule
from steprl.rollout.loop import Budgets, creation_failed, run_episode
from steprl.types import Task, Trajectory


@dataclass(frozen=True)
class Demonstration:
    """One played episode: which strategy played it, and the trajectory the agent loop recorded."""

    strategy: str
    trajectory: Trajectory


class _Recorder(EnvWrapper):
    """Wraps one episode's env: passes every call through and keeps (action, observation) pairs
    for the strategy. The actions are the strategy's own text, as it wrote them."""

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        self.history: list[tuple[str, str]] = []
        self.pending: str | None = None  # the action the engine just produced

    async def reset(self, task: Task, seed: int) -> Observation:
        return await maybe_await(self.env.reset(task, seed))

    async def step(self, action: str) -> Transition:
        transition = await maybe_await(self.env.step(action))
        self.history.append((self.pending if self.pending is not None else action, transition.observation))
        return transition

    def close(self) -> None | Awaitable[None]:
        return self.env.close()


class StrategyEngine:
    """An `Engine` for one episode: its next action is the strategy's, encoded once.

    Log-probs are 0.0 (the demonstrations are targets of cross-entropy, not of a ratio).
    """

    def __init__(
        self, policy: Policy, task: Task, rng: random.Random, recorder: _Recorder, fmt: PromptFormat
    ) -> None:
        self.policy, self.task, self.rng, self.recorder, self.fmt = policy, task, rng, recorder, fmt

    @property
    def version(self) -> int:
        return 0

    def update_weights(self, state_dict: AnyUpdate, version: int) -> None:
        raise TypeError("a StrategyEngine plays a scripted policy; it has no weights")

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, *, seed: int | None = None
    ) -> Generation:
        action = self.policy(self.task, list(self.recorder.history), self.rng)
        # demo actions are text: encoded once, here, as a model would write them (tags as tokens)
        ids = tuple(self.fmt.template_ids(action))
        if len(ids) > sampling.max_new_tokens:  # cut where the model's turn would be cut
            ids = ids[: sampling.max_new_tokens]
            self.recorder.pending = None  # the env gets (and the history keeps) the cut text
            return Generation(ids, (0.0,) * len(ids), "length")
        self.recorder.pending = action
        return Generation(ids, (0.0,) * len(ids), "stop")


class DemoPlay(TypedDict):
    """How demonstrations are played: the keywords of `play_demos`, which
    `training.setup.sft.make_demos` passes through unchanged (declared once, here)."""

    strategies: Mapping[str, Policy]
    weights: Mapping[str, float]
    make_env: Callable[[Task], Env]
    fmt: PromptFormat
    seed: int
    rule: ContextRule
    budgets: Budgets


async def play_demos(tasks: Sequence[Task], **play: Unpack[DemoPlay]) -> list[Demonstration]:
    """Play each task once with a strategy drawn by weight, all episodes concurrently, under the
    context rule and budgets RL uses (so a demonstration shows only what a rollout can).

    Deterministic in `seed`: the draw of strategies is sequential, and each episode has its own
    rng and env seed, so neither the order in which episodes finish nor the env backend changes
    what is played (env randomness aside). Failed episodes come back `infra_failed`, as in RL.
    """
    strategies, weights, make_env, fmt = play["strategies"], play["weights"], play["make_env"], play["fmt"]
    seed, rule, budgets = play["seed"], play["rule"], play["budgets"]
    unknown = sorted(set(weights) - set(strategies))
    if unknown:
        raise ValueError(f"model.sft.strategies names {unknown}; this env offers: {sorted(strategies)}")
    draw = random.Random(seed)
    names = sorted(weights)
    chosen = [draw.choices(names, [weights[n] for n in names])[0] for _ in tasks]

    async def one(index: int, task: Task) -> Demonstration:
        try:
            recorder = _Recorder(make_env(task))
        except Exception as exc:  # as rollout_groups does: the episode fails, the others go on
            return Demonstration(chosen[index], creation_failed(task, f"demo-{seed}-{index}", exc))
        engine = StrategyEngine(
            strategies[chosen[index]], task, random.Random(f"{seed}-{index}"), recorder, fmt
        )
        trajectory = await run_episode(
            recorder,
            task,
            engine=engine,
            fmt=fmt,
            rule=rule,
            sampling=SamplingParams(temperature=0.0),
            budgets=budgets,
            group_id=f"demo-{seed}-{index}",
            seed=seeds.demo_seed(seed, index),
        )
        return Demonstration(chosen[index], trajectory)

    return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))))
