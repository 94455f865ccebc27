"""`POST /v1/batch`: many create/reset/step/close calls in one request, each answered as its
single route would answer it (status, body, headers): all at once in call order, or, when the
client accepts `application/x-ndjson` (ours does), streamed one line per burst of calls that
finished together, so one slow env call holds back no other call's answer (`StreamedBatch`).

Every call runs through its single route's handler (`batch_call`), all of them concurrently:
same deadlines, idempotency and errors as on the routes. The sync env calls a batch starts in
one event-loop tick go to the worker threads as one group (`threads.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError
from starlette.responses import Response

from steprl.hosting.handlers import (
    ServerState,
    do_close,
    do_create,
    do_reset,
    do_step,
    invalid_message,
)
from steprl.hosting.instances import ServeError
from steprl.hosting.protocol import (
    NDJSON,
    BatchCall,
    ClosedResponse,
    CreateRequest,
    CreateResponse,
    ObservationMsg,
    ResetRequest,
    StepRequest,
    TransitionMsg,
    error_body,
)

logger = logging.getLogger("steprl.hosting.server")


Emit = Callable[[int, dict[str, Any]], None]


async def run_batch(state: ServerState, calls: list[BatchCall], emit: Emit) -> None:
    """Run every call; `emit(i, result)` (`{status, body, headers}`) as soon as call i's result
    is final, so a slow call holds back no other's answer. Never raises. Two calls on one
    instance run in call order (the instance's lock is first come, first served)."""

    def counted(i: int, result: dict[str, Any]) -> None:
        state.batch_calls += 1
        state.batch_statuses[result["status"]] += 1
        emit(i, result)

    tasks = []
    for i, call in enumerate(calls):
        task = asyncio.ensure_future(batch_call(state, call))
        task.add_done_callback(functools.partial(_emit_task, counted, i))
        tasks.append(task)
    try:
        await asyncio.gather(*tasks)
    finally:  # cancelled (the client went away, server shutdown): stop what still runs
        for task in tasks:
            task.cancel()


async def run_batch_list(state: ServerState, calls: list[BatchCall]) -> list[dict[str, Any]]:
    """Every call's result, in call order (the answer of a batch that is not streamed)."""
    results: list[dict[str, Any]] = [{}] * len(calls)

    def keep(i: int, result: dict[str, Any]) -> None:
        results[i] = result

    await run_batch(state, calls, keep)
    return results


#: A streamed batch's first answers wait this long for the rest: a batch that finishes within
#: it goes in one piece, in call order, exactly like an answer that is not streamed (so quick
#: envs give runs identical to in-process ones); only slower calls are streamed past.
HOLD_S = 0.005


class StreamedBatch(Response):
    """A batch answered as its calls finish: `application/x-ndjson`, one line per burst of
    results that became final together, each line a JSON array of
    `{"index": i, "status": ..., "body": ..., "headers": ...}` (one encode and one decode per
    burst, not per call: ~0.1 ms per batch of 16).

    The first results wait up to `HOLD_S` for the others; when all come within it (a batch of
    quick steps) the answer is one plain Content-Length body. After that, results that become
    final together (a thread group hands its results over at once) go out in one chunk. A slow
    call delays the others' answers by at most `HOLD_S`, and the end of the response.
    """

    media_type = NDJSON

    def __init__(self, state: ServerState, calls: list[BatchCall]) -> None:
        super().__init__(status_code=200, media_type=NDJSON)
        self.state = state
        self.calls = calls

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        lines: list[tuple[int, dict[str, Any]]] = []  # results not sent yet
        wake = asyncio.Event()

        def emit(i: int, result: dict[str, Any]) -> None:
            lines.append((i, result))
            wake.set()

        runner = asyncio.ensure_future(run_batch(self.state, self.calls, emit))
        runner.add_done_callback(lambda _: wake.set())
        left, started = len(self.calls), False
        hold_until = asyncio.get_running_loop().time() + HOLD_S
        try:
            while left:
                if not lines and runner.done():
                    break  # it never ends with a call unanswered; if it did, the client says so
                holding = not started and len(lines) < left
                if not lines or (holding and asyncio.get_running_loop().time() < hold_until):
                    wake.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout_at(hold_until if lines else None):
                            await wake.wait()
                    continue
                # In call order within a chunk: the client resumes its callers in the order
                # of the lines, so a batch answered at once resumes them as in-process calls
                # would (and as an answer that is not streamed does), which keeps runs identical.
                lines.sort(key=lambda line: line[0])
                chunk = _json_line([{"index": i, **result} for i, result in lines])
                left -= len(lines)
                lines.clear()
                if not started:
                    # All answered at once (a batch of quick steps): a plain body, as few writes
                    # as an answer that is not streamed. Else chunked, one chunk per burst.
                    await send(_start(len(chunk) if not left else None))
                    started = True
                await send({"type": "http.response.body", "body": chunk, "more_body": left > 0})
            if left:
                if not started:
                    await send(_start(None))
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if not runner.done():
                runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)


def _start(length: int | None) -> dict[str, Any]:
    headers = [(b"content-type", NDJSON.encode())]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    return {"type": "http.response.start", "status": 200, "headers": headers}


# One encoder for every line (json.dumps with options builds a new one per call), encoding as
# starlette's JSONResponse does.
_encode = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


def _json_line(value: list[dict[str, Any]]) -> bytes:
    return _encode(value).encode() + b"\n"  # the newline ends an NDJSON record


def _emit_task(emit: Emit, i: int, task: asyncio.Task[dict[str, Any]]) -> None:
    if not task.cancelled():
        emit(i, task.result())  # batch_call never raises


def _ok(result: CreateResponse | ObservationMsg | TransitionMsg | ClosedResponse) -> dict[str, Any]:
    return {"status": 200, "body": result.model_dump(), "headers": {}}


def _error(exc: ServeError) -> dict[str, Any]:
    return _item(exc.status, exc.type, exc.message, exc.headers)


def _item(status: int, type_: str, message: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    return {"status": status, "body": error_body(type_, message), "headers": headers or {}}


async def batch_call(state: ServerState, call: BatchCall) -> dict[str, Any]:
    """One call through its single route's handler: the status and body that route would
    answer (never raises)."""
    try:
        if call.op == "create":
            create_body = CreateRequest.model_validate(call.body)
        elif call.op == "step":
            step_body = StepRequest.model_validate(call.body)
        elif call.op == "reset":
            reset_body = ResetRequest.model_validate(call.body)
        elif call.body:
            return _item(422, "validation_error", "invalid request: body: close takes no body")
    except ValidationError as exc:
        return _item(422, "validation_error", invalid_message(exc.errors(), prefix="body"))
    try:
        result: CreateResponse | ObservationMsg | TransitionMsg | ClosedResponse
        if call.op == "create":
            result = await do_create(state, create_body)
        elif call.op == "step":
            result = await do_step(state, call.instance_id, step_body)
        elif call.op == "reset":
            result = await do_reset(state, call.instance_id, reset_body)
        else:
            result = await do_close(state, call.instance_id)
    except ServeError as exc:
        return _error(exc)
    except Exception as exc:
        logger.exception("unhandled error in the env server (batched %s)", call.op)
        return _item(500, "internal_error", f"the env server failed ({type(exc).__name__}); see its log")
    return _ok(result)
