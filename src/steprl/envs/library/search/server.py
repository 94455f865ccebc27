"""The retriever over HTTP: a FastAPI app, an httpx client, and a loopback server in a thread.

Search-R1 runs its retriever as a separate server that the rollout workers POST queries to;
this is the same split, small. The wire format::

    POST /search  {"query": "Zorvan born", "k": 2}  ->  {"docs": [{"id": 8, "text": "..."}]}
    GET  /health  -> {"status": "ok", "num_docs": 240}

A bad request (k out of range, query too long) is a 422 from FastAPI's validation. `fastapi`
and `httpx` are imported only when an app or a client is built, so the local retriever works
without them. A failing server raises `RetrieverError` in the client; in an env step that is
an infrastructure failure (the agent loop marks the trajectory `infra_failed`).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, Field

from steprl.envs.library.search.corpus import Doc
from steprl.envs.library.search.retriever import MAX_K, Retriever, check_k
from steprl.extras import require

MAX_QUERY_CHARS = 1000


class SearchRequest(BaseModel):
    query: str = Field(max_length=MAX_QUERY_CHARS)
    k: int = Field(3, ge=1, le=MAX_K)


class DocOut(BaseModel):
    id: int
    text: str


class SearchResponse(BaseModel):
    docs: list[DocOut]


class RetrieverError(RuntimeError):
    """The retrieval server failed or could not be reached (an infrastructure failure)."""


def create_app(retriever: Retriever, *, num_docs: int | None = None) -> Any:
    """A FastAPI app serving `retriever.search` at POST /search (and GET /health)."""
    fastapi = require("fastapi", extra="serve", feature="the search retriever server")

    app = fastapi.FastAPI(title="steprl search retriever")

    @app.post("/search")
    def search(request: SearchRequest) -> SearchResponse:  # sync: FastAPI runs it in a thread pool
        docs = retriever.search(request.query, request.k)
        return SearchResponse(docs=[DocOut(id=d.id, text=d.text) for d in docs])

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "num_docs": num_docs if num_docs is not None else len(getattr(retriever, "docs", ())),
        }

    return app


class HttpRetriever:
    """A `Retriever` that POSTs to a server made by `create_app` (e.g. ``http://127.0.0.1:8000``).

    Keeps one connection pool; `close()` releases it. Any transport error, timeout, non-2xx
    status or malformed body raises `RetrieverError`.
    """

    def __init__(self, url: str, *, timeout: float = 5.0) -> None:
        httpx = require("httpx", extra="serve", feature="env 'search' with retriever='http'")

        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}.")
        self.url = url.rstrip("/")
        self._client = httpx.Client(base_url=self.url, timeout=timeout)

    def search(self, query: str, k: int) -> list[Doc]:
        import httpx

        check_k(k)
        try:
            response = self._client.post("/search", json={"query": query[:MAX_QUERY_CHARS], "k": k})
            response.raise_for_status()
            body = SearchResponse.model_validate(response.json())
        except (httpx.HTTPError, ValueError) as exc:
            raise RetrieverError(
                f"retrieval server {self.url} failed on POST /search: {type(exc).__name__}: {exc}. "
                "Is it running (steprl.envs.library.search.serve_retriever) and reachable?"
            ) from exc
        return [Doc(d.id, d.text) for d in body.docs]

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> HttpRetriever:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def serve_retriever(
    retriever: Retriever, *, host: str = "127.0.0.1", port: int = 0, startup_timeout: float = 10.0
) -> Iterator[str]:
    """Serve `retriever` with uvicorn in a daemon thread; yields the base URL, stops on exit.

    `port=0` binds a free port (the socket is bound here, so there is no race for it).
    """
    uvicorn = require("uvicorn", extra="serve", feature="the search retriever server")

    # proto=IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say so, and
    # without it every response waits ~40 ms for a delayed ACK (headers and body are two writes).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound_port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(retriever), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + startup_timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RetrieverError(f"the retrieval server on {host}:{bound_port} did not start.")
            time.sleep(0.01)
        yield f"http://{host}:{bound_port}"
    finally:
        server.should_exit = True
        thread.join(timeout=startup_timeout)
        sock.close()
