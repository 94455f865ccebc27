"""Run components: the parts of a run that live across RL steps and must survive a resume.

A task source (what the next step trains on) and a controller (what the step's results change:
the KL coefficient, a stop) are both components: each says what it carries between steps as a
plain dict, and the checkpoint stores every component's dict under its name
(`component_states`), so a resume restores each one exactly (`load_component_states`) and no
`TrainState` field, `make_batch` keyword or `if` in the trainer is added for a new one.

What a `state_dict` holds must be what `torch.save` writes and `torch.load(weights_only=True)`
reads back: numbers, strings, bools, None, lists, tuples, dicts and tensors.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from steprl.config import ConfigError
from steprl.errors import UserError


@runtime_checkable
class Stateful(Protocol):
    """Anything that lives across steps: its state out, and back in, exactly."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def component_states(components: Mapping[str, Stateful]) -> dict[str, dict[str, Any]]:
    """Every component's state, by name: what a checkpoint stores."""
    return {name: component.state_dict() for name, component in components.items()}


def load_component_states(components: Mapping[str, Stateful], saved: Mapping[str, Mapping[str, Any]]) -> None:
    """Restore each component from a checkpoint's `component_states`. A component the run has
    and the checkpoint lacks (or the reverse) is an error that names it: resuming it from
    nothing would silently continue a different run."""
    missing, extra = set(components) - set(saved), set(saved) - set(components)
    if missing or extra:
        raise UserError(  # one line: e.g. a resume under run.allow_config_change that changed kl_ctrl
            f"the checkpoint's run components do not match this run's: missing {sorted(missing)}, "
            f"unexpected {sorted(extra)}; resume with the configuration the run was started with"
        )
    for name, component in components.items():
        component.load_state_dict(saved[name])


def load_attr(path: str, key: str) -> Any:
    """What the import path ``package.module:attr`` names: a component of your own, given in the
    config key `key` (`env.source`, `trainer.controllers`). The working directory is searched
    too (appended: it never shadows), as for envs. A path that does not resolve is one line."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{key}: {path!r} is not an import path; it looks like package.module:attr")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(
            f"{key} {path!r}: {type(exc).__name__}: {exc}; an import path looks like "
            "package.module:attr, its module importable from this environment"
        ) from None
    return obj


def by_name(
    name: str, table: Mapping[str, Any], key: str, what: str, *, accept: Callable[[Any], bool], expected: str
) -> Any:
    """`table[name]`, or what the import path `name` names (`load_attr`): the one lookup of the
    config keys that take "a name of this dict or package.module:attr of your own" (`env.source`,
    `trainer.controllers`, `algorithm.step_reward.kind`). Any other name is one line listing the
    dict. An imported object that `accept` refuses is one line too, `{key} {name!r} is <what it
    is>, not {expected}`, before anything calls it: `os:system` is callable, and was called with
    the run's arguments."""
    if name in table:
        return table[name]
    if ":" not in name:
        raise ConfigError(
            f"{key}: unknown {what} {name!r}; use one of {sorted(table)} "
            "or the import path package.module:attr of your own"
        )
    obj = load_attr(name, key)
    if not accept(obj):
        raise ConfigError(f"{key} {name!r} is {describe(obj)}, not {expected}")
    return obj


def describe(obj: Any) -> str:
    """What `obj` is, in a few words: `the class Foo`, `a builtin_function_or_method`."""
    return f"the class {obj.__name__}" if isinstance(obj, type) else f"a {type(obj).__name__}"


def class_with(*methods: str) -> Callable[[Any], bool]:
    """A check for `by_name`'s `accept`: a class that defines each of `methods` (a protocol's)."""
    return lambda obj: isinstance(obj, type) and all(callable(getattr(obj, m, None)) for m in methods)


__all__ = [
    "Stateful",
    "by_name",
    "class_with",
    "component_states",
    "describe",
    "load_attr",
    "load_component_states",
]
