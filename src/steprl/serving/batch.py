"""`POST /v1/batch`: many create/reset/step/close calls in one request, each answered as its
single route would answer it (status, body, headers), in call order.

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
import functools
import inspect
import logging
from typing import Any

from pydantic import ValidationError

from steprl.serving.handlers import (
    MAX_MESSAGE_CHARS,
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
from steprl.serving.instances import Instance, ServeError
from steprl.serving.protocol import (
    BatchCall,
    ClosedResponse,
    CreateRequest,
    CreateResponse,
    ErrorBody,
    ErrorEnvelope,
    ObservationMsg,
    ResetRequest,
    StepRequest,
    TransitionMsg,
)
from steprl.serving.threads import Overloaded, is_async

logger = logging.getLogger("steprl.serving.server")
_Lane = list[tuple[int, Instance, StepRequest]]


async def run_batch(state: ServerState, calls: list[BatchCall]) -> list[dict[str, Any]]:
    """Each call's result (`{status, body, headers}`), in call order; never raises."""
    lane: _Lane = []
    others: list[int] = []
    for i, call in enumerate(calls):
        step = _lane_step(state, call)
        if step is None:
            others.append(i)
            continue
        inst, body = step
        # Taken now, with nothing awaited since the instance was seen idle: no call can slip in.
        await inst.lock.acquire()
        inst.busy += 1
        lane.append((i, inst, body))
    answered = await asyncio.gather(_run_lane(state, lane), *(batch_call(state, calls[i]) for i in others))
    results: list[dict[str, Any]] = [{}] * len(calls)
    for (i, _, _), result in zip(lane, answered[0], strict=True):
        results[i] = result
    for i, result in zip(others, answered[1:], strict=True):
        results[i] = result
    state.batch_calls += len(calls)
    for result in results:
        state.batch_statuses[result["status"]] += 1
    return results


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


async def _run_lane(state: ServerState, lane: _Lane) -> list[dict[str, Any]]:
    """The lane's steps (their locks held): as `do_step` runs each, with one thread group and
    one deadline for all of them."""
    answers: list[dict[str, Any]] = [{}] * len(lane)
    todo: _Lane = []
    try:
        for k, (_, inst, body) in enumerate(lane):
            try:
                replay = step_replay(state, inst, body)
            except ServeError as exc:
                answers[k] = _error(exc)
                continue
            if replay is not None:
                answers[k] = _ok(replay)
            else:
                todo.append((k, inst, body))
        futures = state.threads.run_many(
            [functools.partial(inst.env.step, body.action) for _, inst, body in todo]
        )
        timeout = state.settings.handler_timeout_s
        if futures:
            await asyncio.wait(futures, timeout=timeout)
        for (k, inst, body), future in zip(todo, futures, strict=True):
            answers[k] = await _finish(state, inst, body, future, timeout)
    finally:
        for _, inst, _ in lane:
            inst.busy -= 1
            inst.touch()
            inst.lock.release()
    return answers


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
    body = ErrorEnvelope(error=ErrorBody(type=type_, message=message[:MAX_MESSAGE_CHARS]))
    return {"status": status, "body": body.model_dump(), "headers": headers or {}}


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
