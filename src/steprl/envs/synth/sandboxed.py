"""Written tools' code (`template: written`, by hand or by the LLM writer) runs here: only in the
bubblewrap sandbox (`envs/sandbox`), never in this process.

A spec's code is a file's or a model's text: "restricted" builtins do not hold it (through
`().__class__.__base__.__subclasses__()` it reached `os.system` and ran `id` as root), so it
runs in one sandboxed interpreter per process and set of codes (`SandboxSession`: the code
env's confinement), started on first use. Each call ships the world and the arguments there as
JSON and gets back the tool's table and its result as JSON; each call runs the code in a fresh
namespace, so nothing a call leaves behind reaches the next. No bubblewrap, no code: one line
saying how to install it.

Measured on a 2-core CPU host: the session starts in about 0.07 s and a call over a
two-table world takes about 0.3 ms (1,000 calls in 0.27 s).
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Mapping
from typing import Any

from steprl.envs.base import ToolError
from steprl.envs.sandbox import ErrorKind, Sandbox, SandboxLimits, SandboxSession
from steprl.envs.sandbox.limits import FIX_BWRAP
from steprl.envs.synth.spec import SynthSpecError, ToolDoc
from steprl.envs.synth.world import World

#: one call: a short deadline (a tool is a few dict operations), room for a whole world in JSON
LIMITS = SandboxLimits(
    wall_s=3.0, cpu_s=600.0, address_space_bytes=512 * 2**20, output_bytes=8 * 2**20, max_processes=8
)

# The session's first cell: each tool's code compiled once; `_steprl_call` runs one call in a
# fresh namespace (`ToolError` in scope) and prints one JSON reply; what the code prints is
# dropped. The errors a model's arguments cause are told apart from the code's own failures as
# `Written.call` did in-process.
_PRELUDE = r"""
import io as _io, json as _json, sys as _sys

class ToolError(Exception):
    "A model's bad input: its message is shown to the model."

_SOURCES = _json.loads(STEPRL_CODES_JSON)
_CODES = {name: compile(src, "<written " + name + ">", "exec") for name, src in _SOURCES.items()}
_MODEL = (LookupError, ValueError, TypeError, ArithmeticError, AttributeError)

def _steprl_call(request):
    req = _json.loads(request)
    namespace = {"__name__": "written", "ToolError": ToolError}
    out, _sys.stdout = _sys.stdout, _io.StringIO()
    try:
        exec(_CODES[req["tool"]], namespace)
        world = req["world"]
        result = namespace["call"](world, req["args"])
        table, before = req["table"], _json.loads(request)["world"]
        others = sorted(t for t in set(world) | set(before) if t != table and world.get(t) != before.get(t))
        reply = {"ok": "ok" if result is None else str(result), "table": world.get(table), "others": others}
    except ToolError as exc:
        reply = {"tool_error": str(exc)}
    except _MODEL as exc:
        reply = {"model_error": type(exc).__name__ + ": " + str(exc)}
    except BaseException as exc:
        reply = {"error": type(exc).__name__ + ": " + str(exc)}
    finally:
        _sys.stdout = out
    try:
        text = _json.dumps(reply)
    except (TypeError, ValueError) as exc:  # a value JSON cannot hold: the code's doing
        text = _json.dumps({"error": "its table holds a value that is not JSON: " + str(exc)})
    print(text)
"""


class WrittenCodeError(SynthSpecError):
    """A written tool's code failed on its own (not the model's arguments): it ran past its
    deadline, died, or answered something that is not a table of records."""


@functools.cache
def written_sandbox() -> Sandbox:
    """One `Sandbox` per process for written code (its probe, uid pool and admission)."""
    return Sandbox(LIMITS)


def require_sandbox(names: list[str]) -> Sandbox:
    """The sandbox, or one line saying why this host cannot run the code of tools `names`."""
    box = written_sandbox()
    if not box.capabilities.usable:
        why = "; ".join(f"{name}: {text}" for name, text in box.capabilities.problems)
        bwrap = "bwrap" in dict(box.capabilities.problems)
        raise SynthSpecError(
            f"tools {names} carry written code, which runs only in the bubblewrap sandbox, and this host "
            f"cannot confine code ({why})" + (f"; {FIX_BWRAP}" if bwrap else "")
        )
    return box


class WrittenRunner:
    """The sandboxed interpreter of one written tool's code in this process. Thread-safe (the
    session runs one cell at a time); an interpreter that died (its CPU budget, a crash) is
    replaced and the call tried once more, since a call is a pure function of what it is sent."""

    def __init__(self, name: str, code: str) -> None:
        self.name, self.code = name, code
        self._lock = threading.Lock()
        self._session: SandboxSession | None = None

    def _open(self) -> SandboxSession:
        box = require_sandbox([self.name])
        codes = json.dumps({self.name: self.code})
        try:
            return box.session(LIMITS, prelude=_PRELUDE.replace("STEPRL_CODES_JSON", repr(codes)))
        except RuntimeError as exc:  # the sandbox would not start, or the code does not compile there
            raise WrittenCodeError(
                f"tool {self.name}: its sandbox did not start: {str(exc)[-300:]}"
            ) from None

    def close(self) -> None:
        with self._lock:
            session, self._session = self._session, None
        if session is not None:
            session.close()

    def call(self, tool: ToolDoc, world: World, args: Mapping[str, Any]) -> tuple[str, Any]:
        """(result text, the tool's table after the call) or `ToolError` for the model's mistake."""
        request = json.dumps({"tool": tool.name, "table": tool.table, "world": world, "args": dict(args)})
        cell = f"_steprl_call({request!r})"
        with self._lock:
            for attempt in (1, 2):
                if self._session is None or not self._session.alive:
                    self._session = self._open()
                result = self._session.run(cell)
                if result.ok or result.error is ErrorKind.TIMEOUT or attempt == 2:
                    break
        if not result.ok:
            how = "ran past its deadline" if result.timed_out else f"ended: {result.error.value}"
            raise WrittenCodeError(f"tool {tool.name}: its code {how} ({result.stderr.strip()[-200:]!r})")
        return _reply(tool, result.stdout)


def _reply(tool: ToolDoc, stdout: str) -> tuple[str, Any]:
    try:
        reply = json.loads(stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise WrittenCodeError(f"tool {tool.name}: its code answered no result") from None
    if "tool_error" in reply:
        raise ToolError(str(reply["tool_error"]))
    if "model_error" in reply:  # the model's arguments, as the code met them: shown to the model
        raise ToolError(f"{tool.name}: {reply['model_error']}")
    if "error" in reply:
        raise WrittenCodeError(f"tool {tool.name}: its code raised {reply['error']}")
    if reply.get("others"):  # only its own table comes back: say so rather than drop the writes
        raise WrittenCodeError(
            f"tool {tool.name}: its code wrote another table ({', '.join(map(str, reply['others']))}); "
            f"it may change only {tool.table}"
        )
    table = reply.get("table")
    if not isinstance(table, dict) or not all(isinstance(r, dict) for r in table.values()):
        raise WrittenCodeError(
            f"tool {tool.name}: its code left world[{tool.table!r}] not a dict of records (key -> dict)"
        )
    return str(reply["ok"]), table


#: (process, tool, code) -> its runner, most recently used last; a forked child starts its own
_RUNNERS: dict[tuple[int, str, str], WrittenRunner] = {}
_RUNNERS_LOCK = threading.Lock()
_MAX_RUNNERS = 16  # the LLM writer tries several codes a tool: the oldest interpreters go


def runner_for(tool: ToolDoc) -> WrittenRunner:
    """The process's runner for this tool's code, started on its first call."""
    key = (os.getpid(), tool.name, tool.code)
    with _RUNNERS_LOCK:
        runner = _RUNNERS.pop(key, None) or WrittenRunner(tool.name, tool.code)
        _RUNNERS[key] = runner
        old = [k for k in _RUNNERS if k[0] == key[0]][:-_MAX_RUNNERS]
        evicted = [_RUNNERS.pop(k) for k in old]
    for r in evicted:
        r.close()
    return runner
