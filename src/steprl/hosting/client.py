"""`RemoteEnv`: the `Env` protocol over HTTP; `HttpEnvBackend` (`http_backend.py`) makes them.

    backend = HttpEnvBackend("http://127.0.0.1:8765", token, "calculator", {})
    env = backend.make_env(task)          # no I/O yet: the agent loop calls this synchronously
    obs = await env.reset(task, seed)     # creates the server-side instance, then resets it
    tr = await env.step("<calc>1+2</calc>")
    await env.close()

Failure semantics (reference/reliability.md §2.2):

* every call has a deadline (`call_timeout_s`, retries included); a call that passes it, or a
  504 from the server's handler deadline, raises `EnvTimeout` (trajectory `env_timeout`);
* create, reset and close are retried on connection errors, timeouts and 502/503/504, with
  exponential backoff and full jitter, a bounded number of attempts and the call's deadline,
  honouring Retry-After; step is retried the same way but always with the same `seq`, which the
  server de-duplicates, so a retried step is never applied twice;
* every other failure (4xx, env_error, unreachable server) raises `RemoteEnvError`, an
  `InfraError` (trajectory `infra_failed`). The agent loop keeps the text in the trajectory's
  info; none of it reaches the model's context.

Coalescing (`HttpEnvBackend(coalesce=True)`, the default): the calls that a backend's envs make
in the same event-loop tick travel as one `POST /v1/batch` (`coalesce.py`); each call keeps its
own deadline, retries and error classification, exactly as above. The answer is streamed, so
a slow env call holds back the calls batched with it by at most a few milliseconds (`batch.py`).

`coalesce=False` sends one request per call, each env over an httpx client of its own (one
keep-alive connection), made on the loop of its first call (httpx clients belong to a loop)
and closed with the env.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from steprl.envs.base import EnvTimeout, InfraError, Observation, ToolInfo, Transition
from steprl.hosting.coalesce import Answer, Coalescers, answer_from, async_client
from steprl.hosting.protocol import (
    CreateRequest,
    CreateResponse,
    ErrorEnvelope,
    ObservationMsg,
    ResetRequest,
    StepRequest,
    TransitionMsg,
    observation_from_wire,
    task_to_wire,
    tools_from_wire,
    transition_from_wire,
)
from steprl.types import Task

_RETRY_STATUSES = frozenset({502, 503, 504})
_COALESCED = frozenset({"create", "reset", "step", "close"})


class RemoteEnvError(InfraError):
    """The env server refused or failed a call. `status` is the HTTP status (None: no answer,
    e.g. the server is unreachable); `type` the error envelope's type ("not_found", ...);
    `detail` the server's own message, when it sent one."""

    def __init__(
        self, message: str, *, status: int | None = None, type_: str = "transport", detail: str = ""
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.detail = detail


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter (sleep ~ U(0, min(max_backoff_s, base_s * 2**k))).

    At most `max_attempts` tries, all within the call's deadline. `attempt_timeout_s` bounds one
    try (None: the rest of the deadline), so a lost answer can be retried before the deadline.
    """

    max_attempts: int = 5
    base_s: float = 0.05
    max_backoff_s: float = 2.0
    attempt_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        if self.base_s < 0 or self.max_backoff_s < 0:
            raise ValueError("RetryPolicy.base_s and max_backoff_s must be >= 0")

    def backoff(self, attempt: int, rng: random.Random) -> float:
        """Seconds to wait after failed try number `attempt` (1-based)."""
        return rng.uniform(0.0, min(self.max_backoff_s, self.base_s * 2 ** (attempt - 1)))


def error_from(answer: Answer, what: str) -> RemoteEnvError:
    try:
        error = ErrorEnvelope.model_validate(answer.data).error
        type_, message = error.type, error.message
    except ValueError:
        type_, message = "http_error", answer.text
    status = answer.status
    return RemoteEnvError(
        f"{what}: HTTP {status} {type_}: {message}", status=status, type_=type_, detail=message
    )


class RemoteEnv:
    """An env instance on a steprl env server, behind the `Env` protocol.

    The server-side instance is created lazily by the first `reset` (the agent loop builds envs
    synchronously, outside any event loop). `stop_strings` and `system_prompt` are the server
    env's, known after that create (the given defaults until then); `tools` after each reset.
    """

    def __init__(
        self,
        url: str,
        token: str,
        env: str,
        params: Mapping[str, Any] | None = None,
        *,
        call_timeout_s: float = 30.0,
        close_timeout_s: float = 5.0,
        retry: RetryPolicy | None = None,
        coalescers: Coalescers | None = None,
        stop_strings: Sequence[str] = (),
        system_prompt: str = "",
        rng: random.Random | None = None,
    ) -> None:
        if call_timeout_s <= 0 or close_timeout_s <= 0:
            raise ValueError("call_timeout_s and close_timeout_s must be > 0 seconds")
        self.url = url.rstrip("/")
        self.env = env
        self.params = dict(params or {})
        self.call_timeout_s = call_timeout_s
        self.close_timeout_s = close_timeout_s
        self.retry = retry or RetryPolicy()
        self.stop_strings: Sequence[str] = tuple(stop_strings)
        self.system_prompt: str = system_prompt
        self.tools: Mapping[str, ToolInfo] = {}
        self._headers = {"Authorization": f"Bearer {token}"}
        self._coalescers = coalescers  # None: one request per call
        self._rng = rng or random.Random()
        self._client: httpx.AsyncClient | None = None  # coalescers=None only
        self._id: str | None = None
        self._seq = 0
        self._closed = False
        self._step_failed = False  # the last step raised: its seq may be applied on the server
        self._unreachable = False  # the last call could not reach the server at all

    @property
    def instance_id(self) -> str | None:
        return self._id

    def __repr__(self) -> str:  # never shows the token
        return f"RemoteEnv({self.url!r}, env={self.env!r}, instance={self._id})"

    async def reset(self, task: Task, seed: int) -> Observation:
        if self._closed:
            raise RemoteEnvError("reset() after close(); the agent loop makes a new env per episode")
        if self._id is None:
            await self._create()
        body = ResetRequest(task=task_to_wire(task), seed=seed)
        data = await self._request("POST", f"/v1/envs/{self._id}/reset", body.model_dump(), "reset")
        self._seq, self._step_failed = 0, False
        msg = parse_answer(ObservationMsg, data, "reset")
        if msg.system_prompt is not None:  # an env may learn its tools at reset (MCP)
            self.system_prompt = msg.system_prompt
        if msg.tools is not None:
            self.tools = tools_from_wire(msg.tools)
        return observation_from_wire(msg)

    async def step(self, action: str) -> Transition:
        if self._id is None or self._closed:
            raise RemoteEnvError("step() before reset() or after close()")
        if self._step_failed:
            # The server may have applied that step: sending the next action under the same seq
            # would be answered with the cached result of the failed one.
            raise RemoteEnvError("a previous step of this episode failed; reset (or use a new env) first")
        seq = self._seq + 1  # the idempotency key: every retry of this step carries it
        body = StepRequest(action=action, seq=seq).model_dump()
        self._step_failed = True
        data = await self._request("POST", f"/v1/envs/{self._id}/step", body, "step")
        transition = transition_from_wire(parse_answer(TransitionMsg, data, "step"))
        self._seq, self._step_failed = seq, False
        return transition

    async def close(self) -> None:
        """Close the server instance (404: already gone with a restarted server, fine) and
        its own client. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._id is not None:
                try:
                    await self._request(
                        "DELETE",
                        f"/v1/envs/{self._id}",
                        None,
                        "close",
                        timeout_s=self.close_timeout_s,
                        retry=not self._unreachable,
                    )
                except RemoteEnvError as err:
                    if err.status != 404:
                        raise
        finally:
            if self._client is not None:
                client, self._client = self._client, None
                await client.aclose()

    async def _create(self) -> None:
        if self._client is None and self._coalescers is None:  # a retried create keeps its client
            self._client = async_client(self.url)
        # One key for every try of this create: a retry after a lost answer gets the same instance.
        body = CreateRequest(env=self.env, params=self.params, key=uuid.uuid4().hex).model_dump()
        created = parse_answer(
            CreateResponse, await self._request("POST", "/v1/envs", body, "create"), "create"
        )
        self._id = created.instance_id
        self.stop_strings = tuple(created.stop_strings)
        self.system_prompt = created.system_prompt

    async def _request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None,
        what: str,
        *,
        timeout_s: float | None = None,
        retry: bool = True,
    ) -> Any:
        """One call with its deadline and retries; the decoded JSON of a 2xx answer."""
        op = what
        budget = timeout_s or self.call_timeout_s
        what = f"{what} on env {self.env!r} at {self.url}"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget
        last: InfraError = EnvTimeout(f"{what}: no answer within {budget:g}s")
        for attempt in range(1, self.retry.max_attempts + 1):
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            per_try = min(remaining, self.retry.attempt_timeout_s or remaining)
            retry_after = 0.0
            try:
                answer = await self._attempt(method, path, body, op, per_try)
            except (TimeoutError, httpx.TimeoutException):
                last = EnvTimeout(f"{what}: no answer within {per_try:.3g}s (try {attempt})")
                self._unreachable = False
            except httpx.TransportError as exc:
                last = RemoteEnvError(
                    f"{what}: {type(exc).__name__}: {exc or 'connection failed'} (try {attempt}); "
                    "is the env server running and reachable?"
                )
                self._unreachable = True
            else:
                self._unreachable = False
                if answer.is_success:
                    if answer.data is None:
                        raise RemoteEnvError(
                            f"{what}: the answer is not JSON {answer.text}".rstrip(),
                            status=answer.status,
                            type_="protocol",
                        )
                    return answer.data
                error = error_from(answer, what)
                if answer.status == 504 and error.type == "handler_timeout":
                    raise EnvTimeout(str(error))  # the server destroyed the instance: retrying is pointless
                if answer.status not in _RETRY_STATUSES:
                    raise error
                last = EnvTimeout(str(error)) if answer.status == 504 else error
                retry_after = answer.retry_after_s
            if not retry or attempt == self.retry.max_attempts:
                break
            pause = max(retry_after, self.retry.backoff(attempt, self._rng))
            if loop.time() + pause >= deadline:
                break
            await asyncio.sleep(pause)
        raise last

    async def _attempt(
        self, method: str, path: str, body: Mapping[str, Any] | None, op: str, timeout_s: float
    ) -> Answer:
        """One try within `timeout_s` (else `TimeoutError`): through the loop's coalescer, which
        enforces each call's deadline, else a request of its own."""
        if self._coalescers is not None and op in _COALESCED:
            coalescer = self._coalescers.get(self.url, self._headers)
            return await coalescer.call(self._id or "", op, body, timeout_s)
        assert self._client is not None, "the client is acquired by _create()"
        async with asyncio.timeout(timeout_s):
            response = await self._client.request(
                method, self.url + path, json=body, headers=self._headers, timeout=timeout_s
            )
        return answer_from(response)


def parse_answer(model: Any, data: Any, what: str) -> Any:
    try:
        return model.model_validate(data)
    except ValueError as err:
        raise RemoteEnvError(f"{what}: malformed answer from the server: {err}", type_="protocol") from None
