"""`Coalescer`: the create/reset/step/close calls of many `RemoteEnv`s on one loop, sent as one request.

Why: in the agent loop the engine answers a whole batch of episodes at once and every episode
then calls `env.step` in the same event-loop tick. Sent one request each, those calls queue on
per-request CPU (HTTP parsing, routing, JSON on both sides: ~2 ms a call); sent as one
`POST /v1/batch` they share that cost. The window is a few `loop.call_soon` ticks, never a
wall-clock delay, so a lone call is sent at once and pays no added latency.

Each call gets back an `Answer`: the status and body its single route would have answered
(for a batch refused as a whole, e.g. a 503 or 413, every call gets that answer), or the
transport exception (httpx) of the batch request, raised in each caller, whose own retry loop
then decides (a step is retried with its seq, which the server de-duplicates).
"""

from __future__ import annotations

import asyncio
import functools
import json
import ssl
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import httpx

from steprl.hosting.plain_http import PlainHttp, Reply
from steprl.hosting.protocol import MAX_BATCH_CALLS, NDJSON

_MAX_RETRY_AFTER_S = 60.0

# Below the server's keep-alive (5 s): a connection is never reused at the very moment the
# server closes it (a "server disconnected" on a healthy server, which would cost a retry).
_LIMITS = httpx.Limits(max_connections=2, max_keepalive_connections=1, keepalive_expiry=2.0)


@functools.cache
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()  # ~35 ms: built once per process, for https only


def async_client(url: str) -> httpx.AsyncClient:
    """An httpx client for one env or one coalescer: TLS verified for https (one shared
    context), none to set up for plain http; proxies from the environment are ignored."""
    verify: ssl.SSLContext | bool = _tls() if url.startswith("https:") else False
    return httpx.AsyncClient(limits=_LIMITS, verify=verify, trust_env=False)


_Key = tuple[str, tuple[tuple[str, str], ...]]  # (server URL, request headers)


@dataclass(frozen=True)
class Answer:
    """One call's answer: HTTP `status`, decoded JSON `data` (None: not JSON, see `text`)."""

    status: int
    data: Any
    text: str = ""
    retry_after_s: float = 0.0

    @property
    def is_success(self) -> bool:
        return 200 <= self.status < 300


def retry_after(headers: Mapping[str, str]) -> float:
    try:
        value = float(headers.get("retry-after", headers.get("Retry-After", 0)))
        return min(max(value, 0.0), _MAX_RETRY_AFTER_S)
    except ValueError:  # an HTTP date: not sent by our server; fall back to the backoff
        return 0.0


def answer_from(response: httpx.Response | Reply) -> Answer:
    status = response.status_code
    try:
        data = json.loads(response.content)
    except ValueError:
        data = None
    text = ""  # for error messages only: not decoded for a JSON success (a whole batch's answer)
    if data is None or not 200 <= status < 300:
        text = response.content[:200].decode("utf-8", errors="replace") or _reason(status)
    return Answer(status, data, text, retry_after(response.headers))


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return f"HTTP {status}"


@dataclass
class _Call:
    item: bytes  # the call's JSON, serialized once by its caller
    deadline: float  # loop time; the batch request waits no longer than its latest call
    future: asyncio.Future[Answer]


@dataclass
class Counter:
    """Batches sent, over every loop (a test and benchmark counter)."""

    batches_sent: int = 0


@dataclass
class Coalescer:
    """Collects the calls made to one server on one loop and sends each tick's calls as one batch.

    `ticks`: loop iterations a window stays open (ready callbacks of other episodes run first).
    `max_calls` / `max_bytes`: one request's bounds; a fuller window is split into several.
    `plain_http`: use `PlainHttp` for `http://` URLs (False: httpx, as for `https://`).
    `stream`: ask for a streamed answer (NDJSON: each call's result as it is final; False: the
    whole batch answered at once, so a slow call holds back the others).
    Each transport is made on first use and closed when `asyncio.run` shuts its loop down.
    """

    url: str
    headers: Mapping[str, str]
    ticks: int = 2
    max_calls: int = MAX_BATCH_CALLS
    max_bytes: int = 512 * 1024
    plain_http: bool = True
    stream: bool = True
    counter: Counter = field(default_factory=Counter)
    _pending: list[_Call] = field(default_factory=list)
    _plain: PlainHttp | None = None
    _httpx: httpx.AsyncClient | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def call(
        self, instance_id: str, op: str, body: Mapping[str, Any] | None, timeout_s: float
    ) -> Answer:
        """The answer to `op` on `instance_id`, sent in the current window's batch; raises
        `TimeoutError` when none came within `timeout_s`."""
        loop = asyncio.get_running_loop()
        item = json.dumps({"instance_id": instance_id, "op": op, "body": dict(body or {})}).encode()
        fut: asyncio.Future[Answer] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._tick, loop, self.ticks - 1)
        self._pending.append(_Call(item, loop.time() + timeout_s, fut))
        if len(self._pending) >= self.max_calls:
            self._flush(loop)
        return await fut

    def _transport(self, loop: asyncio.AbstractEventLoop) -> PlainHttp | httpx.AsyncClient:
        """The loop's keep-alive client: `PlainHttp` for plain http://, else httpx (https)."""
        transport: PlainHttp | httpx.AsyncClient | None = self._plain or self._httpx
        if transport is None:
            if self.plain_http and self.url.startswith("http://"):
                transport = self._plain = PlainHttp(self.url, self.headers)
            else:
                transport = self._httpx = async_client(self.url)
            # asyncio.run cancels pending tasks before it closes the loop: close connections then.
            # Dropped from `_tasks` when done, so no finished task keeps the closed loop alive.
            closer = loop.create_task(_close_at_shutdown(transport))
            self._tasks.add(closer)
            closer.add_done_callback(self._tasks.discard)
        return transport

    def _tick(self, loop: asyncio.AbstractEventLoop, left: int) -> None:
        if left > 0 and self._pending:
            loop.call_soon(self._tick, loop, left - 1)
        else:
            self._flush(loop)

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        calls = [c for c in self._pending if not c.future.done()]  # a caller that gave up is dropped
        self._pending = []
        batch: list[_Call] = []
        size = 0
        for c in calls:
            if batch and size + len(c.item) > self.max_bytes:
                self._send_soon(loop, batch)
                batch, size = [], 0
            batch.append(c)
            size += len(c.item) + 1
        if batch:
            self._send_soon(loop, batch)

    def _send_soon(self, loop: asyncio.AbstractEventLoop, batch: list[_Call]) -> None:
        task = loop.create_task(self._send(loop, batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, loop: asyncio.AbstractEventLoop, batch: list[_Call]) -> None:
        self.counter.batches_sent += 1
        content = b'{"calls":[' + b",".join(c.item for c in batch) + b"]}"
        timeout = max(0.001, max(c.deadline for c in batch) - loop.time())
        expiry = _Expiry(loop, batch)
        streamed = _Streamed(batch)
        transport = self._transport(loop)
        response: httpx.Response | Reply
        try:
            if isinstance(transport, PlainHttp):
                response = await transport.post(
                    "/v1/batch",
                    content,
                    content_type="application/json",
                    timeout=timeout,
                    accept=NDJSON if self.stream else "application/json",
                    on_line=streamed.line,
                )
            else:
                accept = NDJSON if self.stream else "application/json"
                headers = {**self.headers, "Content-Type": "application/json", "Accept": accept}
                request = transport.stream(
                    "POST", self.url + "/v1/batch", content=content, headers=headers, timeout=timeout
                )
                async with request as response:
                    if _is_streamed(response):
                        async for line in response.aiter_lines():
                            streamed.line(line.encode())
                    else:
                        await response.aread()
            if response.status_code == 413 and len(batch) > 1:
                # Over the server's body cap together, not necessarily alone: halve and resend.
                half = len(batch) // 2
                self._send_soon(loop, batch[:half])
                self._send_soon(loop, batch[half:])
                return
            answers = streamed.rest() if _is_streamed(response) else _split(response, len(batch))
        except BaseException as exc:  # transport failures (and cancellation at loop shutdown)
            failure = exc if isinstance(exc, Exception) else httpx.TransportError("the batch was cancelled")
            for c in batch:
                if not c.future.done():  # calls answered before the failure keep their answers
                    c.future.set_exception(failure)
            if not isinstance(exc, Exception):
                raise
            return
        finally:
            expiry.cancel()
        for c, answer in zip(batch, answers, strict=True):
            if answer is not None and not c.future.done():
                c.future.set_result(answer)


def _is_streamed(response: httpx.Response | Reply) -> bool:
    return response.status_code == 200 and response.headers.get("content-type", "").startswith(NDJSON)


class _Streamed:
    """A streamed batch answer: each call's line is handed to its caller as soon as it arrives."""

    def __init__(self, batch: list[_Call]) -> None:
        self.batch = batch
        self.answered = [False] * len(batch)

    def line(self, raw: bytes) -> None:
        """One NDJSON line: an array of results (or one result); an item that is not a
        well-formed result is skipped (see `rest`)."""
        try:
            items = json.loads(raw)
        except ValueError:
            return
        for item in items if isinstance(items, list) else [items]:
            self._one(item)

    def _one(self, item: Any) -> None:
        try:
            k, status = item["index"], item["status"]
            headers = item.get("headers") or {}
            well_formed = type(k) is int and 0 <= k < len(self.batch) and type(status) is int
        except (KeyError, TypeError, AttributeError):
            return
        if not well_formed or self.answered[k] or not isinstance(headers, dict):
            return
        self.answered[k] = True
        call = self.batch[k]
        if not call.future.done():
            call.future.set_result(Answer(status, item.get("body"), "", retry_after(headers)))

    def rest(self) -> list[Answer | None]:
        """At the end: a protocol-error answer for every call the stream left unanswered."""
        missing = Answer(200, None, "malformed /v1/batch answer: no result for this call")
        return [None if done else missing for done in self.answered]


class _Expiry:
    """Each call's own deadline inside a batch: one timer, at the earliest deadline still open.

    The batch request waits as long as its latest call may; a call whose deadline passes first
    gets `TimeoutError` then (its caller's retry loop takes over), the others keep waiting. One
    timer per batch instead of a timeout per call: calls of one tick share a deadline.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, batch: list[_Call]) -> None:
        self.loop = loop
        self.batch = batch
        self.handle = loop.call_at(min(c.deadline for c in batch), self._fire)

    def _fire(self) -> None:
        now = self.loop.time()
        open_calls = [c for c in self.batch if not c.future.done()]
        for c in open_calls:
            if c.deadline <= now:
                c.future.set_exception(TimeoutError())
        later = [c.deadline for c in open_calls if c.deadline > now]
        if later:
            self.handle = self.loop.call_at(min(later), self._fire)

    def cancel(self) -> None:
        self.handle.cancel()


async def _close_at_shutdown(transport: PlainHttp | httpx.AsyncClient) -> None:
    try:
        await asyncio.Event().wait()
    finally:
        await transport.aclose()


def _split(response: httpx.Response | Reply, n: int) -> list[Answer]:
    """Each call's answer: the batch's items, or the batch's own answer when it was refused."""
    whole = answer_from(response)
    if whole.status != 200:
        return [whole] * n
    results = whole.data.get("results") if isinstance(whole.data, dict) else None
    if not isinstance(results, list) or len(results) != n:
        bad = Answer(200, None, f"malformed /v1/batch answer: expected {n} results")
        return [bad] * n
    out = []
    for r in results:
        if not isinstance(r, dict) or not isinstance(r.get("status"), int):
            out.append(Answer(200, None, "malformed /v1/batch result"))
            continue
        headers = r.get("headers") if isinstance(r.get("headers"), dict) else {}
        out.append(Answer(r["status"], r.get("body"), "", retry_after(headers or {})))
    return out


class Coalescers:
    """One `Coalescer` per (event loop, server URL): httpx clients and futures belong to a loop."""

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.counter = Counter()
        self._lock = threading.Lock()
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[_Key, Coalescer]] = (
            weakref.WeakKeyDictionary()
        )

    def get(self, url: str, headers: Mapping[str, str]) -> Coalescer:
        """The running loop's coalescer for `url` (and these headers: the token is part of the key)."""
        loop = asyncio.get_running_loop()
        key: _Key = (url, tuple(sorted(headers.items())))
        with self._lock:
            per_url = self._by_loop.setdefault(loop, {})
            found = per_url.get(key)
            if found is None:
                found = per_url[key] = Coalescer(url, dict(headers), counter=self.counter, **self.options)
            return found

    def loops_alive(self) -> int:
        """Event loops that still have a coalescer here (a closed loop's goes with it)."""
        with self._lock:
            return len(self._by_loop)

    @property
    def batches_sent(self) -> int:
        return self.counter.batches_sent
