"""`POST /v1/batch`: many create/reset/step/close calls in one request, each answered as its
single route would answer it (status, body, headers): all at once in call order, or, when the
client accepts `application/x-ndjson` (ours does), streamed one line per call as each finishes,
so one slow env call holds back no other call's answer (`StreamedBatch`).

A training turn sends one batch of steps, one per live episode, each on an idle instance. Those
take the *step lane*: checked and recorded on the loop by the same functions as the step
route (`step_replay`, `step_record`), their env calls started together as one thread group
(`WorkerThreads.run_many`) under one handler deadline. Per call that saves a task, a timer and a
thread hand-off: about 25 µs of the ~60 µs a batched step cost the server. Every other call
(create, reset, close, a step on an instance busy with another call, an async env) runs
through the single route's handler, concurrently with the lane.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError
from starlette.responses import Response

from steprl.hosting.handlers import (
    ServerState,
    busy,
    do_close,
    do_create,
    do_reset,
    do_step,
    env_failed,
    invalid_message,
    step_record,
    step_replay,
)
from steprl.hosting.instances import Instance, ServeError
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
from steprl.hosting.threads import Overloaded, is_async

logger = logging.getLogger("steprl.hosting.server")
_Lane = list[tuple[int, Instance, StepRequest]]


Emit = Callable[[int, dict[str, Any]], None]


async def run_batch(state: ServerState, calls: list[BatchCall], emit: Emit) -> None:
    """Run every call; `emit(i, result)` (`{status, body, headers}`) as soon as call i's result
    is final, so a slow call holds back no other's answer. Never raises."""

    def counted(i: int, result: dict[str, Any]) -> None:
        state.batch_calls += 1
        state.batch_statuses[result["status"]] += 1
        emit(i, result)

    lane: _Lane = []
    others: list[asyncio.Task[dict[str, Any]]] = []
    for i, call in enumerate(calls):
        step = _lane_step(state, call)
        if step is None:
            task = asyncio.ensure_future(batch_call(state, call))
            task.add_done_callback(functools.partial(_emit_task, counted, i))
            others.append(task)
            continue
        inst, body = step
        # Taken now, with nothing awaited since the instance was seen idle: no call can slip in.
        await inst.lock.acquire()
        inst.busy += 1
        lane.append((i, inst, body))
    if others:
        await asyncio.gather(_run_lane(state, lane, counted), *others)
    else:  # a turn's batch of steps: no task to start
        await _run_lane(state, lane, counted)


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
        left, started, holding = len(self.calls), False, True

        def emit(i: int, result: dict[str, Any]) -> None:
            lines.append((i, result))
            if not holding or len(lines) >= left:  # while holding, one wake-up: the last result
                wake.set()

        runner = asyncio.ensure_future(run_batch(self.state, self.calls, emit))
        runner.add_done_callback(lambda _: wake.set())
        hold_until = asyncio.get_running_loop().time() + HOLD_S
        try:
            while left:
                if holding:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout_at(hold_until):
                            await wake.wait()
                    holding = False
                if not lines:
                    if runner.done():
                        break  # it never ends with a call unanswered; if it did, the client says so
                    wake.clear()  # nothing awaited since `lines` was seen empty: no result is missed
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


def _lane_step(state: ServerState, call: BatchCall) -> tuple[Instance, StepRequest] | None:
    """(instance, body) when `call` is a valid step on a live, idle instance of a sync env.

    Idle (no call in flight or waiting) also excludes a second call on the same instance in
    this batch: the first one made it busy, so the second waits for it, as on the route.
    """
    if call.op != "step":
        return None
    inst = state.table.live(call.instance_id)
    if inst is None or inst.busy or inst.lock.locked() or is_async(inst.env.step):
        return None
    try:
        return inst, StepRequest.model_validate(call.body)
    except ValidationError:
        return None  # answered (422) by batch_call


async def _run_lane(state: ServerState, lane: _Lane, emit: Emit) -> None:
    """The lane's steps (their locks held): as `do_step` runs each, with one thread group and
    one deadline for all of them. Each step's answer is emitted, and its lock released, as soon
    as it is final."""
    todo: _Lane = []
    held = {id(inst): inst for _, inst, _ in lane}

    def release(inst: Instance) -> None:
        if held.pop(id(inst), None) is not None:
            inst.busy -= 1
            inst.touch()
            inst.lock.release()

    try:
        for entry in lane:
            i, inst, body = entry
            try:
                replay = step_replay(state, inst, body)
            except ServeError as exc:
                release(inst)
                emit(i, _error(exc))
                continue
            if replay is not None:
                release(inst)
                emit(i, _ok(replay))
            else:
                todo.append(entry)
        futures = state.threads.run_many(
            [functools.partial(inst.env.step, body.action) for _, inst, body in todo]
        )
        waiting = dict(zip(futures, todo, strict=True))
        finished: list[asyncio.Future[Any]] = []
        wake = asyncio.Event()

        def on_done(future: asyncio.Future[Any]) -> None:
            finished.append(future)
            wake.set()

        for future in futures:
            future.add_done_callback(on_done)
        timeout = state.settings.handler_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout
        while waiting:
            if not finished:
                wake.clear()
                try:
                    async with asyncio.timeout_at(deadline):
                        await wake.wait()
                except TimeoutError:
                    break
            ready, finished[:] = finished[:], []
            for future in ready:
                if future in waiting:
                    i, inst, body = waiting.pop(future)
                    result = await _finish(state, inst, body, future, timeout)
                    release(inst)
                    emit(i, result)
        for future, (i, inst, body) in list(waiting.items()):
            del waiting[future]
            result = await _finish(state, inst, body, future, timeout)  # not done: 504
            release(inst)
            emit(i, result)
    finally:  # also when cancelled (server shutdown): free whatever is still held
        for inst in list(held.values()):
            release(inst)


async def _finish(
    state: ServerState, inst: Instance, body: StepRequest, future: asyncio.Future[Any], timeout: float
) -> dict[str, Any]:
    if not future.done():
        future.cancel()  # its result, if it ever comes, is dropped
        await state.destroy(inst, f"destroyed: step passed the {timeout:g}s handler deadline", "destroyed")
        return _item(
            504,
            "handler_timeout",
            f"step on env {inst.env_name!r} did not finish within {timeout:g}s; the instance was "
            "destroyed (create a new one)",
        )
    error = future.exception()
    if isinstance(error, Overloaded):
        return _error(busy(state, str(error)))
    try:
        if error is not None:
            failure = error if isinstance(error, Exception) else RuntimeError(repr(error))
            raise env_failed(inst, "step", failure)
        raw = future.result()
        if inspect.isawaitable(raw):  # a sync step that returned an awaitable (the Env protocol allows it)
            raw = await raw
        return _ok(step_record(inst, body, raw))
    except ServeError as exc:
        return _error(exc)


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
