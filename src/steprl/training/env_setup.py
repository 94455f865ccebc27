"""From the config's `env` and `rollout` sections to what train, eval and SFT share: the env
spec (with tasks from a file when `env.task_file` is set), the env pool over the configured
backend, the prompt format, and a first reset that turns an env that cannot start into one line.

Train, `steprl eval` and the SFT warm start all call these, so they see the same env, the
same tasks and the same first prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

from steprl.config import Config
from steprl.envs.base import maybe_await
from steprl.envs.registry import EnvParamsError, EnvSpec, check_params, get_spec, load_plugins
from steprl.errors import UserError
from steprl.hosting.backend import make_backend
from steprl.hosting.pool import EnvPool
from steprl.rollout.chat import PlainFormat, PromptFormat
from steprl.rollout.chat_format import ChatFormat


class EnvStartError(UserError):
    """The env failed its first reset (e.g. an MCP server that exits at start-up)."""


def env_spec(cfg: Config) -> EnvSpec:
    """The spec `env.name` resolves to (after importing `env.plugins`), tasks from `env.task_file`;
    `env.params` and `env.task_params` checked against what its factory and tasks take."""
    load_plugins(cfg.env.plugins)
    spec = get_spec(cfg.env.name, cfg.env.params)
    tf = cfg.env.task_file
    check_params(spec, cfg.env.params, {} if tf is not None else cfg.env.task_params)
    if tf is not None:
        from steprl.envs.task_file import TaskFile, with_task_file

        if cfg.env.task_params:
            raise EnvParamsError(
                f"env.task_params {sorted(cfg.env.task_params)} with env.task_file: tasks from a file "
                "take no task params; remove env.task_params, or put the values in the file's rows"
            )
        spec = with_task_file(spec, TaskFile(**tf.model_dump()))
    return spec


@contextlib.contextmanager
def env_pool(cfg: Config) -> Iterator[EnvPool]:
    """The env pool over `runtime.backend`, closed however the block ends."""
    backend = make_backend(cfg.env.name, cfg.env.params, cfg.runtime, tuple(cfg.env.plugins))
    envs = EnvPool(backend, cfg.runtime.max_concurrent_envs)
    try:
        yield envs
    finally:
        envs.close()


def budgets(cfg: Config) -> tuple[int, int, int]:
    """(max_turns, max_tokens_per_turn, max_total_tokens) of `rollout`: RL, eval and demos alike."""
    r = cfg.rollout
    return r.max_turns, r.max_tokens_per_turn, r.max_total_tokens


def system_prompt_mode(cfg: Config) -> str:
    """`rollout.system_prompt` with "auto" resolved: "none" for the tiny model, else "env"."""
    mode = cfg.rollout.system_prompt
    if mode == "auto":
        return "none" if cfg.model.name == "tiny" else "env"
    return mode


def prompt_format(cfg: Config, tokenizer: Any) -> PromptFormat:
    """`model.format`: "chat" (the tokenizer's template, exact deltas), "plain" (BOS + text), or
    "auto": chat when the tokenizer has a template (the tiny one has none)."""
    kind = cfg.model.format
    if kind == "auto":
        kind = "chat" if getattr(tokenizer, "chat_template", None) else "plain"
    if kind == "chat":
        return ChatFormat(tokenizer, system_prompt=system_prompt_mode(cfg))
    return PlainFormat(tokenizer, system_prompt=system_prompt_mode(cfg))


class TemplateMismatch(UserError):
    """The chat template does not render incrementally as it renders whole (see check-template)."""


#: Context rules whose rows follow the incremental stream: the ones the template check is for.
_CHECKED_RULES = ("append_only", "keep_thinking", "strip_thinking")


def check_prompt_format(fmt: PromptFormat, cfg: Config, log: Callable[[str], None] = print) -> bool:
    """Run the template checker for the run's context rule before any work. Returns True when
    training must use one row per turn: the check failed and `rollout.template_mismatch` is
    "per_turn". A failed check is refused otherwise, in one line saying where and what to set."""
    from steprl.rollout.template_check import check_template, startup_conversations

    ctx = cfg.rollout.context
    if not isinstance(fmt, ChatFormat) or ctx not in _CHECKED_RULES:
        return False
    report = check_template(fmt, startup_conversations(ctx), context=ctx)
    log(f"chat template check: {report.summary()}")
    if report.ok:
        return False
    if cfg.rollout.template_mismatch == "per_turn":
        log(
            "  rollout.template_mismatch=per_turn: training one row per turn, each on the prompt it was shown"
        )
        return True
    raise TemplateMismatch(
        f"the chat template of {cfg.model.name!r} fails the incremental-render check "
        f"({report.breaks[0].describe()}); set rollout.template_mismatch=per_turn to train one row "
        "per turn on exactly what the engine was shown, or fix the template (model.chat_template)"
        + (
            "; for a template that strips earlier reasoning use rollout.context=strip_thinking"
            if ctx != "strip_thinking"
            else ""
        )
    )


def check_env_starts(envs: EnvPool, spec: EnvSpec, cfg: Config, log: Callable[[str], None] = print) -> None:
    """Reset one env on the first train task and close it, before any work. An env that says
    it cannot start (a `UserError`: an MCP server that exits at start-up, with its stderr; a bad
    command) stops the run here, as one line. Any other failure is logged and the run goes on:
    a flaky env is the failure budget's business (`runtime.failure_budget`), step by step."""
    task = next(iter(islice(spec.tasks("train", cfg.run.seed, **cfg.env.task_params), 1)), None)
    if task is None:
        raise EnvStartError(
            f"env {cfg.env.name!r} has no train tasks; check env.task_params or env.task_file"
        )

    async def first_reset() -> None:
        env = envs.make_env(task)
        try:
            await maybe_await(env.reset(task, task.seed))
        finally:
            await maybe_await(env.close())

    try:
        asyncio.run(first_reset())
    except UserError:
        raise
    except Exception as exc:
        log(
            f"WARNING: env {cfg.env.name!r} failed its first reset (task {task.id!r}): "
            f"{type(exc).__name__}: {exc}; failed episodes are counted in end/infra_failed"
        )
