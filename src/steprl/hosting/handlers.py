"""What the env server's reset/step/close routes do, shared by the single routes and /v1/batch.

One implementation per call, so a call batched with others has exactly the semantics of the same
call on its own route: the handler deadline (504, instance destroyed), one call at a time per
instance, idempotency by (instance, seq), and the same structured errors.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from steprl.envs.registry import ENVS, FAMILIES, get_spec
from steprl.errors import UserError
from steprl.hosting.instances import (
    Instance,
    InstanceState,
    InstanceTable,
    ServeError,
    close_quietly,
)
from steprl.hosting.protocol import (
    ClosedResponse,
    CreateRequest,
    CreateResponse,
    ObservationMsg,
    ResetRequest,
    StepRequest,
    TransitionMsg,
    observation_to_wire,
    task_from_wire,
    tools_to_wire,
    transition_to_wire,
)
from steprl.hosting.settings import Settings
from steprl.hosting.threads import Overloaded, WorkerThreads, call_env

logger = logging.getLogger("steprl.hosting.server")
T = TypeVar("T")


@dataclass
class ServerState:
    """Everything the handlers share; one per app."""

    settings: Settings
    table: InstanceTable
    threads: WorkerThreads
    requests: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    steps_replayed: int = 0
    creates_replayed: int = 0
    # create key -> its answer (None while building, or after it failed); oldest dropped first
    creates: OrderedDict[str, asyncio.Future[CreateResponse | None]] = field(default_factory=OrderedDict)
    batch_calls: int = 0  # calls answered inside /v1/batch requests (each counted once in `requests`)
    batch_statuses: Counter[int] = field(default_factory=Counter)
    background: set[asyncio.Task[Any]] = field(default_factory=set)

    def spawn(self, coro: Awaitable[Any]) -> None:
        """Run `coro` in the background, keeping a reference until it finishes."""
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def destroy(self, inst: Instance, why: str, counter: str) -> None:
        """Remove `inst` now (later calls get 409) and close its env in the background.

        Closing runs even while a timed-out call still holds the env: for an env stuck in I/O
        or a sandbox, close() is the only way to abort that call.
        """
        if self.table.pop(inst.id, why, counter) is not None:
            logger.warning("env %s (%s) %s", inst.id, inst.env_name, why)
            self.spawn(close_quietly(self.threads, inst, self.settings.handler_timeout_s))

    def metrics(self) -> dict[str, Any]:
        counts = self.table.counts
        return {
            "instances_live": len(self.table),
            "instances_busy": sum(1 for i in self.table if i.busy),
            "instances_created": counts["created"],
            "instances_closed": counts["closed"],
            "instances_reaped": counts["reaped"],
            "instances_destroyed": counts["destroyed"],
            "rejected_at_capacity": counts["rejected_at_capacity"],
            "steps_replayed": self.steps_replayed,
            "creates_replayed": self.creates_replayed,
            "threads_alive": self.threads.alive,
            "asyncio_tasks": len(asyncio.all_tasks()),  # a leak shows up here (HTTP-07)
            "requests": self.requests,
            "errors": sum(n for status, n in self.statuses.items() if status >= 400),
            "responses_by_status": {str(k): v for k, v in sorted(self.statuses.items())},
            "batch_calls": self.batch_calls,
            "batch_results_by_status": {str(k): v for k, v in sorted(self.batch_statuses.items())},
        }


def invalid_message(errors: Sequence[Any], prefix: str = "") -> str:
    """Location and reason only: echoing the input could echo secrets or megabytes."""
    problems = [
        f"{'.'.join(str(p) for p in (prefix, *err.get('loc', ())) if p != '')}: {err.get('msg', 'invalid')}"
        for err in errors[:8]
    ]
    return "invalid request: " + "; ".join(problems)


def busy(state: ServerState, what: str) -> ServeError:
    return ServeError(
        503,
        "server_busy",
        f"{what}; retry after {state.settings.retry_after_s}s (or raise --max-instances)",
        {"Retry-After": str(state.settings.retry_after_s)},
    )


def env_failed(inst: Instance | None, method: str, exc: Exception) -> ServeError:
    """The env raised: an env bug or an outage behind it, never the model's fault (ENV-11)."""
    if inst is not None:
        inst.state = InstanceState.BROKEN
    where = f"env {inst.env_name!r} " if inst is not None else "env "
    return ServeError(500, "env_error", f"{where}{method}() raised {type(exc).__name__}: {exc}")


async def _guarded(state: ServerState, inst: Instance, what: str, work: Callable[[], Awaitable[T]]) -> T:
    """Run one handler's work on `inst` under the handler deadline (504 + destroy on expiry)."""
    timeout = state.settings.handler_timeout_s
    inst.busy += 1
    try:
        async with asyncio.timeout(timeout) as deadline:
            return await work()
    except TimeoutError:
        if not deadline.expired():
            raise
        await state.destroy(inst, f"destroyed: {what} passed the {timeout:g}s handler deadline", "destroyed")
        raise ServeError(
            504,
            "handler_timeout",
            f"{what} on env {inst.env_name!r} did not finish within {timeout:g}s; the instance was "
            "destroyed (create a new one)",
        ) from None
    except Overloaded as exc:
        raise busy(state, str(exc)) from None
    finally:
        inst.busy -= 1
        inst.touch()


#: Create keys remembered; a retry comes within seconds, so older keys can go.
MAX_CREATE_KEYS = 10_000


async def do_create(state: ServerState, body: CreateRequest) -> CreateResponse:
    """POST /v1/envs (single or batched), once per idempotency key: a create repeated with the
    key of one that built an instance still alive gets that instance (waiting for it if it is
    still being built); otherwise a new one is built."""
    if body.key is None:
        return await _build(state, body)
    earlier = state.creates.get(body.key)
    if earlier is not None:
        answer = await asyncio.shield(earlier)
        if answer is not None and state.table.live(answer.instance_id) is not None:
            state.creates_replayed += 1
            return answer
    mine: asyncio.Future[CreateResponse | None] = asyncio.get_running_loop().create_future()
    state.creates[body.key] = mine
    state.creates.move_to_end(body.key)
    while len(state.creates) > MAX_CREATE_KEYS:
        state.creates.popitem(last=False)
    try:
        answer = await _build(state, body)
    except BaseException:
        mine.set_result(None)  # a retry builds anew
        raise
    mine.set_result(answer)
    return answer


async def _build(state: ServerState, body: CreateRequest) -> CreateResponse:
    """Build the env on a worker thread under the handler deadline."""
    refused = env_refusal(body.env, state.settings.allow_import_paths)
    if refused is not None:
        raise ServeError(403, "env_not_served", refused)
    try:
        spec = get_spec(body.env, body.params)
    except UserError as err:  # unknown name, a plugin path that does not import, bad family params
        raise ServeError(422, "unknown_env", str(err)) from None
    if not state.table.reserve():
        raise busy(state, f"the server holds its maximum of {state.table.max_instances} env instances")
    try:
        async with asyncio.timeout(state.settings.handler_timeout_s) as deadline:
            env = await state.threads.run(lambda: spec.factory(**body.params), orphan=_close_late_env(state))
    except TimeoutError as exc:
        if not deadline.expired():  # the factory's own TimeoutError
            raise env_failed(None, f"{body.env!r} factory", exc) from None
        raise ServeError(
            504,
            "handler_timeout",
            f"building env {body.env!r} took over {state.settings.handler_timeout_s:g}s",
        ) from None
    except Overloaded as exc:
        raise busy(state, str(exc)) from None
    except (TypeError, ValueError) as exc:  # the factory refused these params
        raise ServeError(
            422, "invalid_params", f"env {body.env!r} rejected params: {type(exc).__name__}: {exc}"
        ) from None
    except Exception as exc:
        raise env_failed(None, f"{body.env!r} factory", exc) from None
    finally:
        state.table.release()  # the slot is the instance's (added below, no await between) or free again
    try:
        stop_strings = [str(s) for s in env.stop_strings]
        system_prompt = str(env.system_prompt)
    except Exception as exc:
        _close_late_env(state)(env)
        raise env_failed(None, f"{body.env!r} stop_strings/system_prompt", exc) from None
    inst = state.table.add(body.env, env)
    return CreateResponse(instance_id=inst.id, stop_strings=stop_strings, system_prompt=system_prompt)


def env_refusal(name: str, allow_import_paths: bool) -> str | None:
    """Why the server will not build env `name` for a request, or None. A name the operator
    registered (built-ins, --plugin modules, an import path already loaded) or an installed
    entry point is served; an import path or a family runs code the *request* names (a module
    to import, a command to start), so it needs --allow-import-paths."""
    if allow_import_paths or name in ENVS:
        return None
    if ":" in name:
        what = f"env {name!r} is an import path: importing the module a request names runs any code"
    elif name in FAMILIES:
        what = f"env {name!r} is a family whose params name the code to run (a module or a command)"
    else:
        return None
    return (
        f"{what}, so this server serves registered envs only. Register the env in a module the server "
        "imports (steprl serve-env --plugin my_envs) or an installed 'steprl.envs' entry point, or "
        "start the server with --allow-import-paths if every token holder may run code on it"
    )


def _close_late_env(state: ServerState) -> Callable[[Any], None]:
    """For a factory that finished after its create call gave up: close the orphaned env."""

    def orphan(env: Any) -> None:
        inst = Instance(id="(orphan)", env_name=type(env).__name__, env=env)
        state.spawn(close_quietly(state.threads, inst, state.settings.handler_timeout_s))

    return orphan


async def do_reset(state: ServerState, instance_id: str, body: ResetRequest) -> ObservationMsg:
    """POST /v1/envs/{id}/reset, for the single route and for /v1/batch alike."""
    table, threads = state.table, state.threads
    inst = table.get(instance_id)

    async def work() -> ObservationMsg:
        async with inst.lock:
            table.get(instance_id)  # closed while this call waited for the lock?
            if inst.state is InstanceState.BROKEN:
                raise _broken()
            task = task_from_wire(body.task)
            try:
                obs = observation_to_wire(await call_env(threads, inst.env.reset, task, body.seed))
                # the system prompt and tools may change at reset (an MCP env learns its tools then)
                update = {"system_prompt": str(inst.env.system_prompt), "tools": tools_to_wire(inst.env)}
                obs = obs.model_copy(update=update)
            except Overloaded:
                raise
            except Exception as exc:
                raise env_failed(inst, "reset", exc) from None
            inst.state, inst.seq, inst.last = InstanceState.READY, 0, None
            return obs

    return await _guarded(state, inst, "reset", work)


async def do_step(state: ServerState, instance_id: str, body: StepRequest) -> TransitionMsg:
    """POST /v1/envs/{id}/step (single or batched): applied once per (instance, seq)."""
    table, threads = state.table, state.threads
    inst = table.get(instance_id)

    async def work() -> TransitionMsg:
        async with inst.lock:
            table.get(instance_id)
            replay = step_replay(state, inst, body)
            if replay is not None:
                return replay
            try:
                raw = await call_env(threads, inst.env.step, body.action)
            except Overloaded:
                raise
            except Exception as exc:
                raise env_failed(inst, "step", exc) from None
            return step_record(inst, body, raw)

    return await _guarded(state, inst, "step", work)


def step_replay(state: ServerState, inst: Instance, body: StepRequest) -> TransitionMsg | None:
    """Before a step (lock held): the cached answer of a repeated seq, or None to apply it
    (a ServeError when the instance cannot step now)."""
    if body.seq == inst.seq and inst.last is not None:
        state.steps_replayed += 1
        return inst.last  # a retry of the step just applied: answer it again, apply nothing
    _check_can_step(inst, body.seq)
    return None


def step_record(inst: Instance, body: StepRequest, raw: object) -> TransitionMsg:
    """After the env stepped (lock held): its answer on the wire, remembered for a replay."""
    try:
        msg = transition_to_wire(raw)
    except Exception as exc:
        raise env_failed(inst, "step", exc) from None
    inst.seq, inst.last = body.seq, msg
    if msg.terminated or msg.truncated:
        inst.state = InstanceState.DONE
    return msg


async def do_close(state: ServerState, instance_id: str) -> ClosedResponse:
    """DELETE /v1/envs/{id} (single or batched); closing twice is fine (a retried close)."""
    table = state.table
    if table.is_gone(instance_id):
        return ClosedResponse()  # closing twice is fine: a retried close must not fail
    inst = table.get(instance_id)  # 404 if unknown
    table.pop(instance_id, "closed by the client", "closed")
    error = await close_quietly(state.threads, inst, state.settings.handler_timeout_s)
    if error is not None:
        raise ServeError(500, "env_error", f"env {inst.env_name!r} close() failed: {error}")
    return ClosedResponse()


def _broken() -> ServeError:
    return ServeError(409, "instance_broken", "this env raised earlier; close it and create a new one")


def _check_can_step(inst: Instance, seq: int) -> None:
    if inst.state is InstanceState.CREATED:
        raise ServeError(409, "not_reset", "step before reset: call POST /v1/envs/{id}/reset first")
    if inst.state is InstanceState.DONE:
        raise ServeError(
            409, "episode_over", "the episode is over (terminated or truncated); reset for another"
        )
    if inst.state is InstanceState.BROKEN:
        raise _broken()
    if seq != inst.seq + 1:
        raise ServeError(
            409,
            "seq_conflict",
            f"step seq {seq} is out of order: the next step is seq {inst.seq + 1} (a repeat of {inst.seq} "
            "replays its answer); seq restarts at 1 after each reset",
        )
