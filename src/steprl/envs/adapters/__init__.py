"""Adapters that turn external environments into steprl `Env`s: Gymnasium envs and MCP servers.

The names are imported lazily (PEP 562), so using one adapter does not import the other's
dependency (importing `mcp` alone takes most of a second), and each adapter's optional
dependency (the ``gym`` and ``mcp`` extras) is needed only when that adapter is used: without
it, the import raises `steprl.extras.MissingExtra` naming the extra to install.

Modules: `gymnasium_env` (`GymnasiumEnv`, `make_gym_spec`), `gym_actions` (action codecs),
`gym_experts` (scripted policies), `mcp_env` (`MCPToolEnv`, `MCPTool`), `mcp_session` (the MCP
client session's lifecycle).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from steprl.envs.adapters.gym_actions import DiscreteActions
    from steprl.envs.adapters.gym_experts import random_policy_for, shortest_path_expert
    from steprl.envs.adapters.gymnasium_env import (
        GymnasiumEnv,
        make_gym_env,
        make_gym_spec,
        solved_on_termination,
    )
    from steprl.envs.adapters.mcp_env import MCPTool, MCPToolEnv
    from steprl.envs.adapters.mcp_session import MCPTransportError, result_text

#: public name -> the module (in this package) that defines it.
_EXPORTS = {
    "DiscreteActions": "gym_actions",
    "GymnasiumEnv": "gymnasium_env",
    "make_gym_env": "gymnasium_env",
    "make_gym_spec": "gymnasium_env",
    "random_policy_for": "gym_experts",
    "shortest_path_expert": "gym_experts",
    "solved_on_termination": "gymnasium_env",
    "MCPTool": "mcp_env",
    "MCPToolEnv": "mcp_env",
    "MCPTransportError": "mcp_session",
    "result_text": "mcp_session",
}

__all__ = [
    "DiscreteActions",
    "GymnasiumEnv",
    "MCPTool",
    "MCPToolEnv",
    "MCPTransportError",
    "make_gym_env",
    "make_gym_spec",
    "random_policy_for",
    "result_text",
    "shortest_path_expert",
    "solved_on_termination",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
