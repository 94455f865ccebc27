"""`ToolEnv`: a generic environment built from tools, a verifier and a reward config.

It parses each action (`parsing.py`), runs the called tool, scores answers with the verifier
and prices every step (`rewards.py`). The two error channels of `base.py` stay apart:

* model errors become short observations the policy sees: an unparseable action
  (`<error>reason</error>`, a format penalty, and after more than `max_invalid_actions` of
  them the episode ends with ``info["policy_error"] = True``), arguments that do not match
  the tool's schema, or a `ToolError` raised by the tool;
* every other exception from a tool or the verifier propagates, so the agent loop marks the
  trajectory `infra_failed` instead of training on a broken environment (reliability ENV-11).

Tools are called synchronously; an async tool needs an env whose `step` is async.

Per-episode state without subclassing: pass ``episode=make_state`` and ``make_state(task, seed)``
runs at every `reset`; a tool function or verifier that declares a parameter named ``state``
gets its return value (a secret number, a database handle), hidden from the tool's schema, and
the state's ``close()``, if it has one, runs when the episode's env is closed or reset.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from steprl.envs.base import Observation, Tool, ToolError, Transition
from steprl.envs.parsing import (
    ActionKind,
    ActionSyntax,
    FinalAnswer,
    InvalidAction,
    ToolCall,
)
from steprl.envs.rewards import RewardBreakdown, RewardConfig, step_rewards
from steprl.types import Task

#: Scores an answer: (answer text, task) -> outcome reward in [0, 1]; one that declares a
#: parameter named ``state`` also gets the episode's state (see `ToolEnv`'s ``episode``).
Verifier = Callable[..., float]

#: Builds an episode's state at `reset`: (task, seed) -> anything the tools read.
EpisodeState = Callable[[Task, int], Any]


_MAX_ERROR_CHARS = 160  # error texts are observations: keep them short for small models


@dataclass
class FunctionTool:
    """A `Tool` from a plain function returning a string (raise `ToolError` for bad input).

    Not frozen on purpose: the `Tool` protocol declares plain attributes, which a frozen
    dataclass would not satisfy for a type checker.
    """

    name: str
    description: str
    parameters: Mapping[str, Any]  # JSON schema of the keyword arguments
    fn: Callable[..., str]

    def __call__(self, **kwargs: Any) -> str:
        return self.fn(**kwargs)


def takes_state(fn: Callable[..., Any]) -> bool:
    """Whether `fn` declares a parameter named ``state`` (a `FunctionTool` is looked through)."""
    target = fn.fn if isinstance(fn, FunctionTool) else fn
    try:
        return "state" in inspect.signature(target).parameters
    except (TypeError, ValueError):  # builtins without a signature take no state
        return False


def tag_argument(tool: Tool) -> str | None:
    """The argument a tag-style call binds its body to: the tool's single required string."""
    schema = tool.parameters
    required = list(schema.get("required", ()))
    props = schema.get("properties", {})
    spec = props.get(required[0]) if len(required) == 1 else None
    return str(required[0]) if isinstance(spec, Mapping) and spec.get("type") == "string" else None


_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}


def utf8_text(text: str) -> str:
    """`text` with what UTF-8 cannot encode (lone surrogates, e.g. from a JSON ``"\\ud800"`` escape)
    replaced by "?": an observation is tokenized, and a tokenizer raises on such text, which
    would end the episode `infra_failed` for what was the model's mistake."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text


def check_arguments(arguments: Mapping[str, Any], schema: Mapping[str, Any]) -> str | None:
    """A short error for arguments that break the tool's top-level JSON schema, else None.

    Only what a model gets wrong is checked: missing, unexpected (unless the schema sets
    ``additionalProperties: true``) and wrongly typed top-level arguments (reliability BAD-03).
    """
    props: Mapping[str, Any] = schema.get("properties", {})
    for name in schema.get("required", ()):
        if name not in arguments:
            return f"missing argument '{name}'"
    if schema.get("additionalProperties") is not True:
        for name in arguments:
            if name not in props:
                return f"unexpected argument '{utf8_text(str(name)[:32])}'"
    for name, value in arguments.items():
        wanted = props.get(name, {}).get("type") if isinstance(props.get(name), Mapping) else None
        if wanted is None:
            continue
        types = [wanted] if isinstance(wanted, str) else list(wanted)
        if not any(_JSON_TYPES.get(t, lambda _: True)(value) for t in types):
            return f"argument '{name}' must be {' or '.join(types)}"
    return None


def compact_schema(schema: Any) -> Any:
    """A JSON schema without pydantic's ``title`` noise (property names are kept)."""
    if isinstance(schema, list):
        return [compact_schema(v) for v in schema]
    if not isinstance(schema, Mapping):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "title" and isinstance(value, str):
            continue
        if key == "properties" and isinstance(value, Mapping):
            out[key] = {name: compact_schema(sub) for name, sub in value.items()}
        else:
            out[key] = compact_schema(value)
    return out


def render_system_prompt(
    tools: Sequence[Tool], syntax: ActionSyntax, *, instructions: str = "", schemas: bool = False
) -> str:
    """A default system prompt: `instructions` (if any), the tools, how to call them, and how to answer.

    `schemas` adds each tool's argument schema (compacted): for tools the policy cannot know from
    their names alone, like an MCP server's (`MCPToolEnv`).
    """
    lines = [instructions.strip()] if instructions.strip() else []
    lines.append(
        "You can call tools. Tools (arguments as JSON schema):" if schemas else "You can call tools. Tools:"
    )
    for tool in tools:
        lines.append(f"- {tool.name}: {tool.description}" if tool.description else f"- {tool.name}")
        if schemas:
            lines.append(f"  arguments: {json.dumps(compact_schema(tool.parameters), ensure_ascii=False)}")
    lines.append("Call one tool per turn:")
    for name, arg in syntax.tag_tools.items():
        lines.append(f"  <{name}>{arg}</{name}>")
    if syntax.json_tools:
        lines.append(f'  <{syntax.call_tag}>{{"name": ..., "arguments": {{...}}}}</{syntax.call_tag}>')
    lines.append("A result comes back as <result>...</result>, a mistake as <error>...</error>.")
    lines.append(f"Finish with <{syntax.answer_tag}>your answer</{syntax.answer_tag}>.")
    return "\n".join(lines)


def clip_middle(text: str, limit: int) -> str:
    """Head and tail of `text` with an explicit marker, if it is longer than `limit`."""
    if len(text) <= limit:
        return text
    marker = f"...[{len(text) - limit} chars cut]..."
    head = max(0, (limit - len(marker)) // 2)
    return text[:head] + marker + text[len(text) - head :] if head else text[:limit]


class ToolEpisode:
    """Transition bookkeeping shared by tool environments (`ToolEnv`, `MCPToolEnv`): the
    invalid-action count and cut-off, and the `info` keys every transition carries."""

    rewards: RewardConfig
    max_invalid_actions: int
    format_hint: str | None
    _invalid: int
    _turn: int
    _done: bool

    def _invalid_action(self, reason: str) -> Transition:
        self._invalid += 1
        give_up = self._invalid > self.max_invalid_actions
        self._done = give_up
        shown = f"{reason}; {self.format_hint}" if self.format_hint else reason
        return self._transition(
            "" if give_up else f"<error>{shown}</error>",
            step_rewards("invalid", self.rewards),
            terminated=give_up,
            kind="invalid",
            error=reason,
            policy_error=give_up,
        )

    def _transition(
        self,
        observation: str,
        rewards: RewardBreakdown,
        *,
        kind: ActionKind,
        terminated: bool = False,
        tool: str | None = None,
        valid: bool | None = None,
        error: str | None = None,
        policy_error: bool = False,
    ) -> Transition:
        info = {
            "reward_components": rewards.as_dict(),
            "action_kind": kind,
            "tool_call_valid": valid,
            "tool_name": tool,
            "error": error,
            "policy_error": policy_error,
            "turn": self._turn,
            "invalid_actions": self._invalid,
        }
        return Transition(observation, rewards.total, terminated, False, info)


class ToolEnv(ToolEpisode):
    """Implements `Env` for any set of tools, one episode at a time (see the module docstring).

    Args:
        tools: the tools; names must be unique. Each is callable in JSON style; those with a
            single required string argument also in tag style (unless `tag_tools` is given).
        verifier: (answer text, task) -> outcome score in [0, 1].
        system_prompt: instructions for the policy; default `render_system_prompt(...)`.
        rewards: shaping terms (see `RewardConfig`).
        max_invalid_actions: invalid actions tolerated; one more ends the episode as a policy error.
        tag_tools: tool name -> argument name for tag-style calls; {} turns tag style off.
        format_hint: appended to parse errors, e.g. "use <calc>a+b</calc> or <answer>n</answer>".
        max_observation_chars: tool results longer than this are cut (head + tail + marker).
        episode: (task, seed) -> the episode's state, built at every `reset` and passed as
            ``state=`` to each tool function and to the verifier that declares ``state``.
    """

    def __init__(
        self,
        tools: Sequence[Tool],
        verifier: Verifier,
        *,
        system_prompt: str | None = None,
        rewards: RewardConfig | None = None,
        max_invalid_actions: int = 3,
        tag_tools: Mapping[str, str] | None = None,
        format_hint: str | None = None,
        max_observation_chars: int = 2048,
        episode: EpisodeState | None = None,
    ) -> None:
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be unique, got {names}; rename the duplicates.")
        if max_invalid_actions < 0:
            raise ValueError(f"max_invalid_actions must be >= 0, got {max_invalid_actions}.")
        if max_observation_chars < 1:
            raise ValueError(f"max_observation_chars must be >= 1, got {max_observation_chars}.")
        if tag_tools is None:
            tag_tools = {t.name: arg for t in tools if (arg := tag_argument(t)) is not None}
        unknown = set(tag_tools) - set(names)
        if unknown:
            raise ValueError(f"tag_tools names {sorted(unknown)} are not among the tools {names}.")
        self.tools: Mapping[str, Tool] = {t.name: t for t in tools}
        self.verifier = verifier
        self.rewards = rewards if rewards is not None else RewardConfig()
        self.max_invalid_actions = max_invalid_actions
        self.format_hint = format_hint
        self.max_observation_chars = max_observation_chars
        self.syntax = ActionSyntax(tag_tools=tag_tools, json_tools=frozenset(names))
        self.stop_strings: Sequence[str] = self.syntax.stop_strings
        self.system_prompt: str = (
            system_prompt if system_prompt is not None else render_system_prompt(tools, self.syntax)
        )
        self.episode = episode
        # decided once: which callables get the episode's state (the schema never shows it)
        self._stateful = frozenset(t.name for t in tools if takes_state(t))
        self._verifier_stateful = takes_state(verifier)
        self._state: Any = None
        self._task: Task | None = None
        self._done = True
        self._invalid = 0
        self._turn = 0

    def reset(self, task: Task, seed: int) -> Observation:
        """Start an episode on `task`; the first observation is the task's prompt."""
        self._close_state()
        self._task, self._done, self._invalid, self._turn = task, False, 0, 0
        self._state = self.episode(task, seed) if self.episode is not None else None
        return Observation(text=task.prompt, info={"task_id": task.id, "seed": seed})

    def step(self, action: str) -> Transition:
        """Answer one action (see the module docstring for the error channels)."""
        if self._task is None or self._done:
            raise RuntimeError(
                "ToolEnv.step() called before reset() or after the episode ended; call reset(task, seed)."
            )
        self._turn += 1
        parsed = self.syntax.parse(action)
        if isinstance(parsed, InvalidAction):
            return self._invalid_action(parsed.reason)
        if isinstance(parsed, FinalAnswer):
            extra = {"state": self._state} if self._verifier_stateful else {}
            score = self.verifier(parsed.text, self._task, **extra)
            self._done = True
            return self._transition(
                "", step_rewards("answer", self.rewards, outcome=score), terminated=True, kind="answer"
            )
        return self._call(parsed)

    def close(self) -> None:
        """Releases the episode's state (its ``close()``); safe to call any number of times."""
        self._close_state()
        self._task, self._done = None, True

    def _close_state(self) -> None:
        state, self._state = self._state, None
        closer = getattr(state, "close", None)
        if callable(closer):
            closer()

    def _call(self, call: ToolCall) -> Transition:
        tool = self.tools[call.name]
        rewards = step_rewards("tool_call", self.rewards)
        error = check_arguments(call.arguments, tool.parameters)
        if error is None:
            try:
                # the env's state wins over a model-sent "state" argument
                extra = {"state": self._state} if call.name in self._stateful else {}
                out = tool(**{**call.arguments, **extra})
            except ToolError as exc:
                error = str(exc) or "tool error"
            else:
                if not isinstance(out, str):
                    raise TypeError(
                        f"tool {call.name!r} returned {type(out).__name__}; tools must return str "
                        "(raise ToolError for bad input)."
                    )
                observation = f"<result>{clip_middle(utf8_text(out), self.max_observation_chars)}</result>"
                return self._transition(observation, rewards, kind="tool_call", tool=call.name, valid=True)
        error = clip_middle(utf8_text(error), _MAX_ERROR_CHARS)
        return self._transition(
            f"<error>{error}</error>", rewards, kind="tool_call", tool=call.name, valid=False, error=error
        )
