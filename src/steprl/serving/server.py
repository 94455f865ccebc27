"""The env server: any registered env behind HTTP, hardened for loopback use (FastAPI + uvicorn).

    settings = Settings(token=secrets.token_urlsafe(32), port=8765)
    serve(settings)                      # blocking; or uvicorn.run(build_app(settings), ...)

Routes (wire format in `protocol.py`): POST /v1/envs, POST /v1/envs/{id}/reset,
POST /v1/envs/{id}/step, DELETE /v1/envs/{id}, GET /v1/metrics, GET /healthz (no auth).

The semantics follow reference/reliability.md §2.2 and §5.2:

* every handler runs under a deadline; a call that passes it is answered 504 and its instance
  is destroyed (a stuck env is never reused). Sync env methods run on worker threads
  (`instances.WorkerThreads`) so a hung env blocks only its own call; async ones are awaited.
* one call at a time per instance; a step carries `seq`, its idempotency key: a repeat of the
  last applied `seq` gets the cached answer and is not applied again (a retried "send email"
  sends one email). Any other out-of-order seq is a 409.
* errors are structured (404 unknown id, 409 wrong lifecycle, 422 bad body, 503 + Retry-After
  at the instance cap, 500 `env_error` when the env itself raises: message only, no traceback).
* an idle reaper destroys instances whose client vanished without closing them.
* security (host allowlist, bearer token, body cap, header deadline) is in `security.py`,
  the instance table, worker threads and reaper in `instances.py`, `Settings` in `settings.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from steprl.envs.registry import get_spec
from steprl.serving import security
from steprl.serving.instances import (
    Instance,
    InstanceState,
    InstanceTable,
    Overloaded,
    ServeError,
    WorkerThreads,
    call_env,
    close_quietly,
    reap_forever,
)
from steprl.serving.protocol import (
    ClosedResponse,
    CreateRequest,
    CreateResponse,
    ErrorBody,
    ErrorEnvelope,
    ObservationMsg,
    ResetRequest,
    StepRequest,
    TransitionMsg,
    observation_to_wire,
    task_from_wire,
    transition_to_wire,
)
from steprl.serving.settings import Settings

__all__ = ["Settings", "build_app", "serve", "uvicorn_config"]

logger = logging.getLogger(__name__)
T = TypeVar("T")
_MAX_MESSAGE_CHARS = 2000


@dataclass
class ServerState:
    """Everything the handlers share; one per app."""

    settings: Settings
    table: InstanceTable
    threads: WorkerThreads
    requests: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    steps_replayed: int = 0
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
            "threads_alive": self.threads.alive,
            "asyncio_tasks": len(asyncio.all_tasks()),  # a leak shows up here (HTTP-07)
            "requests": self.requests,
            "errors": sum(n for status, n in self.statuses.items() if status >= 400),
            "responses_by_status": {str(k): v for k, v in sorted(self.statuses.items())},
        }


class _Counting:
    """Outermost middleware: counts requests and response statuses for /v1/metrics."""

    def __init__(self, app: Any, *, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.state.requests += 1

        async def counting_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.state.statuses[int(message["status"])] += 1
            await send(message)

        await self.app(scope, receive, counting_send)


def _envelope(status: int, type_: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorEnvelope(error=ErrorBody(type=type_, message=message[:_MAX_MESSAGE_CHARS]))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServeError)
    async def serve_error(_: Request, exc: ServeError) -> JSONResponse:
        return _envelope(exc.status, exc.type, exc.message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # Location and reason only: echoing the input could echo secrets or megabytes.
        problems = [
            f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg', 'invalid')}"
            for err in exc.errors()[:8]
        ]
        return _envelope(422, "validation_error", "invalid request: " + "; ".join(problems))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kinds = {404: "not_found", 405: "method_not_allowed", 400: "bad_request"}
        return _envelope(exc.status_code, kinds.get(exc.status_code, "http_error"), str(exc.detail))

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in the env server")
        return _envelope(500, "internal_error", f"the env server failed ({type(exc).__name__}); see its log")


def _busy(state: ServerState, what: str) -> ServeError:
    return ServeError(
        503,
        "server_busy",
        f"{what}; retry after {state.settings.retry_after_s}s (or raise --max-instances)",
        {"Retry-After": str(state.settings.retry_after_s)},
    )


def _env_failed(inst: Instance | None, method: str, exc: Exception) -> ServeError:
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
        raise _busy(state, str(exc)) from None
    finally:
        inst.busy -= 1
        inst.touch()


def _add_routes(app: FastAPI, state: ServerState) -> None:
    table, threads, settings = state.table, state.threads, state.settings

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/metrics")
    async def metrics() -> dict[str, Any]:
        return state.metrics()

    @app.post("/v1/envs")
    async def create(body: CreateRequest) -> CreateResponse:
        try:
            spec = get_spec(body.env)
        except KeyError as err:
            raise ServeError(422, "unknown_env", str(err)) from None
        if not table.reserve():
            raise _busy(state, f"the server holds its maximum of {table.max_instances} env instances")
        try:
            async with asyncio.timeout(settings.handler_timeout_s) as deadline:
                env = await threads.run(lambda: spec.factory(**body.params), orphan=_close_late_env(state))
        except TimeoutError as exc:
            if not deadline.expired():  # the factory's own TimeoutError
                raise _env_failed(None, f"{body.env!r} factory", exc) from None
            raise ServeError(
                504, "handler_timeout", f"building env {body.env!r} took over {settings.handler_timeout_s:g}s"
            ) from None
        except Overloaded as exc:
            raise _busy(state, str(exc)) from None
        except (TypeError, ValueError) as exc:  # the factory refused these params
            raise ServeError(
                422, "invalid_params", f"env {body.env!r} rejected params: {type(exc).__name__}: {exc}"
            ) from None
        except Exception as exc:
            raise _env_failed(None, f"{body.env!r} factory", exc) from None
        finally:
            table.release()  # the slot is the instance's (added below, no await between) or free again
        try:
            stop_strings = [str(s) for s in getattr(env, "stop_strings", ())]
            system_prompt = str(getattr(env, "system_prompt", "") or "")
        except Exception as exc:
            _close_late_env(state)(env)
            raise _env_failed(None, f"{body.env!r} stop_strings/system_prompt", exc) from None
        inst = table.add(body.env, env)
        return CreateResponse(instance_id=inst.id, stop_strings=stop_strings, system_prompt=system_prompt)

    @app.post("/v1/envs/{instance_id}/reset")
    async def reset(instance_id: str, body: ResetRequest) -> ObservationMsg:
        inst = table.get(instance_id)

        async def work() -> ObservationMsg:
            async with inst.lock:
                table.get(instance_id)  # closed while this call waited for the lock?
                if inst.state is InstanceState.BROKEN:
                    raise _broken()
                task = task_from_wire(body.task)
                try:
                    obs = observation_to_wire(await call_env(threads, inst.env.reset, task, body.seed))
                except Overloaded:
                    raise
                except Exception as exc:
                    raise _env_failed(inst, "reset", exc) from None
                inst.state, inst.seq, inst.last = InstanceState.READY, 0, None
                return obs

        return await _guarded(state, inst, "reset", work)

    @app.post("/v1/envs/{instance_id}/step")
    async def step(instance_id: str, body: StepRequest) -> TransitionMsg:
        inst = table.get(instance_id)

        async def work() -> TransitionMsg:
            async with inst.lock:
                table.get(instance_id)
                if body.seq == inst.seq and inst.last is not None:
                    state.steps_replayed += 1
                    return inst.last  # a retry of the step just applied: answer it again, apply nothing
                _check_can_step(inst, body.seq)
                try:
                    msg = transition_to_wire(await call_env(threads, inst.env.step, body.action))
                except Overloaded:
                    raise
                except Exception as exc:
                    raise _env_failed(inst, "step", exc) from None
                inst.seq, inst.last = body.seq, msg
                if msg.terminated or msg.truncated:
                    inst.state = InstanceState.DONE
                return msg

        return await _guarded(state, inst, "step", work)

    @app.delete("/v1/envs/{instance_id}")
    async def close(instance_id: str) -> ClosedResponse:
        if table.is_gone(instance_id):
            return ClosedResponse()  # closing twice is fine: a retried close must not fail
        inst = table.get(instance_id)  # 404 if unknown
        table.pop(instance_id, "closed by the client", "closed")
        error = await close_quietly(threads, inst, settings.handler_timeout_s)
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


def _close_late_env(state: ServerState) -> Callable[[Any], None]:
    """For a factory that finished after its create call gave up: close the orphaned env."""

    def orphan(env: Any) -> None:
        inst = Instance(id="(orphan)", env_name=type(env).__name__, env=env)
        state.spawn(close_quietly(state.threads, inst, state.settings.handler_timeout_s))

    return orphan


def build_app(settings: Settings) -> FastAPI:
    """The ASGI app serving every registered env (`steprl.envs.registry`) under `settings`."""
    state = ServerState(
        settings=settings,
        table=InstanceTable(settings.max_instances),
        threads=WorkerThreads(settings.max_threads or settings.max_instances + 16),
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        reaper = asyncio.create_task(reap_forever(state.table, settings.idle_ttl_s, state.destroy))
        try:
            yield
        finally:
            reaper.cancel()
            for inst in list(state.table):
                await state.destroy(inst, "closed at server shutdown", "closed")
            if state.background:
                await asyncio.wait(list(state.background), timeout=settings.handler_timeout_s)

    app = FastAPI(
        title="steprl env server", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.steprl = state
    _install_error_handlers(app)
    _add_routes(app, state)
    # add_middleware wraps: the last one added runs first. Order: count, host, auth, body cap.
    app.add_middleware(security.BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(security.BearerAuth, token=settings.token, public_paths={"/healthz"})
    app.add_middleware(security.HostAllowlist, hosts=settings.hosts, port=settings.port or None)
    app.add_middleware(_Counting, state=state)
    return app


def uvicorn_config(settings: Settings, app: Any = None) -> Any:
    """The uvicorn.Config for `settings` (h11 with a header deadline, no access log, no ws)."""
    import uvicorn

    return uvicorn.Config(
        app if app is not None else build_app(settings),
        host=settings.host,
        port=settings.port,
        http=security.header_deadline_protocol(settings.header_timeout_s),
        ws="none",
        lifespan="on",
        log_level=settings.log_level,
        access_log=False,  # an access log would record URLs; a leaked token must not reach a file
        proxy_headers=False,  # nothing sits in front of a loopback server: trust no X-Forwarded-*
        server_header=False,
        timeout_keep_alive=settings.keep_alive_s,
        timeout_graceful_shutdown=settings.graceful_shutdown_s,
        limit_concurrency=settings.max_instances + settings.concurrency_headroom,
        limit_max_requests=settings.limit_max_requests,
    )


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _watch_parent(pid: int) -> None:
    """SIGTERM ourselves (a graceful exit) once `pid` is no longer our parent (it died)."""
    while os.getppid() == pid:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)


def serve(settings: Settings, plugins: Sequence[str] = (), *, exit_with_parent: int | None = None) -> None:
    """Import `plugins` (modules that register envs), then serve until SIGTERM/SIGINT.

    uvicorn finishes in-flight calls (up to `graceful_shutdown_s`), closes every instance, then
    re-raises the signal it caught; the SIGTERM handler installed here turns that into exit 0.
    `exit_with_parent`: a pid; when it stops being our parent, shut down (no orphan servers).
    """
    import uvicorn

    for module in plugins:
        importlib.import_module(module)
    server = uvicorn.Server(uvicorn_config(settings))
    signal.signal(signal.SIGTERM, _exit_cleanly)
    if exit_with_parent is not None:
        threading.Thread(target=_watch_parent, args=(exit_with_parent,), daemon=True).start()
    server.run()
