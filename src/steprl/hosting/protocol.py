"""The env server's wire format: pydantic models shared by the server and `RemoteEnv`.

One JSON body per route (``extra="forbid"``, strict types, so a typo or a wrong type is a 422,
never a silently ignored field)::

    POST   /v1/envs             {env, params, key} -> {instance_id, stop_strings, system_prompt}
    POST   /v1/envs/{id}/reset  {task, seed}   -> {text, info, system_prompt, tools}
    POST   /v1/envs/{id}/step   {action, seq}  -> {observation, reward, terminated, truncated, info}
    DELETE /v1/envs/{id}                       -> {closed: true}
    POST   /v1/batch  {calls: [{instance_id, op, body}]} -> {results: [{status, body, headers}]}
    any error                                  -> {"error": {"type", "message"}}

`/v1/batch` carries many create/reset/step/close calls in one request (the client coalesces the calls
its episodes make in the same event-loop tick): each call's `body` is that route's body, each
result the status and body that route would have answered, in call order; or, when the request
accepts `application/x-ndjson`, streamed as the calls finish: one line per burst, an array of
results that each carry their call's `index`.

`key` is a create's idempotency key: a create repeated with the same key (a retry whose first
answer was lost) is answered with the instance the first one made, if it still lives.
`seq` is the step's idempotency key: 1 for the first step after a reset, then +1 per step. The
server applies a step once; a repeat of the last `seq` returns the cached answer (reliability
ENV-04). Env `info` mappings pass through `json_safe` on the server, so whatever an env puts
there (tuples, sets, enums, NaN, numpy scalars) reaches the client as plain JSON.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from steprl.envs.base import Env, Observation, ToolInfo, Transition, tool_infos
from steprl.envs.contract import text_problem
from steprl.types import Task

#: The environment variables of the server launch contract, read by both sides: the bearer token
#: (never on a command line), and the pid `LocalEnvServer` sets so its server exits with it.
TOKEN_VAR = "STEPRL_ENV_TOKEN"
PARENT_VAR = "STEPRL_ENV_SERVER_PARENT"

_MAX_DEPTH = 32  # deeper info structures are cut (an env bug, not worth a failed episode)


def _lone_surrogate(value: Any, depth: int = 0) -> str | None:
    """The message for the first string in `value` (keys included) that is not valid Unicode."""
    if isinstance(value, str):
        problem = text_problem("a string", value)
        return None if problem is None else problem.message.split(";")[0]
    if depth < _MAX_DEPTH and isinstance(value, dict):
        return next(
            (m for k, v in value.items() for m in (_lone_surrogate(k), _lone_surrogate(v, depth + 1)) if m),
            None,
        )
    if depth < _MAX_DEPTH and isinstance(value, list | tuple):
        return next((m for v in value if (m := _lone_surrogate(v, depth + 1))), None)
    return None


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        # JSON's "\ud800" escape parses to a lone surrogate that no env, tokenizer or reply
        # can encode: a 422 naming it, not a 500 when the answer fails to serialize
        message = _lone_surrogate(value)
        if message is not None:
            raise ValueError(f"{message}; send valid UTF-16 surrogate pairs")
        return value


class CreateRequest(_Wire):
    env: str = Field(min_length=1, max_length=200)  # a registered env name
    params: dict[str, Any] = Field(default_factory=dict)  # the env factory's keyword arguments
    # Idempotency key: a retry of this create with the same key gets the same instance (while
    # it lives), so a create whose answer was lost leaves no orphan. None: no de-duplication.
    key: str | None = Field(default=None, min_length=1, max_length=200)


class CreateResponse(_Wire):
    instance_id: str
    stop_strings: list[str]
    system_prompt: str


class TaskMsg(_Wire):
    """`steprl.types.Task` on the wire (all of its fields)."""

    id: str
    prompt: str
    env: str
    seed: int = 0
    answer: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)


class ResetRequest(_Wire):
    task: TaskMsg
    seed: int


class ToolMsg(_Wire):
    """One of the env's tools as a chat template shows it (`steprl.envs.base.ToolInfo`)."""

    name: str
    description: str
    parameters: dict[str, Any] = Field(default_factory=dict)  # JSON schema of the arguments


class ObservationMsg(_Wire):
    text: str
    info: dict[str, Any] = Field(default_factory=dict)
    # the env's system prompt and tools after this reset: an env may learn its tools only then (MCP)
    system_prompt: str | None = None
    tools: list[ToolMsg] | None = None


class StepRequest(_Wire):
    action: str
    seq: int = Field(ge=1)  # idempotency key: 1 for the first step after a reset


class TransitionMsg(_Wire):
    observation: str
    reward: float = Field(allow_inf_nan=False)
    terminated: bool
    truncated: bool = False
    info: dict[str, Any] = Field(default_factory=dict)


class ClosedResponse(_Wire):
    closed: bool = True


class ErrorBody(_Wire):
    type: str  # machine-readable: "not_found", "episode_over", "env_error", ...
    message: str  # for humans: what happened and how to fix it; never a traceback


class ErrorEnvelope(_Wire):
    error: ErrorBody


MAX_MESSAGE_CHARS = 2000  # an error message longer than this is cut


def error_body(type_: str, message: str) -> dict[str, Any]:
    """The body of every error answer: routes, batched calls and the security middlewares."""
    return ErrorEnvelope(error=ErrorBody(type=type_, message=message[:MAX_MESSAGE_CHARS])).model_dump()


#: Calls per batch: bounds the work one request can queue (the body cap bounds its bytes).
MAX_BATCH_CALLS = 512
#: The media type of a streamed batch answer (asked for with `Accept`): one JSON line per burst
#: of calls that finished together, an array of `{"index", "status", "body", "headers"}`.
NDJSON = "application/x-ndjson"


class BatchCall(_Wire):
    instance_id: str = Field(default="", max_length=200)  # "" for a create
    op: Literal["create", "reset", "step", "close"]
    body: dict[str, Any] = Field(default_factory=dict)  # CreateRequest / ResetRequest / StepRequest / {}


class BatchRequest(_Wire):
    calls: list[BatchCall] = Field(min_length=1, max_length=MAX_BATCH_CALLS)


class BatchResult(_Wire):
    status: int  # what the single route would have answered
    body: dict[str, Any]  # its body: the answer, or an ErrorEnvelope
    headers: dict[str, str] = Field(default_factory=dict)  # e.g. Retry-After of a 503


class BatchResponse(_Wire):
    results: list[BatchResult]


def json_safe(value: Any, _depth: int = 0) -> Any:
    """`value` as plain JSON types: mappings -> dicts with str keys, sequences and sets -> lists,
    enums -> their value, non-finite floats -> "nan" / "inf" / "-inf" (JSON has no NaN),
    bytes -> text, numpy/torch scalars -> Python numbers, anything else -> its `repr`."""
    if type(value) is dict and _plain(value, _depth):
        return value  # the common case (plain JSON already), returned as is: no copy
    if _depth > _MAX_DEPTH:
        return "<too deep>"
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, enum.Enum):
        return json_safe(value.value, _depth + 1)
    if isinstance(value, Mapping):
        return {str(k): json_safe(v, _depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v, _depth + 1) for v in value]
    if isinstance(value, set | frozenset):
        return sorted((json_safe(v, _depth + 1) for v in value), key=repr)
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", errors="replace")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: json_safe(getattr(value, f.name), _depth + 1) for f in dataclasses.fields(value)}
    item = getattr(value, "item", None)
    if callable(item):  # numpy / torch scalars
        try:
            return json_safe(item(), _depth + 1)
        except (TypeError, ValueError):
            pass
    return repr(value)


_SCALARS = frozenset({str, int, bool, type(None)})


def _plain(value: dict[Any, Any] | list[Any], depth: int = 0) -> bool:
    """Whether `value` is already plain JSON: dicts with str keys, lists, scalars, finite floats,
    nested at most `_MAX_DEPTH` deep. (Rebuilding every info dict cost 5x this check.)"""
    if depth > _MAX_DEPTH:
        return False
    is_dict = type(value) is dict
    for key, item in value.items() if is_dict else enumerate(value):  # type: ignore[union-attr]
        kind = type(item)
        if (is_dict and type(key) is not str) or not (
            kind in _SCALARS
            or (kind is float and math.isfinite(item))
            or ((kind is dict or kind is list) and _plain(item, depth + 1))
        ):
            return False
    return True


def task_to_wire(task: Task) -> TaskMsg:
    return TaskMsg(
        id=task.id,
        prompt=task.prompt,
        env=task.env,
        seed=task.seed,
        answer=task.answer,
        params=json_safe(dict(task.params)),
    )


def task_from_wire(msg: TaskMsg) -> Task:
    return Task(
        id=msg.id, prompt=msg.prompt, env=msg.env, seed=msg.seed, answer=msg.answer, params=msg.params
    )


def observation_to_wire(obs: object) -> ObservationMsg:
    """The env's reset result on the wire; a wrong type is the env's bug (TypeError)."""
    if not isinstance(obs, Observation) or not isinstance(obs.text, str):
        raise TypeError(f"reset() must return Observation(text: str, info), got {type(obs).__name__}")
    return ObservationMsg(text=obs.text, info=json_safe(dict(obs.info)))


def tools_to_wire(env: Env) -> list[ToolMsg]:
    """The env's tools (`Env.tools`) on the wire: their schemas made plain JSON."""
    return [
        ToolMsg(name=str(t.name), description=str(t.description), parameters=json_safe(dict(t.parameters)))
        for t in tool_infos(env)
    ]


def tools_from_wire(tools: list[ToolMsg]) -> dict[str, ToolInfo]:
    return {t.name: ToolInfo(t.name, t.description, t.parameters) for t in tools}


def observation_from_wire(msg: ObservationMsg) -> Observation:
    return Observation(text=msg.text, info=msg.info)


def transition_to_wire(t: object) -> TransitionMsg:
    """The env's step result on the wire; a wrong type or a non-finite reward is the env's bug."""
    if not isinstance(t, Transition) or not isinstance(t.observation, str):
        raise TypeError(f"step() must return Transition(observation: str, ...), got {type(t).__name__}")
    reward = float(t.reward)
    if not math.isfinite(reward):
        raise ValueError(f"step() returned a non-finite reward ({reward}); rewards must be finite numbers")
    return TransitionMsg(
        observation=t.observation,
        reward=reward,
        terminated=bool(t.terminated),
        truncated=bool(t.truncated),
        info=json_safe(dict(t.info)),
    )


def transition_from_wire(msg: TransitionMsg) -> Transition:
    return Transition(
        observation=msg.observation,
        reward=msg.reward,
        terminated=msg.terminated,
        truncated=msg.truncated,
        info=msg.info,
    )
