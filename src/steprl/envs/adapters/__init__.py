"""Adapters that turn external environments into steprl `Env`s: Gymnasium envs and MCP servers.

The names are imported lazily (PEP 562), so using one adapter does not import the other's
dependency (importing `mcp` alone takes most of a second).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from steprl.envs.adapters.gymnasium_env import (
        DiscreteActions,
        GymnasiumEnv,
        make_gym_env,
        make_gym_spec,
        random_policy_for,
        shortest_path_expert,
        solved_on_termination,
    )
    from steprl.envs.adapters.mcp_env import (
        MCPTool,
        MCPToolEnv,
        MCPTransportError,
        render_mcp_system_prompt,
        result_text,
    )

_EXPORTS = {
    "DiscreteActions": "gymnasium_env",
    "GymnasiumEnv": "gymnasium_env",
    "make_gym_env": "gymnasium_env",
    "make_gym_spec": "gymnasium_env",
    "random_policy_for": "gymnasium_env",
    "shortest_path_expert": "gymnasium_env",
    "solved_on_termination": "gymnasium_env",
    "MCPTool": "mcp_env",
    "MCPToolEnv": "mcp_env",
    "MCPTransportError": "mcp_env",
    "render_mcp_system_prompt": "mcp_env",
    "result_text": "mcp_env",
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
    "render_mcp_system_prompt",
    "result_text",
    "shortest_path_expert",
    "solved_on_termination",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
