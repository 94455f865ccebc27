"""How `env.name` becomes a spec (registry.get_spec): registered names, families, import paths,
entry points, plugins; and the one-line errors when one of them is wrong."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest

from steprl.envs import registry
from steprl.envs.registry import ENVS, EnvLoadError, EnvSpec, UnknownEnvError, get_spec, load_plugins
from steprl.errors import UserError

PLUGIN = """
from steprl.envs.registry import EnvSpec, get_spec, register

BASE = get_spec("calculator")
SPEC = EnvSpec("{name}", BASE.factory, BASE.tasks, BASE.strategies)
NOT_A_SPEC = 42


def make_spec():
    return SPEC


def returns_junk():
    return "junk"


def raises():
    raise RuntimeError("no config file")


if {register}:
    register(SPEC)
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Writes a user module outside steprl onto sys.path; forgets what it registered after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = dict(ENVS)

    def write(module: str, name: str, register: bool = False) -> str:
        (tmp_path / f"{module}.py").write_text(PLUGIN.format(name=name, register=register))
        return module

    yield write
    ENVS.clear()
    ENVS.update(before)
    for mod in [m for m in sys.modules if m.startswith("user_envs")]:
        del sys.modules[mod]


def test_a_registered_name_is_the_registered_spec() -> None:
    assert get_spec("calculator") is ENVS["calculator"]


def test_a_plugin_registers_its_envs(user_module) -> None:
    load_plugins([user_module("user_envs_a", "plugged", register=True)])
    assert get_spec("plugged").name == "plugged"


def test_an_import_path_to_a_spec_or_a_function(user_module) -> None:
    user_module("user_envs_b", "by_path")
    assert get_spec("user_envs_b:SPEC").name == "by_path"
    assert get_spec("user_envs_b:make_spec") is get_spec("user_envs_b:SPEC")
    assert "by_path" not in ENVS  # loaded under the path it was asked for, nothing registered


@pytest.mark.parametrize(
    ("attr", "message"),
    [
        ("NOT_A_SPEC", "is a int, not an EnvSpec or a zero-argument function returning one"),
        ("returns_junk", "returned a str, not an EnvSpec"),
        ("raises", "calling it raised RuntimeError: no config file"),
        ("missing", "has no attribute 'missing'"),
        ("EnvSpec", "is a type, not an EnvSpec"),
    ],
)
def test_an_import_path_to_anything_else_is_one_line(user_module, attr: str, message: str) -> None:
    user_module("user_envs_c", "c")
    with pytest.raises(EnvLoadError, match=message) as info:
        get_spec(f"user_envs_c:{attr}")
    assert isinstance(info.value, UserError) and "\n" not in str(info.value)
    assert f"user_envs_c:{attr}" in str(info.value)


def test_plugins_and_modules_that_do_not_import(user_module, tmp_path: Path) -> None:
    with pytest.raises(EnvLoadError, match="plugin 'user_envs_nope' failed to import: ModuleNotFoundError"):
        load_plugins(["user_envs_nope"])
    (tmp_path / "user_envs_bad.py").write_text("import json\njson.loads('{')\n")
    with pytest.raises(EnvLoadError, match="importing 'user_envs_bad' failed: JSONDecodeError"):
        get_spec("user_envs_bad:SPEC")
    with pytest.raises(EnvLoadError, match="package.module:attr"):
        get_spec(":SPEC")


def test_an_entry_point_names_an_env(user_module, monkeypatch: pytest.MonkeyPatch) -> None:
    user_module("user_envs_d", "from_entry_point")
    points = [
        importlib.metadata.EntryPoint("ep_env", "user_envs_d:SPEC", registry.ENTRY_POINT_GROUP),
        importlib.metadata.EntryPoint("ep_junk", "user_envs_d:NOT_A_SPEC", registry.ENTRY_POINT_GROUP),
    ]
    monkeypatch.setattr(
        importlib.metadata, "entry_points", lambda group=None: [p for p in points if p.group == group]
    )
    assert get_spec("ep_env").name == "from_entry_point"
    with pytest.raises(EnvLoadError, match="entry point 'user_envs_d:NOT_A_SPEC'.*is a int"):
        get_spec("ep_junk")
    with pytest.raises(UnknownEnvError, match="known envs: .*calculator.*ep_env.*gym, mcp"):
        get_spec("nothing_by_this_name")


def test_a_family_builds_one_spec_per_params(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[dict[str, object]] = []
    base = get_spec("calculator")

    def family(params):
        built.append(dict(params))
        return EnvSpec(f"fam:{params['k']}", base.factory, base.tasks, base.strategies)

    monkeypatch.setitem(registry.FAMILIES, "fam", family)
    a = get_spec("fam", {"k": 1})
    assert get_spec("fam", {"k": 1}) is a and get_spec("fam", {"k": 2}).name == "fam:2"
    assert built == [{"k": 1}, {"k": 2}]
    with pytest.raises(ValueError, match="already registered"):
        registry.register(EnvSpec("fam", base.factory, base.tasks, base.strategies))
