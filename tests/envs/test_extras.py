"""Optional extras of the envs (gym, mcp, search): what works without them, and the one-line error.

The in-process tests hide a package by setting its `sys.modules` entries to None (an import
of it then fails as if it were not installed) and drop the steprl modules that import it, so
they import afresh; `monkeypatch` puts every entry back afterwards, so later tests see the
modules (and the classes) they imported before.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import pytest

from steprl.envs.library.search import BM25Retriever, Doc, SearchEnv
from steprl.extras import MissingExtra

GYM_MESSAGE = "the Gymnasium adapter needs the gym extra: pip install 'steprl[gym]'"
MCP_MESSAGE = "the MCP adapter needs the mcp extra: pip install 'steprl[mcp]'"
SEARCH_MESSAGE = "env 'search' needs the search extra: pip install 'steprl[search]'"


def _hide(monkeypatch: pytest.MonkeyPatch, package: str, *importers: str) -> None:
    """Make `package` (and its submodules) unimportable; forget `importers` so they reimport."""
    for name in [package, *(n for n in sys.modules if n.startswith(package + "."))]:
        monkeypatch.setitem(sys.modules, name, None)
    for name in importers:
        monkeypatch.delitem(sys.modules, name, raising=False)


def test_search_without_bm25s_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    _hide(monkeypatch, "bm25s")
    with pytest.raises(MissingExtra) as built:
        SearchEnv()
    assert str(built.value) == SEARCH_MESSAGE
    with pytest.raises(MissingExtra) as indexed:
        BM25Retriever([Doc(0, "Zorvan was born in Quell.")])
    assert str(indexed.value) == SEARCH_MESSAGE


def test_gym_adapter_without_gymnasium_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    _hide(
        monkeypatch,
        "gymnasium",
        "steprl.envs.adapters.gymnasium_env",
        "steprl.envs.adapters.gym_actions",
    )
    adapters = importlib.import_module("steprl.envs.adapters")
    for name in ("GymnasiumEnv", "make_gym_spec", "DiscreteActions"):
        with pytest.raises(MissingExtra) as missing:
            getattr(adapters, name)
        assert str(missing.value) == GYM_MESSAGE


def test_mcp_adapter_without_mcp_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    _hide(monkeypatch, "mcp", "steprl.envs.adapters.mcp_env", "steprl.envs.adapters.mcp_session")
    adapters = importlib.import_module("steprl.envs.adapters")
    for name in ("MCPToolEnv", "MCPTransportError"):
        with pytest.raises(MissingExtra) as missing:
            getattr(adapters, name)
        assert str(missing.value) == MCP_MESSAGE


def test_hidden_modules_are_back() -> None:
    """The tests above restored `sys.modules`: the real packages import again."""
    for name in ("bm25s", "gymnasium", "mcp", "steprl.envs.adapters.gymnasium_env"):
        assert importlib.import_module(name) is sys.modules[name]
    from steprl.envs.adapters import GymnasiumEnv
    from steprl.envs.adapters.gymnasium_env import GymnasiumEnv as Direct

    assert GymnasiumEnv is Direct


# In a fresh interpreter none of the three is importable: the registry, the spec list, a
# calculator episode, the search tasks and the gym experts still work; the rest names its extra.
_WITHOUT_EXTRAS = textwrap.dedent(
    """
    import random, sys
    for name in ("gymnasium", "mcp", "bm25s"):
        sys.modules[name] = None
    from steprl.envs.registry import ENVS, get_spec, make_env, make_tasks
    from steprl.extras import MissingExtra

    print(",".join(sorted(ENVS)))
    spec = get_spec("calculator")
    env, task = make_env("calculator"), next(iter(make_tasks("calculator", "train", 0, n=1)))
    env.reset(task, 0)
    history, rng, reward, done = [], random.Random(0), 0.0, False
    while not done and len(history) < spec.max_turns:
        action = spec.strategies["expert"](task, history, rng)
        step = env.step(action)
        history.append((action, step.observation))
        reward, done = reward + step.reward, step.terminated or step.truncated
    print("calculator", done, reward)
    print("search tasks", len(list(make_tasks("search", "train", 0, n=3))))
    from steprl.envs.adapters.gym_experts import shortest_path_expert
    print("expert move", shortest_path_expert({0: {0: [(1.0, 1, 1.0, True)]}})(0))
    for build in (lambda: make_env("search"), lambda: __import__("steprl.envs.adapters.mcp_env")):
        try:
            build()
        except MissingExtra as exc:
            print("missing:", exc)
    print("loaded:", sorted(n for n in sys.modules if n.split(".")[0] in ("gymnasium", "mcp", "bm25s")
                            and sys.modules[n] is not None))
    """
)


def test_registry_calculator_and_search_tasks_need_no_extra() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _WITHOUT_EXTRAS], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    # every built-in env registers without an extra (the list derived from the registry's built-ins)
    from steprl.envs.registry import _builtin_specs

    assert lines[0] == ",".join(sorted(_builtin_specs()))
    assert lines[1] == "calculator True 1.0"
    assert lines[2:] == [
        "search tasks 3",
        "expert move 0",
        f"missing: {SEARCH_MESSAGE}",
        f"missing: {MCP_MESSAGE}",
        "loaded: []",
    ]
