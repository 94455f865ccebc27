"""The environment registry: one visible dict, `ENVS`, from name to `EnvSpec`, and how an
`env.name` from a config becomes a spec.

`env.name` takes one of four forms, tried in this order (`get_spec`):

1. a registered name: a built-in (`_builtin_specs`, the only place the core imports
   `envs/library/*`) or one added with `register`, e.g. by a `--plugin` module;
2. a family, whose spec is built from the env's params (`FAMILIES`): ``gym`` (any Gymnasium
   id), ``mcp`` (any MCP server), ``synth`` (``path``: a package `steprl synth` wrote, or
   ``spec``: a tool-doc YAML synthesized as the run starts) and ``harness`` (a user's agent
   harness run against the gateway, `envs/harness.py`);
3. an import path, ``package.module:attr``, where attr is an `EnvSpec` or a zero-argument
   function returning one;
4. a name that an installed package registers in the ``steprl.envs`` entry-point group
   (``[project.entry-points."steprl.envs"] my_env = "my_pkg.envs:SPEC"``).

Every process that builds envs (the trainer, an HTTP env server, a Ray worker) resolves names
the same way, after importing the run's plugins (`load_plugins`). A plugin that fails to
import, or a path to something that is not a spec, is one line (`EnvLoadError`, a `UserError`).
Every built-in env is run through `check_env` in CI (tests/envs/test_check_env.py).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import islice
from typing import Any

from steprl.envs.base import Env
from steprl.envs.spec import EnvSpec, TaskFactory
from steprl.errors import UserError
from steprl.registry import Registry, import_module, instance_of, load_attr
from steprl.types import Task

__all__ = [
    "ENTRY_POINT_GROUP",
    "ENVS",
    "FAMILIES",
    "EnvLoadError",
    "EnvParamsError",
    "EnvSpec",
    "TaskFactory",
    "UnknownEnvError",
    "check_params",
    "get_spec",
    "load_plugins",
    "make_env",
    "make_tasks",
    "register",
]

#: The entry-point group where installed packages name their envs.
ENTRY_POINT_GROUP = "steprl.envs"


class EnvLoadError(UserError):
    """An env name, plugin or import path that does not give an `EnvSpec` (one line: what and why)."""


class UnknownEnvError(EnvLoadError, KeyError):
    """An env name that is not registered (a KeyError whose message lists the known names)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown env"


class EnvParamsError(EnvLoadError):
    """`env.params` or `env.task_params` that the env's factory or task generator does not take."""


def _builtin_specs() -> dict[str, EnvSpec]:
    """The one explicit list of built-in environments."""
    from steprl.envs.library import (
        apps,
        calculator,
        code_interpreter,
        collapse,
        echo,
        gridwalk,
        guess_number,
        horizon,
        latency,
        puzzles,
        search,
    )

    return {
        "calculator": EnvSpec(
            name="calculator",
            factory=calculator.CalculatorEnv,
            tasks=calculator.make_tasks,
            strategies=calculator.STRATEGIES,
            max_turns=8,
            description="multi-turn integer arithmetic with a one-operation calc tool",
        ),
        # the calculator with a lognormal delay per reply (asynchronous training benchmarks)
        "calculator_slow": EnvSpec(
            name="calculator_slow",
            factory=latency.slow_calculator,
            tasks=latency.make_tasks,
            strategies=calculator.STRATEGIES,
            max_turns=8,
            description="the calculator, each reply after a long-tailed (lognormal) delay",
        ),
        "code": code_interpreter.SPEC,
        "apps": apps.SPEC,
        **puzzles.SPECS,  # frozenlake, sokoban, bandit
        "search": search.SPEC,
        "echo": echo.SPEC,  # trivial: transport benchmarks and the backend conformance suite
        "corridor": horizon.SPEC,  # needs exactly k turns: horizon curricula (benchmarks/steering_horizon.py)
        **collapse.SPECS,  # calculator_phrase, calculator_flat: induced collapses (benchmarks/health.py)
        "guess_number": guess_number.SPEC,  # a probe tool the policy may abandon (tool abandonment)
        "gridwalk": gridwalk.SPEC,  # every step labelled optimal or not: scores learned step credit
    }


def _gym_family(params: Mapping[str, Any]) -> EnvSpec:
    from steprl.envs.adapters.gym_yaml import gym_spec  # the gym extra, imported when used

    return gym_spec(params)


def _synth_family(params: Mapping[str, Any]) -> EnvSpec:
    from steprl.envs.synth.package import load_package, spec_from_yaml
    from steprl.envs.synth.spec import TaskGen
    from steprl.envs.synth.users import user_from_params

    tasks_keys = set(TaskGen.__dataclass_fields__)
    unknown = sorted(set(params) - {"path", "spec", "user", "allow_written_code"} - tasks_keys)
    if unknown:
        raise EnvParamsError(
            f"env.params.{unknown[0]}: not a parameter of env synth; allowed: path or spec, user, "
            f"allow_written_code, and with spec the keys of its tasks: ({', '.join(sorted(tasks_keys))})"
        )
    allow = params.get("allow_written_code", False)  # the spec's written code may run (in the sandbox)
    if not isinstance(allow, bool):
        raise EnvParamsError(f"env.params.allow_written_code: must be true or false, got {allow!r}")
    if "path" in params and set(params) & tasks_keys:
        raise EnvParamsError(
            f"env.params: {sorted(set(params) & tasks_keys)} change how tasks are made, and a package "
            "(path:) holds tasks already made; synthesize from the YAML with spec: instead"
        )
    user_from_params(params.get("user"))  # a bad `user:` is one line at start-up, not per episode
    if "path" in params:  # a package `steprl synth` wrote
        return load_package(str(params["path"]), name="synth", allow_written_code=allow)
    if "spec" in params:  # a tool-doc YAML, synthesized as the run starts (deterministic)
        overrides = {k: v for k, v in params.items() if k in tasks_keys}  # its tasks: keys
        return spec_from_yaml(str(params["spec"]), name="synth", allow_written_code=allow, **overrides)
    raise EnvParamsError(
        "env synth: env.params needs path (a directory steprl synth wrote) or spec (a tool-doc YAML)"
    )


def _harness_family(params: Mapping[str, Any]) -> EnvSpec:
    from steprl.envs.harness import HarnessParamsError, check_run, harness_spec

    path, inner = params.get("run"), params.get("tasks")
    if not isinstance(path, str) or ":" not in path:
        raise HarnessParamsError(
            "env.params.run: the harness, as package.module:function (async def run(task, client) -> float)"
        )
    if not isinstance(inner, str) or not inner or inner == "harness":
        raise HarnessParamsError(
            "env.params.tasks: the env whose tasks (and demonstrations) the harness plays, e.g. calculator"
        )
    fn = load_attr(path, "env.params.run", HarnessParamsError)
    return harness_spec(params, check_run(fn, path), get_spec(inner, params.get("env_params") or {}))


def _mcp_family(params: Mapping[str, Any]) -> EnvSpec:
    from steprl.envs.adapters.mcp_yaml import mcp_spec  # the mcp extra, imported when used

    return mcp_spec(params)


ENVS: Registry[EnvSpec] = Registry(
    _builtin_specs(),
    key="env",
    what="env",
    accept=instance_of(EnvSpec),
    expected="an EnvSpec",
    params=lambda spec: spec.factory,  # env.task_params: `check_params` below, with the factory's
    params_key="env.params",
    skip=0,
    checker="steprl.envs.check:check_env",
    cheap=False,  # episodes of every env (tests/envs/test_check_env.py)
)

#: Families: env names whose spec is built from `env.params` (the spec's factory takes the
#: same params), so a Gymnasium id or an MCP server trains from YAML alone.
FAMILIES: Registry[Callable[[Mapping[str, Any]], EnvSpec]] = Registry(
    {
        "gym": _gym_family,
        "harness": _harness_family,
        "mcp": _mcp_family,
        "synth": _synth_family,
    },
    key="env",
    what="env family",
    accept=inspect.isfunction,
    expected="a family; name a function (params) -> EnvSpec",
    checker=None,
    checked_by="check_spec over the specs a family builds from its params (tests/envs)",
)

_FAMILY_SPECS: dict[str, EnvSpec] = {}  # (family, params) -> its spec, built once per process


def register(spec: EnvSpec, *, replace: bool = False) -> EnvSpec:
    """Add `spec` to `ENVS` (refuses to shadow a name unless `replace=True`)."""
    if (spec.name in ENVS or spec.name in FAMILIES) and not replace:
        raise ValueError(f"env {spec.name!r} is already registered; pick another name or pass replace=True.")
    ENVS[spec.name] = spec
    return spec


def load_plugins(modules: Sequence[str]) -> None:
    """Import each module (they call `register`); one that fails is an `EnvLoadError` naming it.
    Modules in the working directory are found too."""
    for module in modules:
        try:
            import_module(module)
        except (Exception, SystemExit) as exc:  # a plugin that calls sys.exit() on import, too
            raise EnvLoadError(
                f"plugin {module!r} failed to import: {type(exc).__name__}: {exc}. "
                "Is its package installed in this environment (pip install -e <your package>)?"
            ) from None


def get_spec(name: str, params: Mapping[str, Any] | None = None) -> EnvSpec:
    """The spec for `name` in any of the four forms of the module docstring.

    `params` (the config's `env.params`) are needed only by families; `UnknownEnvError` lists
    the names known here.
    """
    spec = ENVS.get(name)
    if spec is not None:
        return spec
    if name in FAMILIES:
        key = f"{name}:{json.dumps(dict(params or {}), sort_keys=True, default=repr)}"
        if key not in _FAMILY_SPECS:
            _FAMILY_SPECS[key] = FAMILIES[name](dict(params or {}))
        return _FAMILY_SPECS[key]
    spec = _from_import_path(name) if ":" in name else _from_entry_point(name)
    ENVS[name] = spec  # loaded once per process, under the name it was asked for
    return spec


def _as_spec(obj: object, where: str) -> EnvSpec:
    """`obj` if it is an `EnvSpec`, else what a zero-argument function `obj` returns."""
    if isinstance(obj, EnvSpec):
        return obj
    if callable(obj) and not isinstance(obj, type):
        try:
            made = obj()
        except Exception as exc:
            raise EnvLoadError(f"{where}: calling it raised {type(exc).__name__}: {exc}") from None
        if isinstance(made, EnvSpec):
            return made
        raise EnvLoadError(f"{where} returned a {type(made).__name__}, not an EnvSpec")
    raise EnvLoadError(
        f"{where} is a {type(obj).__name__}, not an EnvSpec or a zero-argument function returning one"
    )


def _from_import_path(path: str) -> EnvSpec:
    return _as_spec(load_attr(path, "env", EnvLoadError), f"env {path!r}")


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _from_entry_point(name: str) -> EnvSpec:
    points = _entry_points()
    ep = points.get(name)
    if ep is None:
        known = ", ".join(sorted({*ENVS, *FAMILIES, *points})) or "(none)"
        raise UnknownEnvError(
            f"unknown env {name!r}; known envs: {known}. Give a registered name, a family (gym, mcp), "
            "an import path package.module:attr, or a name in the 'steprl.envs' entry-point group; "
            "--plugin MODULE imports a module that registers envs."
        )
    where = f"env {name!r} (entry point {ep.value!r} of {ep.dist.name if ep.dist else 'a package'})"
    try:
        obj = ep.load()
    except Exception as exc:
        raise EnvLoadError(f"{where}: loading it failed: {type(exc).__name__}: {exc}") from None
    return _as_spec(obj, where)


def _keywords(fn: Callable[..., Any], skip: int) -> tuple[list[str], list[str]] | None:
    """(accepted, required) keyword names of `fn` after its first `skip` parameters; None when
    it takes **kwargs (it checks them itself: the gym and mcp families, wrappers) or has no
    signature."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    named = [p for p in params if p.kind is not p.VAR_POSITIONAL][skip:]
    named = [p for p in named if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return [p.name for p in named], [p.name for p in named if p.default is p.empty]


def check_params(spec: EnvSpec, params: Mapping[str, Any], task_params: Mapping[str, Any]) -> None:
    """`params` must be keyword arguments of `spec.factory`, `task_params` of `spec.tasks`
    (after its split and seed): a bad key is one line now, not a TypeError in the first episode."""
    for key, fn, given, skip, what in (
        ("env.params", spec.factory, params, 0, "its factory"),
        ("env.task_params", spec.tasks, task_params, 2, "its task generator"),
    ):
        keywords = _keywords(fn, skip)
        if keywords is None:
            continue
        accepted, required = keywords
        unknown = sorted(set(given) - set(accepted))
        missing = [k for k in required if k not in given]
        if unknown or missing:
            problem = (
                f"unknown key(s) {', '.join(unknown)}" if unknown else f"missing key(s) {', '.join(missing)}"
            )
            raise EnvParamsError(
                f"{key}: {problem} for env {spec.name!r}; allowed keys ({what}): "
                f"{', '.join(accepted) or '(none)'}"
            )


def make_env(name: str, **params: Any) -> Env:
    """A fresh instance of env `name`, built with `params` (the env's constructor kwargs)."""
    return get_spec(name, params).factory(**params)


def make_tasks(name: str, split: str, seed: int, n: int | None = None, **params: Any) -> Iterator[Task]:
    """Tasks of env `name` (see `EnvSpec.tasks`); at most `n` of them, all when n is None."""
    tasks = get_spec(name).tasks(split, seed, **params)
    return tasks if n is None else islice(tasks, n)
