"""The apps' python executor (AppWorld code actions): snippets run in the sandbox, API calls on the host.

The agent writes a fenced python block and ends its action at the output marker (the ToRL
format of the code env: `code_interpreter.protocol`). The block runs in one stateful
`SandboxSession` per episode (variables persist between the episode's turns, never across
episodes), with no network and no host files. Its API is defined by a prelude cell:

    apis.contacts_search(query="Alice")        # or: call("contacts_search", query="Alice")

returns the function's result as Python values (lists, dicts, str, int); a failed call raises
`ApiError` with the same short message the JSON executor shows. Every call travels over the
session's RPC channel (`steprl.envs.sandbox.Rpc`) to `Apps.call(name, arguments)` on the host,
the entry point the JSON tools use, so the episode database never enters the sandbox.

Bounds: `max_api_calls` calls per cell (the next ones raise `ApiError`), the sandbox's request
and reply sizes, the cell's wall clock (`PYTHON_LIMITS.wall_s`). The observation is the cell's
stdout, then the last line of its error if it failed (``ApiError: no contact with id 9``,
``NameError: ...``), cut to head + "..." + tail past `max_observation_chars`. A cell that
times out or kills its interpreter loses the variables (the observation says so) and the next
cell starts a fresh interpreter; the database keeps every change made through the API. A
sandbox that cannot start or run is an infrastructure failure (`InfraError`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from steprl.envs.base import InfraError, ToolError
from steprl.envs.library.apps.api import FUNCTIONS, Apps
from steprl.envs.library.code_interpreter.protocol import format_output
from steprl.envs.sandbox import ErrorKind, ExecResult, Rpc, RpcError, Sandbox, SandboxLimits, SandboxSession

#: The operator's maximums for apps snippets (a test or config may only lower them). `cpu_s`
#: bounds a whole episode's interpreter; `wall_s` one cell.
PYTHON_LIMITS = SandboxLimits(wall_s=5.0, cpu_s=20.0, address_space_bytes=256 * 2**20, output_bytes=16 * 1024)
#: Outside uids of the apps sandboxes: apart from the default pool the code env uses.
_UID_RANGE = (300_000, 365_535)

_PRELUDE = """
class ApiError(Exception):
    "An API call failed (unknown function, bad arguments, no such row); the message says why."


def _bind(host, signatures):
    def call(name, /, **arguments):
        "Call API function `name` with keyword arguments; returns its result."
        try:
            return host.call({"name": name, "arguments": arguments})
        except host.RpcError as exc:
            raise ApiError(str(exc)) from None

    class Apis:
        "The apps' API: apis.contacts_search(query='Al') is call('contacts_search', query='Al')."

        def __getattr__(self, name):
            if name.startswith("_"):
                raise AttributeError(name)
            params = signatures.get(name, ())

            def function(*args, **arguments):
                if len(args) > len(params):
                    raise TypeError(f"{name}() takes {len(params)} positional arguments at most")
                for param, value in zip(params, args):
                    if param in arguments:
                        raise TypeError(f"{name}() got multiple values for argument '{param}'")
                    arguments[param] = value
                return call(name, **arguments)

            function.__name__ = function.__qualname__ = name
            return function

        def __dir__(self):
            return sorted(signatures)

        def __repr__(self):
            return "<apis: " + ", ".join(sorted(signatures)) + ">"

    return call, Apis()


call, apis = _bind(__import__("sandbox_host"), SIGNATURES)
del _bind
"""


@functools.cache
def prelude() -> str:
    """The hidden first cell of every interpreter: defines `apis`, `call` and `ApiError`."""
    signatures = {f.name: (*f.required, *f.optional) for f in FUNCTIONS}
    return _PRELUDE.replace("SIGNATURES", repr(signatures))


@functools.cache
def apps_sandbox() -> Sandbox:
    """One `Sandbox` per process for apps snippets: its concurrency limit and uid pool."""
    return Sandbox(PYTHON_LIMITS, uid_range=_UID_RANGE)


@dataclass(frozen=True)
class CellOutcome:
    """One executed snippet: the observation text and what the transition's info reports."""

    observation: str
    error: str | None  # the model-visible error (last line), None when the cell succeeded
    api_calls: int  # calls that reached `Apps.call`
    restarted: bool  # the interpreter died (timeout, crash): its variables are gone


class CodeActions:
    """The python executor of one `AppsEnv`: one sandboxed interpreter per episode.

    Args:
        apps: the env's `Apps` (attached to the episode database by the env).
        limits: per-snippet limits (a `SandboxLimits`, or a mapping of the fields to change,
            as a YAML config gives), clamped to `PYTHON_LIMITS`.
        max_api_calls: API calls per snippet; later calls raise `ApiError`.
        max_observation_chars: observations longer than this keep head + "..." + tail.
    """

    def __init__(
        self,
        apps: Apps,
        *,
        limits: SandboxLimits | Mapping[str, Any] | None = None,
        max_api_calls: int = 20,
        max_observation_chars: int = 2048,
    ) -> None:
        self.apps = apps
        self.rpc = Rpc(self._api_call, max_calls=max_api_calls)
        if isinstance(limits, Mapping):
            limits = dataclasses.replace(PYTHON_LIMITS, **limits)
        self.limits = PYTHON_LIMITS.clamp(limits) if limits else PYTHON_LIMITS
        self.max_observation_chars = max_observation_chars
        self._session: SandboxSession | None = None

    def run(self, code: str) -> CellOutcome:
        """Run one snippet in the episode's interpreter (started on first use)."""
        try:
            if self._session is None:
                self._session = apps_sandbox().session(self.limits, rpc=self.rpc, prelude=prelude())
            result = self._session.run(code)
        except Exception as exc:  # the sandbox (or the API's database) failed, not the model
            self.close()
            raise InfraError(f"apps python executor: {type(exc).__name__}: {exc}") from exc
        if result.error is ErrorKind.SANDBOX_ERROR or result.error is ErrorKind.SESSION_DEAD:
            self.close()
            raise InfraError(f"apps python executor: {result.error.value}: {result.stderr.strip()[-300:]}")
        return self._outcome(result)

    def close(self) -> None:
        """End the episode's interpreter (its variables are lost); safe to call again."""
        session, self._session = self._session, None
        if session is not None:
            session.close()

    def _api_call(self, request: Any) -> Any:
        """The RPC handler: one `{"name": ..., "arguments": {...}}` request -> the result."""
        if not isinstance(request, Mapping) or set(request) != {"name", "arguments"}:
            raise RpcError('malformed API call; use call("name", arg=value) or apis.name(arg=value)')
        name, arguments = request["name"], request["arguments"]
        if not isinstance(name, str) or not isinstance(arguments, Mapping):
            raise RpcError("malformed API call: the name must be a string and the arguments keywords")
        try:
            out = self.apps.call(name, arguments)
        except ToolError as exc:
            raise RpcError(str(exc) or "API error") from None
        try:
            return json.loads(out)
        except ValueError:
            return out  # a text result (api_docs)

    def _outcome(self, result: ExecResult) -> CellOutcome:
        restarted = self._session is None or not self._session.alive
        if result.timed_out:
            error: str | None = f"Timeout: the code ran longer than {self.limits.wall_s:g}s"
        elif restarted:
            how = f"signal {result.signal}" if result.signal else f"exit code {result.exit_code}"
            how = result.error.value if result.error is not ErrorKind.OK else how
            error = f"Error: the interpreter died ({how})"
        elif result.exit_code:
            lines = result.stderr.strip().splitlines()
            error = lines[-1] if lines else "Error"
        else:
            error = None
        if restarted:
            self.close()  # the next snippet starts a fresh interpreter
            error = f"{error}; the interpreter restarted and its variables are lost"
        text = result.stdout.rstrip("\n")
        if error is not None:
            text = f"{text}\n{error}" if text else error
        observation = format_output(text, None, max_tokens=self.max_observation_chars)
        return CellOutcome(observation, error, result.rpc_calls, restarted)
