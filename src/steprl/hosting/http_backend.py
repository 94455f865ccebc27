"""`HttpEnvBackend`: the `EnvBackend` whose envs live on a steprl env server.

    backend = HttpEnvBackend("http://127.0.0.1:8765", token, "calculator", {})
    env = backend.make_env(task)          # a RemoteEnv (client.py); no I/O yet

`from_runtime` connects to `runtime.env_server_url`, or starts a loopback server for the run
(`LocalEnvServer`); `probe` fails fast on a wrong URL, token, env or params, which
`from_runtime` reports as one line naming what to fix (`EnvServerError`). By default the
backend's envs share `Coalescers`: the calls they make in one event-loop tick travel as one
`POST /v1/batch` (`coalesce.py`).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from steprl.envs.registry import FAMILIES
from steprl.errors import UserError
from steprl.hosting.client import RemoteEnv, RemoteEnvError, RetryPolicy, error_from, parse_answer
from steprl.hosting.coalesce import Coalescers, answer_from
from steprl.hosting.protocol import CreateRequest, CreateResponse
from steprl.types import Task


class EnvServerError(UserError):
    """The env server of `runtime.env_server_url` cannot serve this run: no token, unreachable,
    the token or the env refused. One line (the CLI's exit 2) that says what to fix."""


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
        # Calls of this backend's envs made in the same loop tick share one POST /v1/batch.
        self.coalescers = Coalescers() if coalesce else None
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
                    raise error_from(answer_from(response), f"probing {what}")
                created = parse_answer(CreateResponse, response.json(), f"probing {what}")
                c.delete(f"/v1/envs/{created.instance_id}")
            except httpx.HTTPError as exc:
                raise RemoteEnvError(
                    f"cannot reach {what}: {type(exc).__name__}: {exc}; is it running?"
                ) from None
        self._stop_strings, self._system_prompt = tuple(created.stop_strings), created.system_prompt

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    @classmethod
    def from_runtime(
        cls, env: str, params: Mapping[str, Any], runtime: Any, plugins: Sequence[str] = ()
    ) -> HttpEnvBackend:
        """From a `steprl.config.RuntimeSection`: `env_server_url` with the token read from the
        environment variable `env_token_var`, or (url unset) a loopback server for this run,
        which imports `plugins` first (a server at a url was started with its own --plugin)."""
        from steprl.hosting.local_server import LocalEnvServer

        call_timeout = float(runtime.env_call_timeout_s)
        server = None
        if runtime.env_server_url:
            url = str(runtime.env_server_url)
            token = os.environ.get(runtime.env_token_var, "")
            if not token:
                raise EnvServerError(
                    f"runtime.env_server_url is {url} but the environment variable {runtime.env_token_var} "
                    "is empty: export the server's bearer token there (`steprl serve-env` takes it from "
                    "STEPRL_ENV_TOKEN, or writes a generated one to the file whose path it prints)"
                )
        else:
            # The server's handler deadline is shorter than the client's call deadline, so a
            # hung env is answered 504 (and destroyed) before the client gives up on it; a server
            # that dies is restarted (its in-flight episodes end infra_failed, later ones run).
            server = LocalEnvServer(
                max_instances=int(runtime.max_concurrent_envs),
                handler_timeout_s=0.8 * call_timeout,
                auto_restart=True,
                plugins=tuple(plugins),
                # the run's own server, its token the trainer's: it may import what the run names
                allow_import_paths=":" in env or env in FAMILIES,
            ).start()
            url, token = server.url, server.token
        backend = cls(url, token, env, params, call_timeout_s=call_timeout, server=server)
        try:
            backend.probe()
        except RemoteEnvError as err:
            backend.close()
            raise _startup_error(err, url, env, runtime.env_token_var) from None
        except Exception:
            backend.close()
            raise
        return backend


def _startup_error(err: RemoteEnvError, url: str, env: str, token_var: str) -> EnvServerError:
    """The start-up probe's failure as one line: what is wrong, and which setting fixes it."""
    if err.status is None:
        return EnvServerError(
            f"{err} Start it (steprl serve-env --port PORT), or fix runtime.env_server_url "
            "(e.g. http://127.0.0.1:8765)"
        )
    if err.status == 401:
        return EnvServerError(
            f"the env server at {url} refused the token in {token_var} (HTTP 401): export the token "
            "that server uses (its STEPRL_ENV_TOKEN, or the file `steprl serve-env` printed)"
        )
    if err.status in (403, 404, 422):  # the env is not served here, or its params are refused
        return EnvServerError(f"the env server at {url} cannot serve env {env!r}: {err.detail or err}")
    return EnvServerError(f"the env server at {url} failed the start-up check for env {env!r}: {err}")
