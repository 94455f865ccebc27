"""`mcp_spec(params)`: the ``mcp`` env family, any MCP server (over stdio) from a config alone.

    env:
      name: mcp
      params: {command: mcp-server-time, args: [--local-timezone, UTC], reuse: true, max_servers: 4,
               reward: {match: exact, field: answer}}
      task_file: {path: tasks/time_tasks.jsonl}  # relative to the config file

The registry calls `mcp_spec(env.params)`; every backend then builds envs with
``spec.factory(**env.params)`` (`make_mcp_env`), the same params, so a Ray worker or an env
server builds the same env from the same YAML. The keys are in `PARAMS` (an unknown one is an
`MCPConfigError` listing them). An MCP server has no task generator: the tasks come from a file
(``env.task_file``, `steprl.envs.task_file.with_task_file`), one row per task with the prompt,
the reference answer (`AnswerMatch.field`) and, for the scripted expert, a ``solution``: the
tool calls that answer it, ``[{"name": "convert_time", "arguments": {...}}]``.

Scripted strategies (for `check_env` and the SFT warm start), built from the rows alone:
``expert`` makes the solution's calls, one per turn, then answers the row's answer; ``guess``
answers at once with a plausible wrong answer (the right one, perturbed); ``random`` sends
malformed actions and calls with scrambled arguments.

`command` is any executable: a name on PATH or in this interpreter's bin directory, or an
absolute path, e.g. into a venv of its own for a server pinned to another mcp major version.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import shutil
import string
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from steprl.envs.adapters.mcp_env import EPISODE_DIR, MCPToolEnv
from steprl.envs.adapters.mcp_pool import shared_pool
from steprl.envs.spec import EnvSpec
from steprl.errors import UserError
from steprl.extras import require
from steprl.types import Task

__all__ = ["PARAMS", "AnswerMatch", "MCPConfigError", "MCPParams", "make_mcp_env", "mcp_spec", "parse_params"]


class MCPConfigError(UserError):
    """A bad ``env.params`` of the mcp family, or a task row the mcp env cannot use."""


#: The keys of ``env.params`` for ``env.name: mcp``, and what each one is.
PARAMS: Mapping[str, str] = {
    "command": "the server's executable (required): a name on PATH or in this venv, or an absolute path",
    "args": "its arguments, a list of strings; {episode_dir} becomes a fresh directory per episode",
    "env": "extra environment variables for the server, a mapping (values may use {episode_dir})",
    "cwd": "the server's working directory (may use {episode_dir})",
    "reward": "how an answer is scored: {match: exact|contains|number|regex, field, case_sensitive}",
    "instructions": "text that opens the system prompt (the task domain, the answer format)",
    "include_tools": "only these tools of the server (default: all)",
    "reuse": "keep servers warm and reuse them across episodes (only for servers without state)",
    "max_servers": "with reuse: at most this many live servers (episodes beyond wait)",
    "call_timeout_s": "a tool call slower than this is an infrastructure failure",
    "startup_timeout_s": "a server start slower than this is a start-up error",
    "max_turns": "the expert's turn budget (EnvSpec.max_turns)",
    "max_invalid_actions": "invalid actions tolerated before the episode ends as a policy error",
    "max_observation_chars": "tool results longer than this are cut in the middle",
    "description": "a one-line description of the env",
    "stochastic": "EnvSpec.stochastic: the server's answers vary between runs",
    "min_expert_success": "EnvSpec.min_expert_success",
    "expert_seeds": "EnvSpec.expert_seeds",
    "replayable": "EnvSpec.replayable: false if the same calls can give different results (a clock)",
    "not_replayable_because": "EnvSpec.not_replayable_because: why not",
}
_SPEC_FIELDS = ("stochastic", "min_expert_success", "expert_seeds", "replayable", "not_replayable_because")
_MATCHES = ("exact", "contains", "number", "regex")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_CLOCK = re.compile(r"(\d{1,2}):(\d{2})")


@dataclass(frozen=True)
class AnswerMatch:
    """Scores an answer against a task's reference (``Task.params[field]``, or ``Task.answer``).

    `match`: ``exact`` (after collapsing whitespace), ``contains`` (the reference occurs in the
    answer), ``number`` (the first number in the answer equals the reference within `tolerance`)
    or ``regex`` (the reference is a pattern the whole answer must match). A reference that is a
    list accepts any of its items. Case is ignored unless `case_sensitive`.
    """

    match: Literal["exact", "contains", "number", "regex"] = "exact"
    field: str = "answer"
    case_sensitive: bool = False
    tolerance: float = 1e-6

    def __call__(self, answer: str, task: Task) -> float:
        got = " ".join(answer.split())
        return 1.0 if any(self._matches(got, want, task) for want in self.references(task)) else 0.0

    def references(self, task: Task) -> list[str]:
        value = task.params.get(self.field)
        if value is None and self.field == "answer":
            value = task.answer
        if value is None:
            raise MCPConfigError(
                f"task {task.id!r} has no {self.field!r} field to score answers against; add it to every "
                "row of the task file, or set reward.field to the field that holds the answer."
            )
        return [_text(v) for v in (value if isinstance(value, list) else [value])]

    def expert_answer(self, task: Task) -> str:
        """What the scripted expert answers: ``Task.answer``, else the (first) reference."""
        if self.match == "regex":
            if task.answer is None:
                raise MCPConfigError(
                    f"task {task.id!r}: with reward.match regex the expert needs an 'answer' field too "
                    "(a literal answer the pattern accepts)."
                )
            return task.answer
        return task.answer if self.field == "answer" and task.answer is not None else self.references(task)[0]

    def _matches(self, got: str, want: str, task: Task) -> bool:
        if self.match == "number":
            a, b = _first_number(got), _first_number(want)
            return a is not None and b is not None and math.isclose(a, b, rel_tol=0.0, abs_tol=self.tolerance)
        if self.match == "regex":
            try:
                return re.fullmatch(want, got, 0 if self.case_sensitive else re.IGNORECASE) is not None
            except re.error as exc:
                raise MCPConfigError(f"task {task.id!r}: {want!r} is not a valid regex ({exc}).") from None
        want = " ".join(want.split())
        if not self.case_sensitive:
            got, want = got.casefold(), want.casefold()
        return got == want if self.match == "exact" else want in got


@dataclass(frozen=True)
class MCPParams:
    """``env.params`` of the mcp family, checked (see `PARAMS` for what each one is)."""

    command: str
    args: tuple[str, ...] = ()
    env: Mapping[str, str] | None = None
    cwd: str | None = None
    reward: AnswerMatch = AnswerMatch()
    instructions: str = ""
    include_tools: tuple[str, ...] | None = None
    reuse: bool = False
    max_servers: int = 4
    call_timeout_s: float = 30.0
    startup_timeout_s: float = 30.0
    max_turns: int = 8
    max_invalid_actions: int = 3
    max_observation_chars: int = 2048
    description: str = ""
    spec_fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def parse_params(params: Mapping[str, Any]) -> MCPParams:
    """`params` checked and typed; `MCPConfigError` names the bad key and how to fix it."""
    unknown = sorted(set(params) - set(PARAMS))
    if unknown:
        raise MCPConfigError(
            f"env.params.{unknown[0]} is not a parameter of the mcp env; allowed: {', '.join(PARAMS)}."
        )
    if "command" not in params:
        raise MCPConfigError(
            "env.params.command is required for the mcp env: the server's executable, e.g. "
            "{command: mcp-server-time} or {command: python, args: [my_server.py]}."
        )
    p = _Reader(params)
    have = {f.name for f in dataclasses.fields(EnvSpec)}
    missing = [k for k in _SPEC_FIELDS if k in params and k not in have]
    if missing:
        raise MCPConfigError(f"env.params.{missing[0]}: this version of steprl's EnvSpec has no such field.")
    parsed = MCPParams(
        command=p.text("command"),
        args=tuple(p.scalars("args")),
        env=p.env("env"),
        cwd=p.text("cwd") if params.get("cwd") is not None else None,
        reward=_reward(params.get("reward") or {}),
        instructions=p.text("instructions", ""),
        include_tools=tuple(p.strings("include_tools")) if params.get("include_tools") is not None else None,
        reuse=p.boolean("reuse", False),
        max_servers=p.integer("max_servers", 4, low=1),
        call_timeout_s=p.number("call_timeout_s", 30.0),
        startup_timeout_s=p.number("startup_timeout_s", 30.0),
        max_turns=p.integer("max_turns", 8, low=1),
        max_invalid_actions=p.integer("max_invalid_actions", 3, low=0),
        max_observation_chars=p.integer("max_observation_chars", 2048, low=1),
        description=p.text("description", ""),
        spec_fields=_spec_fields(p, params),
    )
    if not parsed.command.strip():
        raise MCPConfigError("env.params.command is empty; give the server's executable.")
    templated = [*parsed.args, *(parsed.env or {}).values(), parsed.cwd or ""]
    if parsed.reuse and any(EPISODE_DIR in t for t in templated):
        raise MCPConfigError(
            f"env.params: reuse: true keeps one server for many episodes, but {EPISODE_DIR} asks for "
            "fresh state per episode; set reuse: false (a fresh server per episode) or drop the placeholder."
        )
    return parsed


def mcp_spec(params: Mapping[str, Any]) -> EnvSpec:
    """The spec of the MCP server described by `params` (``env.params``; see the module docstring)."""
    require("mcp", extra="mcp", feature="the mcp env family")
    p = parse_params(params)
    resolve_command(p.command)  # a missing executable is one line now, not an infra failure per episode
    rule = p.reward
    name = f"mcp:{os.path.basename(p.command)}"
    try:
        return EnvSpec(
            name=name,
            factory=make_mcp_env,
            tasks=_no_tasks,
            strategies={"expert": SolutionExpert(rule), "guess": WrongGuess(rule), "random": RandomActions()},
            max_turns=p.max_turns,
            description=p.description or f"the tools of the MCP server `{' '.join([p.command, *p.args])}`",
            **p.spec_fields,
        )
    except ValueError as exc:  # the spec's own rules (e.g. replayable: false needs a reason)
        raise MCPConfigError(f"env.params: {exc}") from None


def _spec_fields(p: _Reader, params: Mapping[str, Any]) -> dict[str, Any]:
    """The `EnvSpec` rules given in `params`, each read with its type (the spec checks ranges)."""
    read = {
        "stochastic": lambda k: p.boolean(k, False),
        "replayable": lambda k: p.boolean(k, True),
        "not_replayable_because": lambda k: p.text(k, ""),
        "min_expert_success": lambda k: p.number(k, 1.0),
        "expert_seeds": lambda k: p.integer(k, 1, low=1),
    }
    return {k: read[k](k) for k in _SPEC_FIELDS if k in params}


def make_mcp_env(**params: Any) -> MCPToolEnv:
    """The spec's factory: one `MCPToolEnv` built from the same ``env.params`` as `mcp_spec`."""
    from mcp import StdioServerParameters

    p = parse_params(params)
    server = StdioServerParameters(
        command=resolve_command(p.command),
        args=list(p.args),
        env=dict(p.env) if p.env is not None else None,
        cwd=p.cwd,
    )
    pool = (
        shared_pool(
            server,
            max_servers=p.max_servers,
            call_timeout_s=p.call_timeout_s,
            startup_timeout_s=p.startup_timeout_s,
        )
        if p.reuse
        else None
    )
    return MCPToolEnv(
        server,
        p.reward,
        instructions=p.instructions,
        include_tools=p.include_tools,
        max_invalid_actions=p.max_invalid_actions,
        max_observation_chars=p.max_observation_chars,
        call_timeout_s=p.call_timeout_s,
        startup_timeout_s=p.startup_timeout_s,
        pool=pool,
    )


def resolve_command(command: str) -> str:
    """The absolute path of `command`: a path as given, else the first match on PATH, else in this
    interpreter's bin directory (a venv's, even when it is not activated)."""
    if os.sep in command:
        path = os.path.abspath(command)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
        raise MCPConfigError(f"env.params.command {command!r} is not an executable file; check the path.")
    found = shutil.which(command) or shutil.which(command, path=os.path.dirname(sys.executable))
    if found is None:
        raise MCPConfigError(
            f"env.params.command {command!r} is not on PATH nor in {os.path.dirname(sys.executable)}; "
            "install the server (e.g. pip install mcp-server-time) or give its absolute path."
        )
    return found


def _no_tasks(split: str, seed: int, **params: Any) -> Iterator[Task]:
    raise MCPConfigError(
        "the mcp env takes its tasks from a file: add env.task_file: {path: tasks.jsonl} to the config "
        "(one JSON object per line with a prompt, an answer and, for the scripted expert, a solution)."
    )


# --- scripted strategies ----------------------------------------------------------------------------------


def solution_calls(task: Task) -> list[dict[str, Any]]:
    """The task's ``solution`` as ``[{"name": ..., "arguments": {...}}]`` ([] if it has none)."""
    solution = task.params.get("solution")
    if solution is None:
        return []
    calls = solution if isinstance(solution, list) else None
    if calls is None or not all(
        isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("arguments", {}), dict)
        for c in calls
    ):
        raise MCPConfigError(
            f"task {task.id!r}: solution must be a list of tool calls "
            '[{"name": "tool", "arguments": {...}}], got ' + f"{json.dumps(solution)[:80]}."
        )
    return [{"name": c["name"], "arguments": c.get("arguments", {})} for c in calls]


def _call(call: Mapping[str, Any]) -> str:
    return f"<tool_call>{json.dumps(call, ensure_ascii=False)}</tool_call>"


@dataclass(frozen=True)
class SolutionExpert:
    """The row's solution, one call per turn, then the row's answer."""

    rule: AnswerMatch

    def __call__(self, task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
        calls = solution_calls(task)
        if len(history) < len(calls):
            return _call(calls[len(history)])
        return f"<answer>{self.rule.expert_answer(task)}</answer>"


@dataclass(frozen=True)
class WrongGuess:
    """Answers at once, without tools, with the right answer perturbed (a plausible wrong one)."""

    rule: AnswerMatch

    def __call__(self, task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
        right = self.rule.expert_answer(task)
        for _ in range(20):
            wrong = perturb(right, rng)
            if self.rule(wrong, task) == 0.0:
                return f"<answer>{wrong}</answer>"
        return "<answer>unknown</answer>"


@dataclass(frozen=True)
class RandomActions:
    """Malformed actions, calls to unknown tools, scrambled arguments and random answers."""

    def __call__(self, task: Task, history: Sequence[tuple[str, str]], rng: random.Random) -> str:
        try:
            calls = solution_calls(task)
        except MCPConfigError:
            calls = []
        call: dict[str, Any] = rng.choice(calls) if calls else {"name": "tool", "arguments": {}}
        scrambled = {k: perturb(_text(v), rng) for k, v in call["arguments"].items()}
        options = [
            lambda: "".join(rng.choice('{}"<>/:abc tool_call') for _ in range(rng.randint(0, 30))),
            lambda: _call({"name": call["name"], "arguments": scrambled}),
            lambda: _call({"name": call["name"] + "_nope", "arguments": call["arguments"]}),
            lambda: _call({"name": call["name"], "arguments": {}}),
            lambda: f"<tool_call>{call['name']}(</tool_call>",
            lambda: f"<answer>{rng.randint(0, 99)}</answer>",
        ]
        return rng.choice(options)()


def perturb(text: str, rng: random.Random) -> str:
    """`text` changed a little: a clock time shifted by whole hours, a number moved, a digit or a
    letter replaced (never the same text)."""
    clock = _CLOCK.fullmatch(text.strip())
    if clock:
        hour = (int(clock.group(1)) + rng.randint(1, 23)) % 24
        return f"{hour:02d}:{clock.group(2)}"
    if re.fullmatch(r"[-+]?\d+", text.strip()):
        return str(int(text) + rng.choice([-1, 1]) * rng.randint(1, 9))
    digits = [i for i, c in enumerate(text) if c.isdigit()]
    positions = digits or [i for i, c in enumerate(text) if c.isalpha()]
    if not positions:
        return text + rng.choice(string.ascii_lowercase)
    i = rng.choice(positions)
    pool = string.digits if text[i].isdigit() else string.ascii_lowercase
    return text[:i] + rng.choice([c for c in pool if c != text[i].lower()]) + text[i + 1 :]


def _first_number(text: str) -> float | None:
    found = _NUMBER.search(text.replace(",", ""))
    return float(found.group()) if found else None


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _reward(value: Any) -> AnswerMatch:
    if isinstance(value, str):
        value = {"match": value}
    if not isinstance(value, Mapping):
        raise MCPConfigError(f"env.params.reward must be a mapping like {{match: exact}}, got {value!r:.60}.")
    allowed = [f.name for f in dataclasses.fields(AnswerMatch)]
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise MCPConfigError(f"env.params.reward.{unknown[0]} is unknown; allowed: {', '.join(allowed)}.")
    p = _Reader(value, "env.params.reward")
    match = p.text("match", "exact")
    if match not in _MATCHES:
        raise MCPConfigError(f"env.params.reward.match must be one of {', '.join(_MATCHES)}, got {match!r}.")
    return AnswerMatch(
        match=match,  # type: ignore[arg-type]  # checked against _MATCHES just above
        field=p.text("field", "answer"),
        case_sensitive=p.boolean("case_sensitive", False),
        tolerance=p.number("tolerance", 1e-6, positive=False),
    )


class _Reader:
    """Typed reads of one mapping of params, each error naming the key (``prefix.key``)."""

    def __init__(self, params: Mapping[str, Any], prefix: str = "env.params") -> None:
        self.params, self.prefix = params, prefix

    def _bad(self, key: str, want: str) -> MCPConfigError:
        return MCPConfigError(f"{self.prefix}.{key} must be {want}, got {self.params[key]!r:.80}.")

    def text(self, key: str, default: str | None = None) -> str:
        value = self.params.get(key, default)
        if not isinstance(value, str):
            raise self._bad(key, "a string")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self.params.get(key, default)
        if not isinstance(value, bool):
            raise self._bad(key, "true or false")
        return value

    def integer(self, key: str, default: int, *, low: int) -> int:
        value = self.params.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise self._bad(key, f"an integer >= {low}")
        return value

    def number(self, key: str, default: float, *, positive: bool = True) -> float:
        value = self.params.get(key, default)
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or (positive and value <= 0) or value < 0:
            raise self._bad(key, "a positive number" if positive else "a number >= 0")
        return float(value)

    def strings(self, key: str) -> list[str]:
        value = self.params.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self._bad(key, "a list of strings")
        return value

    def scalars(self, key: str) -> list[str]:
        """A list of strings (numbers are taken as their text: YAML reads `--port 8080` as an int)."""
        value = self.params.get(key) or []
        if not isinstance(value, list) or not all(
            isinstance(v, str | int | float) and not isinstance(v, bool) for v in value
        ):
            raise self._bad(key, "a list of strings")
        return [str(v) for v in value]

    def env(self, key: str) -> dict[str, str] | None:
        value = self.params.get(key)
        if value is None:
            return None
        if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str | int | float) and not isinstance(v, bool)
            for k, v in value.items()
        ):
            raise self._bad(key, "a mapping of variable names to strings")
        return {k: str(v) for k, v in value.items()}
