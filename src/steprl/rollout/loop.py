"""The one agent loop: generate, let the env answer, append the observation, repeat.

Many episodes run concurrently on one asyncio loop; the engine batches their requests. Each
episode gets its own env instance. An exception from the env (or the engine) never escapes: the
trajectory ends `infra_failed` with the error in `info`, is counted, and is never trained on.
So does an answer that breaks the env contract (`envs/contract.py`, what `check-env` checks: a
str or NaN reward, ...), with the reason in `info["invalid"]`.
"""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace

from steprl.engines.base import Engine, SamplingParams
from steprl.envs.base import Env, EnvTimeout, Transition, env_tools, maybe_await
from steprl.envs.contract import (
    ContractError,
    Problem,
    observation_problem,
    reward_components,
    text_problem,
    transition_problem,
)
from steprl.rollout import seeds
from steprl.rollout.chat import PromptFormat, tool_schemas
from steprl.rollout.context import ContextRule
from steprl.types import NOT_TRAINABLE, EndReason, Group, Step, Task, Trajectory


@dataclass(frozen=True)
class Budgets:
    """Per-episode limits. Hitting one ends the episode `truncated` (not the policy's fault).
    Every trajectory records the turn cap it ran under (`info["turn_cap"]`) and whether that cap
    ended it (`info["cut_by_cap"]`): a horizon curriculum sets the cap per admitted task."""

    max_turns: int = 6
    max_tokens_per_turn: int = 48
    max_total_tokens: int = 512  # cap on the context length (prompt + next action)


def _end_reason(t: Transition) -> EndReason | None:
    if t.terminated:
        return EndReason.POLICY_ERROR if t.info.get("policy_error") else EndReason.ANSWERED
    if t.truncated:
        return EndReason.TRUNCATED
    return None


async def run_episode(
    env: Env,
    task: Task,
    *,
    engine: Engine,
    fmt: PromptFormat,
    rule: ContextRule,
    sampling: SamplingParams,
    budgets: Budgets,
    group_id: str,
    seed: int,
) -> Trajectory:
    """Run one episode to its end and return it as a frozen Trajectory (never raises)."""
    steps: list[Step] = []
    history: list[tuple[tuple[int, ...], tuple[int, ...], bool]] = []
    messages: list[dict[str, str]] = []  # the conversation as text: for the template check only
    end = EndReason.TRUNCATED
    info: dict[str, object] = {}
    cut_by_cap = False
    try:
        _check(text_problem(f"task {task.id!r}'s prompt", task.prompt))  # a task file's "\ud800"
        first = await maybe_await(env.reset(task, seed))
        _check(observation_problem(first))
        _check(text_problem("the env's system_prompt", env.system_prompt))
        tools = tool_schemas(env_tools(env))  # read after reset: MCP lists them then
        initial = fmt.initial_ids(env.system_prompt, first.text, tools)
        messages.append({"role": "user", "content": first.text})
        stop_ids, stop_seqs = fmt.stop_tokens(env.stop_strings)
        for _turn in range(budgets.max_turns):
            prompt = rule.next_prompt(initial, history)
            room = min(budgets.max_tokens_per_turn, budgets.max_total_tokens - len(prompt))
            if room <= 0:
                break  # context budget exhausted: truncated
            version = engine.version
            gen = await engine.generate(
                prompt,
                replace(sampling, max_new_tokens=room, stop_token_ids=stop_ids, stop_sequences=stop_seqs),
                seed=seeds.turn_seed(seed, _turn),
            )
            action_text = fmt.decode(gen.token_ids)
            transition = await maybe_await(env.step(action_text))
            _check(transition_problem(transition))  # what check-env rejects never trains
            reason = _end_reason(transition)
            # the env's reply to an answer is a user turn; to a call (or a malformed one), a tool
            # result; an env that answers as the (simulated) user says so: info["role"] == "user"
            role = transition.info.get("role")
            tool_result = (
                role != "user" if role is not None else transition.info.get("action_kind") != "answer"
            )
            # an empty tool result still closes the turn and opens the next one (chat formats);
            # only the observation that ends the episode may be empty and add nothing
            obs_ids = (
                fmt.observation_ids(transition.observation, action_ids=gen.token_ids, tool_result=tool_result)
                if transition.observation or reason is None
                else ()
            )
            messages += [
                {"role": "assistant", "content": action_text},
                {"role": "tool" if tool_result else "user", "content": transition.observation},
            ]
            steps.append(
                Step(
                    prompt_ids=prompt,
                    action_ids=gen.token_ids,
                    action_logprobs=gen.logprobs,
                    observation_ids=obs_ids,
                    reward=float(transition.reward),
                    policy_version=version,
                    info={
                        **transition.info,
                        "reward_components": reward_components(transition),
                        "finish_reason": gen.finish_reason,
                    },
                    # () when one version sampled the whole turn (always, when synchronous)
                    action_versions=gen.versions if set(gen.versions) - {version} else (),
                )
            )
            history.append((gen.token_ids, obs_ids, not tool_result))
            if reason is not None:
                end = reason
                break
        else:  # the turn cap ended it (recorded: a curriculum's cap changes, a stale sample keeps its own)
            cut_by_cap = True
        if rule.append_only and len(steps) > 1 and getattr(fmt, "checks_template", False):
            # would a harness that re-templates the text every turn have shown the same ids?
            try:  # a diagnostic: a template that cannot re-render the text never fails the episode
                whole = fmt.rerender_ids(env.system_prompt, messages[: 2 * len(steps) - 1], tools)
                info["template_match"] = whole == steps[-1].prompt_ids
            except Exception as exc:
                info["template_match"] = False
                info["template_error"] = f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # env/engine bug, outage or deadline: counted, excluded from the loss
        end = EndReason.ENV_TIMEOUT if isinstance(exc, EnvTimeout) else EndReason.INFRA_FAILED
        info = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=5)}
        if isinstance(exc, ContractError):
            info["invalid"] = exc.reason  # counted by reason (metrics infra/invalid/<reason>)
    try:
        await maybe_await(env.close())
    except Exception as exc:
        info = {**info, "close_error": f"{type(exc).__name__}: {exc}"}
    return Trajectory(
        task_id=task.id,
        group_id=group_id,
        env=task.env,
        steps=tuple(steps),
        outcome_reward=sum(s.reward for s in steps) if end not in NOT_TRAINABLE else 0.0,
        end=end,
        info={**info, "turn_cap": budgets.max_turns, "cut_by_cap": cut_by_cap and end is EndReason.TRUNCATED},
    )


def _check(problem: Problem | None) -> None:
    if problem is not None:
        raise ContractError(problem)


def creation_failed(task: Task, group_id: str, exc: Exception) -> Trajectory:
    """The trajectory of an episode whose env could not be made: `infra_failed`, no steps."""
    info = {"error": f"env creation failed: {type(exc).__name__}: {exc}"}
    return Trajectory(task.id, group_id, task.env, (), 0.0, EndReason.INFRA_FAILED, info)


def failed_group(task: Task, index: int, group_size: int, seed: int, why: str) -> Group:
    """The group of a task whose episodes never came back (a dead worker, a crashed producer):
    `infra_failed`, counted, never trained on."""
    failed = Trajectory(
        task.id, seeds.group_id(seed, index), task.env, (), 0.0, EndReason.INFRA_FAILED, {"error": why}
    )
    return Group(task, (failed,) * group_size)


#: An episode the agent loop does not run (a harness env's: `gateway/harness_runner.py`):
#: (task, the set-up, group id, episode seed) -> its trajectory. Never raises.
EpisodeRunner = Callable[[Task, "RolloutSetup", str, int], Awaitable[Trajectory]]


def _no_runner(task: Task) -> EpisodeRunner | None:
    return None


@dataclass(frozen=True)
class RolloutSetup:
    """Everything an episode needs besides its task: how to make the env, the engine, the prompt
    format, the context rule, how to sample and the budgets; `runner_for` gives the runner of a
    task whose episodes are not the agent loop's (None: the loop runs it)."""

    make_env: Callable[[Task], Env]
    engine: Engine
    fmt: PromptFormat
    rule: ContextRule
    sampling: SamplingParams
    budgets: Budgets
    runner_for: Callable[[Task], EpisodeRunner | None] = field(default=_no_runner)


async def rollout_groups(
    tasks: Sequence[Task], group_size: int, setup: RolloutSetup, *, seed: int, first_index: int = 0
) -> list[Group]:
    """Run `group_size` episodes of every task concurrently; one fresh env per episode.

    `first_index` is the position of `tasks[0]` in the whole batch: a worker that runs a share
    of the batch passes it, so group ids and episode seeds (hence sampled tokens) are the same
    as if one process had run the whole batch.
    """

    async def one(task: Task, t_index: int, i: int) -> Trajectory:
        runner = setup.runner_for(task)
        if runner is not None:  # a harness drives this episode, through the gateway
            episode = seeds.episode_seed(seed, t_index, i)
            try:
                return await runner(task, setup, seeds.group_id(seed, t_index), episode)
            except Exception as exc:  # a runner bug: counted, never trained on, the batch goes on
                why = {"error": f"the episode runner failed: {type(exc).__name__}: {exc}"}
                gid = seeds.group_id(seed, t_index)
                return Trajectory(task.id, gid, task.env, (), 0.0, EndReason.INFRA_FAILED, why)
        try:
            env = setup.make_env(task)
        except Exception as exc:
            return creation_failed(task, seeds.group_id(seed, t_index), exc)
        return await run_episode(
            env,
            task,
            engine=setup.engine,
            fmt=setup.fmt,
            rule=setup.rule,
            sampling=setup.sampling,
            budgets=setup.budgets,
            group_id=seeds.group_id(seed, t_index),
            seed=seeds.episode_seed(seed, t_index, i),
        )

    coros = [one(task, first_index + t, i) for t, task in enumerate(tasks) for i in range(group_size)]
    flat = await asyncio.gather(*coros)
    return [
        Group(task=task, trajectories=tuple(flat[t * group_size : (t + 1) * group_size]))
        for t, task in enumerate(tasks)
    ]
