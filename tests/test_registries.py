"""Every registry, every entry: the same lookup (a name, or the import path `package.module:attr`),
the same one-line errors, the same params check, and the registry's checker where it is cheap
(the others' own tests run theirs: `Registry.checked_by`, or `cheap=False`)."""

from __future__ import annotations

import importlib
import inspect

import pytest

from steprl.errors import ConfigError
from steprl.registry import Registry

#: where each registry lives (module, attr): the entries below are read from the registries
HOMES = (
    ("steprl.algorithms", "ADVANTAGES"),
    ("steprl.algorithms", "POLICY_LOSSES"),
    ("steprl.algorithms", "GROUP_FILTERS"),
    ("steprl.rollout.context", "CONTEXT_RULES"),
    ("steprl.training.sources", "TASK_SOURCES"),
    ("steprl.training.controllers", "CONTROLLERS"),
    ("steprl.training.step_rewards", "STEP_REWARDS"),
    ("steprl.training.learn.critic", "CRITICS"),
    ("steprl.engines.registry", "ENGINES"),
    ("steprl.engines.transports", "WEIGHT_SYNC"),
    ("steprl.health.actions", "ACTIONS"),
    ("steprl.health.signals", "SIGNALS"),
    ("steprl.report.registry", "SECTIONS"),
    ("steprl.hosting.backend", "BACKENDS"),
    ("steprl.envs.registry", "ENVS"),
    ("steprl.envs.registry", "FAMILIES"),
)
REGISTRIES: dict[str, Registry[object]] = {
    f"{module}:{attr}": getattr(importlib.import_module(module), attr) for module, attr in HOMES
}
ENTRIES = [pytest.param(home, name, id=f"{home}.{name}") for home, reg in REGISTRIES.items() for name in reg]


def one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(exc.value)
    assert text and "\n" not in text, text
    return text


@pytest.mark.parametrize("home", REGISTRIES)
def test_a_registry_is_a_registry_with_a_checker(home: str) -> None:
    reg = REGISTRIES[home]
    assert isinstance(reg, Registry) and reg, home
    assert reg.checker is not None or reg.checked_by, f"{home}: no checker and no test named that runs one"


@pytest.mark.parametrize(("home", "name"), ENTRIES)
def test_an_entry_by_name_and_by_import_path(home: str, name: str) -> None:
    reg = REGISTRIES[home]
    assert reg.lookup(name) is reg[name]
    assert reg.lookup(f"{home}.{name}") is reg[name]  # the path through its registry
    entry = reg[name]
    module, qualname = getattr(entry, "__module__", None), getattr(entry, "__qualname__", "<")
    if module is not None and "<" not in qualname:  # a function or class of its own: its own path
        assert reg.lookup(f"{module}:{qualname}") is entry


@pytest.mark.parametrize("home", REGISTRIES)
def test_an_unknown_name_or_a_refused_import_is_one_line(home: str) -> None:
    reg = REGISTRIES[home]
    with pytest.raises(ConfigError) as exc:
        reg.lookup("no_such_entry")
    assert one_line(exc).startswith(
        f"{reg.key}: unknown {reg.what} 'no_such_entry'; use one of {sorted(reg)}"
    )
    with pytest.raises(ConfigError) as exc:
        reg.lookup("os:system")  # callable: refused before anything calls it
    assert one_line(exc) == f"{reg.key} 'os:system' is a builtin_function_or_method, not {reg.expected}"
    with pytest.raises(ConfigError) as exc:
        reg.lookup("no_such_module_xyz:attr")
    assert "importing 'no_such_module_xyz' failed: ModuleNotFoundError" in one_line(exc)


@pytest.mark.parametrize(("home", "name"), ENTRIES)
def test_an_unknown_param_is_refused(home: str, name: str) -> None:
    reg = REGISTRIES[home]
    declared = reg.params(reg[name]) if reg.params is not None else None
    if callable(declared) and any(
        p.kind is p.VAR_KEYWORD for p in inspect.signature(declared).parameters.values()
    ):  # a function taking **kwargs checks its own keys (a wrapper passing them on)
        reg.check_params(name, {"no_such_param": 1})
        return
    with pytest.raises(ConfigError) as exc:
        reg.check_params(name, {"no_such_param": 1})
    assert "no_such_param" in one_line(exc)


CHEAP = [
    pytest.param(home, name, id=f"{home}.{name}")
    for home, reg in REGISTRIES.items()
    if reg.checker is not None and reg.cheap
    for name in reg
]


@pytest.mark.parametrize(("home", "name"), CHEAP)
def test_every_entry_passes_its_registrys_checker(home: str, name: str) -> None:
    REGISTRIES[home].check(name)
