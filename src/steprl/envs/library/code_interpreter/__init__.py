"""The code-interpreter environment (ToRL): sandboxed Python, generated math word problems."""

from __future__ import annotations

from typing import Any

from steprl.envs.library.code_interpreter.env import CodeInterpreterEnv
from steprl.envs.library.code_interpreter.policies import STRATEGIES
from steprl.envs.library.code_interpreter.runners import SandboxRunner, SessionRunner
from steprl.envs.library.code_interpreter.tasks import make_tasks
from steprl.envs.spec import EnvSpec


def make_env(*, stateful: bool = False, **kwargs: Any) -> CodeInterpreterEnv:
    """`stateful=True` keeps one interpreter per trajectory (variables survive between programs)."""
    return CodeInterpreterEnv(SessionRunner if stateful else SandboxRunner, **kwargs)


SPEC = EnvSpec(
    name="code",
    factory=make_env,
    tasks=make_tasks,
    strategies=STRATEGIES,
    max_turns=4,
    description="ToRL code interpreter: fenced python run in a bubblewrap sandbox; +1/-1 answer reward",
)

__all__ = ["SPEC", "CodeInterpreterEnv", "make_env", "make_tasks"]
