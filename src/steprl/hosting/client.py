"""`RemoteEnv`: the `Env` protocol over HTTP (httpx), and `HttpEnvBackend`, which makes them.

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
own deadline, retries and error classification, exactly as above. The price: a batch is answered
when its slowest call is, so a slow env call delays the calls batched with it (never past their
own deadlines). `coalesce=False` sends one request per call.

httpx clients are bound to the event loop they were first used on, and the trainer runs one
`asyncio.run` per rollout phase, so `ClientPool` hands each env a client made on the running
loop, reuses it (and its open connection) for the next env on that loop, and closes it with the
loop (see `ClientPool` for why not one client shared by all envs).
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from steprl.envs.base import EnvTimeout, InfraError, Observation, Transition
from steprl.hosting.client_pool import ClientPool
from steprl.hosting.coalesce import Answer, Coalescers, answer_from
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
    transition_from_wire,
)
from steprl.types import Task

_RETRY_STATUSES = frozenset({502, 503, 504})
_COALESCED = frozenset({"create", "reset", "step", "close"})


class RemoteEnvError(InfraError):
    """The env server refused or failed a call. `status` is the HTTP status (None: no answer,
    e.g. the server is unreachable); `type` the error envelope's type ("not_found", ...)."""

    def __init__(self, message: str, *, status: int | None = None, type_: str = "transport") -> None:
        super().__init__(message)
        self.status = status
        self.type = type_


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


def _error_from(answer: Answer, what: str) -> RemoteEnvError:
    try:
        error = ErrorEnvelope.model_validate(answer.data).error
        type_, message = error.type, error.message
    except ValueError:
        type_, message = "http_error", answer.text
    status = answer.status
    return RemoteEnvError(f"{what}: HTTP {status} {type_}: {message}", status=status, type_=type_)


class RemoteEnv:
    """An env instance on a steprl env server, behind the `Env` protocol.

    The server-side instance is created lazily by the first `reset` (the agent loop builds envs
    synchronously, outside any event loop). `stop_strings` and `system_prompt` are the server
    env's, known after that create (the given defaults until then).
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
        clients: ClientPool | None = None,
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
        self._headers = {"Authorization": f"Bearer {token}"}
        self._clients = clients or ClientPool(max_idle=0)  # a pool of its own: the client closes with the env
        self._coalescers = coalescers  # None: one request per call
        self._rng = rng or random.Random()
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
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
        return observation_from_wire(_parse(ObservationMsg, data, "reset"))

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
        transition = transition_from_wire(_parse(TransitionMsg, data, "step"))
        self._seq, self._step_failed = seq, False
        return transition

    async def close(self) -> None:
        """Close the server instance (404: already gone with a restarted server, fine) and
        release the pooled client. Safe to call more than once."""
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
            await self._release_client()

    async def _create(self) -> None:
        if self._client is None and self._coalescers is None:  # a retried create keeps its client
            self._client = self._clients.acquire(self.url)
            self._loop = asyncio.get_running_loop()
        # One key for every try of this create: a retry after a lost answer gets the same instance.
        body = CreateRequest(env=self.env, params=self.params, key=uuid.uuid4().hex).model_dump()
        created = _parse(CreateResponse, await self._request("POST", "/v1/envs", body, "create"), "create")
        self._id = created.instance_id
        self.stop_strings = tuple(created.stop_strings)
        self.system_prompt = created.system_prompt

    async def _release_client(self) -> None:
        if self._loop is not None and self._client is not None:
            loop, client, self._loop, self._client = self._loop, self._client, None, None
            await self._clients.release(loop, client)

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
                error = _error_from(answer, what)
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


def _parse(model: Any, data: Any, what: str) -> Any:
    try:
        return model.model_validate(data)
    except ValueError as err:
        raise RemoteEnvError(f"{what}: malformed answer from the server: {err}", type_="protocol") from None


class HttpEnvBackend:
    """`EnvBackend` whose envs live on a steprl env server (`steprl serve-env`).

    `make_env` does no I/O (the agent loop calls it synchronously): each `RemoteEnv` creates its
    server instance at its first reset. `from_runtime` connects to `runtime.env_server_url`, or
    starts a `LocalEnvServer` for the run (stopped by `close`).
    """

    name = "http"

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
        server: Any = None,
        coalesce: bool = True,
    ) -> None:
        if not token:
            raise ValueError("HttpEnvBackend needs the server's bearer token (see `steprl serve-env`)")
        self.url = url.rstrip("/")
        self.env = env
        self.params = dict(params or {})
        self.call_timeout_s = call_timeout_s
        self.close_timeout_s = close_timeout_s
        self.retry = retry or RetryPolicy()
        self.clients = ClientPool()
        # Calls of this backend's envs made in the same loop tick share one POST /v1/batch.
        self.coalescers = Coalescers(self.clients) if coalesce else None
        self.server = server  # a LocalEnvServer this backend owns, or None
        self._token = token
        self._stop_strings: Sequence[str] = ()
        self._system_prompt = ""

    def __repr__(self) -> str:  # never shows the token
        return f"HttpEnvBackend({self.url!r}, env={self.env!r})"

    def make_env(self, task: Task) -> RemoteEnv:
        return RemoteEnv(
            self.url,
            self._token,
            self.env,
            self.params,
            call_timeout_s=self.call_timeout_s,
            close_timeout_s=self.close_timeout_s,
            retry=self.retry,
            clients=self.clients,
            coalescers=self.coalescers,
            stop_strings=self._stop_strings,
            system_prompt=self._system_prompt,
        )

    def probe(self) -> None:
        """Fail fast: create and close one instance now (checks the URL, token, env and params)
        and remember its stop strings and system prompt for envs not yet reset."""
        headers = {"Authorization": f"Bearer {self._token}"}
        what = f"env server {self.url} (env {self.env!r})"
        # One key for every try of this create: a retry after a lost answer gets the same instance.
        body = CreateRequest(env=self.env, params=self.params, key=uuid.uuid4().hex).model_dump()
        with httpx.Client(
            base_url=self.url, headers=headers, timeout=self.call_timeout_s, trust_env=False
        ) as c:
            try:
                response = c.post("/v1/envs", json=body)
                if not response.is_success:
                    raise _error_from(answer_from(response), f"probing {what}")
                created = _parse(CreateResponse, response.json(), f"probing {what}")
                c.delete(f"/v1/envs/{created.instance_id}")
            except httpx.HTTPError as exc:
                raise RemoteEnvError(f"probing {what}: {type(exc).__name__}: {exc}; is it running?") from None
        self._stop_strings, self._system_prompt = tuple(created.stop_strings), created.system_prompt

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    @classmethod
    def from_runtime(cls, env: str, params: Mapping[str, Any], runtime: Any) -> HttpEnvBackend:
        """From a `steprl.config.RuntimeSection`: `env_server_url` with the token read from the
        environment variable `env_token_var`, or (url unset) a loopback server for this run."""
        import os

        from steprl.hosting.local_server import LocalEnvServer

        call_timeout = float(runtime.env_call_timeout_s)
        server = None
        if runtime.env_server_url:
            url = str(runtime.env_server_url)
            token = os.environ.get(runtime.env_token_var, "")
            if not token:
                raise ValueError(
                    f"runtime.env_server_url is {url} but the environment variable {runtime.env_token_var} "
                    "is empty; export the server's token there (see `steprl serve-env`)"
                )
        else:
            # The server's handler deadline is shorter than the client's call deadline, so a
            # hung env is answered 504 (and destroyed) before the client gives up on it; a server
            # that dies is restarted (its in-flight episodes end infra_failed, later ones run).
            server = LocalEnvServer(
                max_instances=int(runtime.max_concurrent_envs),
                handler_timeout_s=0.8 * call_timeout,
                auto_restart=True,
                plugins=tuple(runtime.env_server_plugins),
            ).start()
            url, token = server.url, server.token
        backend = cls(url, token, env, params, call_timeout_s=call_timeout, server=server)
        try:
            backend.probe()
        except Exception:
            backend.close()
            raise
        return backend
