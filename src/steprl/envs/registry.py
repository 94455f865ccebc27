"""The environment registry: one visible dict, `ENVS`, from name to `EnvSpec`.

Built-in environments are listed explicitly in `_builtin_specs` (the only place the core
imports `envs/library/*`); users add their own with `register`. Every registered env is run
through `check_env` in CI (tests/envs/test_check_env.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from typing import Any

from steprl.envs.base import Env
from steprl.envs.spec import EnvSpec, TaskFactory
from steprl.types import Task

__all__ = [
    "ENVS",
    "EnvSpec",
    "TaskFactory",
    "UnknownEnvError",
    "get_spec",
    "make_env",
    "make_tasks",
    "register",
]


class UnknownEnvError(KeyError):
    """An env name that is not registered (a KeyError whose message lists the known names)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown env"


def _builtin_specs() -> dict[str, EnvSpec]:
    """The one explicit list of built-in environments."""
    from steprl.envs.library import apps, calculator, code_interpreter, echo, puzzles, search

    return {
        "calculator": EnvSpec(
            name="calculator",
            factory=calculator.CalculatorEnv,
            tasks=calculator.make_tasks,
            strategies=calculator.STRATEGIES,
            max_turns=8,
            description="multi-turn integer arithmetic with a one-operation calc tool",
        ),
        "code": code_interpreter.SPEC,
        "apps": apps.SPEC,
        **puzzles.SPECS,  # frozenlake, sokoban, bandit
        "search": search.SPEC,
        "echo": echo.SPEC,  # trivial: transport benchmarks and the backend conformance suite
    }


ENVS: dict[str, EnvSpec] = _builtin_specs()


def register(spec: EnvSpec, *, replace: bool = False) -> EnvSpec:
    """Add `spec` to `ENVS` (refuses to shadow a name unless `replace=True`)."""
    if spec.name in ENVS and not replace:
        raise ValueError(f"env {spec.name!r} is already registered; pick another name or pass replace=True.")
    ENVS[spec.name] = spec
    return spec


def get_spec(name: str) -> EnvSpec:
    """The spec registered as `name`; `UnknownEnvError` (a KeyError) lists the known names."""
    try:
        return ENVS[name]
    except KeyError:
        known = ", ".join(sorted(ENVS)) or "(none)"
        raise UnknownEnvError(
            f"unknown env {name!r}; registered envs: {known}. Register new ones with "
            "steprl.envs.registry.register(EnvSpec(...))."
        ) from None


def make_env(name: str, **params: Any) -> Env:
    """A fresh instance of env `name`, built with `params` (the env's constructor kwargs)."""
    return get_spec(name).factory(**params)


def make_tasks(name: str, split: str, seed: int, n: int | None = None, **params: Any) -> Iterator[Task]:
    """Tasks of env `name` (see `EnvSpec.tasks`); at most `n` of them, all when n is None."""
    tasks = get_spec(name).tasks(split, seed, **params)
    return tasks if n is None else islice(tasks, n)
