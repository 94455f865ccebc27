"""Tool documentation from an MCP server: its `tools/list` plus a state description.

A spec may name a server instead of writing each tool's schema::

    mcp:
      command: python            # the server (stdio), started once while synthesizing
      args: [my_server.py]
      ignore: [ping]              # server tools with no effect on the state (not synthesized)
    tables: {...}                 # the state description, as in any spec
    tools:                        # per server tool: only what the server cannot say
      - {name: find_note, reads: [notes.title], returns: note_id}
      - {name: set_body, writes: [notes.body], types: {id: note_id}}

Each server tool's name, description and `inputSchema` become the tool's documentation; its
entry under `tools` adds what it reads, writes and returns (and optionally `effect`, `template`,
`phrase`, a `description` that replaces the server's, and `types`: a parameter's semantic type,
written into the schema as its `x-type`). The synthesized env implements the tools over its own
typed state, as for any spec: the server is read for its documentation only, so training never
needs it running. `steprl synth` writes the merged, self-contained spec into the package (use
the package, `env.params.path`, where many processes start envs: `spec:` lists the tools again
in each).

Every mismatch is one line: a server tool with no entry (add one, or list it under
`mcp.ignore`), an entry naming no server tool, a server that does not start.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import shlex
from collections.abc import Mapping
from typing import Any

from steprl.envs.synth.spec import SynthSpecError
from steprl.errors import UserError

#: what a `tools` entry may add to a server tool
_BINDING_KEYS = ("name", "description", "reads", "writes", "returns", "effect", "template", "phrase", "types")


def server_tools(mcp: Mapping[str, Any], timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """The server's `tools/list`: [{name, description, inputSchema}], every page."""
    from mcp import StdioServerParameters

    from steprl.envs.adapters.mcp_session import MCPSession, MCPTransportError
    from steprl.envs.adapters.mcp_yaml import resolve_command

    command = mcp.get("command")
    if not isinstance(command, str) or not command.strip():
        raise SynthSpecError("mcp.command: the server's executable is required (e.g. command: mcp-server-x)")
    args = mcp.get("args", [])
    if not isinstance(args, list):
        raise SynthSpecError(f"mcp.args: must be a list of strings, got {args!r}")
    if not args and " " in command.strip():  # `command: python server.py` as one string
        command, *args = shlex.split(command)
    try:
        resolved = resolve_command(command)
    except UserError as exc:  # its message names env.params.command: say which key it is here
        raise SynthSpecError(f"mcp.command: {exc}".replace("env.params.command ", "")) from None
    server = StdioServerParameters(command=resolved, args=[str(a) for a in args])

    async def listing() -> list[dict[str, Any]]:
        session = MCPSession(server, None, call_timeout_s=timeout_s)
        await session.start(float(mcp.get("startup_timeout_s", timeout_s)))
        try:
            return [
                {"name": t.name, "description": t.description or "", "inputSchema": dict(t.input_schema)}
                for t in session.tools
            ]
        finally:
            await session.aclose()

    try:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # the usual case: no loop in this thread
            return asyncio.run(listing())
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # called from inside a running loop
            return pool.submit(asyncio.run, listing()).result()
    except MCPTransportError as exc:  # a server that did not start or broke off: its message says why
        raise SynthSpecError(f"mcp: {str(exc).splitlines()[0]}") from None


def merge_mcp_tools(raw: Mapping[str, Any], listed: list[dict[str, Any]]) -> dict[str, Any]:
    """The spec `raw` (with `mcp:`) as a plain spec: each server tool's documentation joined with
    its entry under `tools`; `mcp:` dropped (the package is self-contained)."""
    mcp = raw["mcp"]
    if not isinstance(mcp, Mapping):
        raise SynthSpecError(f"mcp: must be a mapping with command (and args, ignore), got {mcp!r}")
    unknown = set(mcp) - {"command", "args", "ignore", "startup_timeout_s"}
    if unknown:
        raise SynthSpecError(
            f"mcp: unknown keys {sorted(unknown)}; allowed: command, args, ignore, startup_timeout_s"
        )
    ignore_list = mcp.get("ignore") or []
    if not isinstance(ignore_list, list):
        raise SynthSpecError(f"mcp.ignore: must be a list of tool names, got {ignore_list!r}")
    ignore = {str(n) for n in ignore_list}
    entries = raw.get("tools") or []
    if not isinstance(entries, list):
        raise SynthSpecError(
            "tools: must be a list of {name, reads/writes, ...} entries, one per server tool"
        )
    by_name: dict[str, Mapping[str, Any]] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
            raise SynthSpecError(f"tools[{i}]: must be a mapping with the server tool's name")
        extra = set(entry) - set(_BINDING_KEYS)
        if extra:
            raise SynthSpecError(
                f"tools[{i}] ({entry['name']}): unknown keys {sorted(extra)}; with mcp: the server gives the "
                f"parameters; allowed: {', '.join(_BINDING_KEYS)}"
            )
        by_name[entry["name"]] = entry
    served = {t["name"]: t for t in listed}
    strays = sorted(set(by_name) - set(served))
    if strays:
        offered = ", ".join(sorted(served)) or "none"
        raise SynthSpecError(f"tools: {strays} name no tool of the MCP server; it offers: {offered}")
    unbound = sorted(set(served) - set(by_name) - ignore)
    if unbound:
        raise SynthSpecError(
            f"mcp: server tools {unbound} have no entry under tools saying what they read and write; "
            "add one each, or list them under mcp.ignore"
        )
    tools = []
    for name, doc in served.items():
        if name in ignore:
            continue
        entry = by_name[name]
        schema = doc["inputSchema"] or {}
        given = schema.get("properties") or {} if isinstance(schema, Mapping) else None
        if not isinstance(given, Mapping) or not all(isinstance(v, Mapping) for v in given.values()):
            raise SynthSpecError(
                f"mcp: the server's {name} has an input schema synth cannot read (properties must map "
                "names to schemas); list it under mcp.ignore"
            )
        props = {str(k): dict(v) for k, v in given.items()}
        types = entry.get("types") or {}
        if not isinstance(types, Mapping):
            raise SynthSpecError(f"tools ({name}).types: must map parameter -> semantic type, got {types!r}")
        for pname, semantic in types.items():
            if pname not in props:
                raise SynthSpecError(
                    f"tools ({name}).types.{pname}: the server's {name} has no such parameter; "
                    f"it takes {', '.join(props) or 'none'}"
                )
            props[pname]["x-type"] = semantic
        for prop in props.values():  # what JSON schema allows beyond what synth reads
            prop.pop("title", None)
        # every parameter required: a synthesized task binds them all (a server's optional ones too)
        schema = {"type": "object", "properties": props, "required": list(props)}
        tool = {
            "name": name,
            "description": entry.get("description", doc["description"]),
            "parameters": schema,
        }
        tool.update({k: v for k, v in entry.items() if k not in ("name", "description", "types")})
        tools.append(tool)
    return {**{k: v for k, v in raw.items() if k != "mcp"}, "tools": tools}
