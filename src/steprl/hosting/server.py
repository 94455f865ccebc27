"""The env server: any registered env behind HTTP, hardened for loopback use (FastAPI + uvicorn).

    settings = Settings(token=secrets.token_urlsafe(32), port=8765)
    serve(settings)                      # blocking; or uvicorn.run(build_app(settings), ...)

Routes (wire format in `protocol.py`): POST /v1/envs, POST /v1/envs/{id}/reset,
POST /v1/envs/{id}/step, DELETE /v1/envs/{id}, POST /v1/batch (many reset/step/close calls in
one request, each run exactly as its single route would run it), GET /v1/metrics, GET /healthz
(no auth).

The semantics follow reference/reliability.md §2.2 and §5.2:

* every handler runs under a deadline; a call that passes it is answered 504 and its instance
  is destroyed (a stuck env is never reused). Sync env methods run on worker threads
  (`threads.WorkerThreads`) so a hung env blocks only its own call; async ones are awaited.
* one call at a time per instance; a step carries `seq`, its idempotency key: a repeat of the
  last applied `seq` gets the cached answer and is not applied again (a retried "send email"
  sends one email). Any other out-of-order seq is a 409.
* errors are structured (404 unknown id, 409 wrong lifecycle, 422 bad body, 503 + Retry-After
  at the instance cap, 500 `env_error` when the env itself raises: message only, no traceback).
* an idle reaper destroys instances whose client vanished without closing them.
* security (host allowlist, bearer token, body cap, header deadline) is in `security.py`,
  the instance table and reaper in `instances.py`, the worker threads in `threads.py`,
  `Settings` in `settings.py`, what reset/step/close do (single or batched) in `handlers.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from steprl.envs.registry import load_plugins
from steprl.hosting import security
from steprl.hosting.batch import StreamedBatch, run_batch_list
from steprl.hosting.handlers import (
    ServerState,
    do_close,
    do_create,
    do_reset,
    do_step,
    invalid_message,
)
from steprl.hosting.instances import InstanceTable, ServeError, reap_forever
from steprl.hosting.protocol import (
    NDJSON,
    BatchRequest,
    ClosedResponse,
    CreateRequest,
    CreateResponse,
    ObservationMsg,
    ResetRequest,
    StepRequest,
    TransitionMsg,
    error_body,
)
from steprl.hosting.settings import Settings
from steprl.hosting.threads import WorkerThreads

__all__ = ["Settings", "build_app", "serve", "uvicorn_config"]

logger = logging.getLogger(__name__)


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
    return JSONResponse(error_body(type_, message), status_code=status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServeError)
    async def serve_error(_: Request, exc: ServeError) -> JSONResponse:
        return _envelope(exc.status, exc.type, exc.message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _envelope(422, "validation_error", invalid_message(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kinds = {404: "not_found", 405: "method_not_allowed", 400: "bad_request"}
        return _envelope(exc.status_code, kinds.get(exc.status_code, "http_error"), str(exc.detail))

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in the env server")
        return _envelope(500, "internal_error", f"the env server failed ({type(exc).__name__}); see its log")


def _add_routes(app: FastAPI, state: ServerState) -> None:

    async def batch(request: Request) -> Response:
        # Concurrent, like the same calls on separate connections: streamed as each call
        # finishes if the client accepts NDJSON, else answered together in call order.
        try:
            body = BatchRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            raise ServeError(422, "validation_error", invalid_message(exc.errors(), prefix="body")) from None
        if NDJSON in request.headers.get("accept", ""):
            return StreamedBatch(state, body.calls)
        return JSONResponse({"results": await run_batch_list(state, body.calls)})

    # A plain Starlette route, first in the table: the one route a training turn uses skips
    # FastAPI's dependency solving and the match against every other route (~0.1 ms a request).
    app.router.routes.insert(0, Route("/v1/batch", batch, methods=["POST"]))

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/metrics")
    async def metrics() -> dict[str, Any]:
        return state.metrics()

    @app.post("/v1/envs")
    async def create(body: CreateRequest) -> CreateResponse:
        return await do_create(state, body)

    @app.post("/v1/envs/{instance_id}/reset")
    async def reset(instance_id: str, body: ResetRequest) -> ObservationMsg:
        return await do_reset(state, instance_id, body)

    @app.post("/v1/envs/{instance_id}/step")
    async def step(instance_id: str, body: StepRequest) -> TransitionMsg:
        return await do_step(state, instance_id, body)

    @app.delete("/v1/envs/{instance_id}")
    async def close(instance_id: str) -> ClosedResponse:
        return await do_close(state, instance_id)


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
    app.add_middleware(
        security.BodyLimit, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s
    )
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

    load_plugins(plugins)  # as the trainer does (a failure is one line: `steprl serve-env` exits 2)
    server = uvicorn.Server(uvicorn_config(settings))
    signal.signal(signal.SIGTERM, _exit_cleanly)
    if exit_with_parent is not None:
        threading.Thread(target=_watch_parent, args=(exit_with_parent,), daemon=True).start()
    server.run()
