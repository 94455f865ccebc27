"""`EnvBackend`: where env instances live. One visible dict, `BACKENDS`, picks it by name.

The agent loop only ever calls `backend.make_env(task)` and then the `Env` protocol
(reset/step/close) on what it gets, so in-process, HTTP and Ray environments are
interchangeable; the conformance suite (tests/hosting/test_conformance.py) runs the same tests
against all three.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

from steprl.envs.base import Env, IncompleteEnv, missing_members
from steprl.envs.deadline import DeadlineEnv, EnvCalls
from steprl.envs.registry import get_spec, load_plugins
from steprl.extras import require_extra
from steprl.types import Task


class EnvBackend(Protocol):
    """Makes one fresh env instance per episode; `close` releases what the backend holds."""

    name: str

    def make_env(self, task: Task) -> Env: ...

    def close(self) -> None: ...


class InProcessBackend:
    """Env instances built by the registered factory, in this process. Each instance's calls
    answer within `call_timeout_s` (`envs/deadline.py`: a sync env runs on a thread of its own,
    so a call that blocks ends `env_timeout` instead of freezing every episode)."""

    name = "inprocess"

    def __init__(self, env: str, params: Mapping[str, Any], *, call_timeout_s: float = 30.0) -> None:
        self._name = env
        self._factory = get_spec(env, params).factory
        self._params = dict(params)
        self.call_timeout_s = call_timeout_s
        self.calls = EnvCalls()  # waited for inline while quick; threads stuck past a deadline (bounded)

    def make_env(self, task: Task) -> Env:
        return DeadlineEnv(self._factory(**self._params), self.call_timeout_s, self.calls)

    def probe(self) -> InProcessBackend:
        """Fail fast: build one env and check it has every member the core reads (else every
        episode would end `infra_failed` on the same AttributeError). Call outside an event loop."""
        env = self._factory(**self._params)
        problem = missing_members(env)
        if "close" not in (problem or ""):
            closed = env.close()
            if inspect.isawaitable(closed):
                asyncio.run(_awaited(closed))
        if problem:
            raise IncompleteEnv(f"env {self._name!r}: its factory returned {problem}")
        return self

    def close(self) -> None:
        pass


async def _awaited(value: Awaitable[object]) -> None:
    await value


def _http(env: str, params: Mapping[str, Any], runtime: Any, plugins: Sequence[str]) -> EnvBackend:
    require_extra("serve", feature="runtime.backend=http")
    from steprl.hosting.http_backend import HttpEnvBackend

    return HttpEnvBackend.from_runtime(env, params, runtime, plugins)


def _ray(env: str, params: Mapping[str, Any], runtime: Any, plugins: Sequence[str]) -> EnvBackend:
    require_extra("ray", feature="runtime.backend=ray")
    from steprl.hosting.ray_backend import RayEnvBackend

    return RayEnvBackend.from_runtime(env, params, runtime, plugins)


#: runtime.backend -> (env name, env params, the config's RuntimeSection, plugin modules) -> EnvBackend.
#: HTTP and Ray are imported only when picked (ray is heavy to import, and both are extras).
BACKENDS: dict[str, Callable[[str, Mapping[str, Any], Any, Sequence[str]], EnvBackend]] = {
    "inprocess": lambda env, params, runtime, plugins: InProcessBackend(
        env, params, call_timeout_s=runtime.env_call_timeout_s
    ).probe(),
    "http": _http,
    "ray": _ray,
}


def make_backend(
    env: str, params: Mapping[str, Any], runtime: Any, plugins: Sequence[str] = ()
) -> EnvBackend:
    """The backend named by `runtime.backend` (a `steprl.config.RuntimeSection`). `plugins` are
    the modules that register the run's envs: imported here, and by the env server or the Ray
    workers that the backend starts, so every process resolves `env` the same way."""
    load_plugins(plugins)
    try:
        build = BACKENDS[runtime.backend]
    except KeyError:
        raise ValueError(
            f"runtime.backend: unknown name {runtime.backend!r}; allowed values: {sorted(BACKENDS)}"
        ) from None
    return build(env, params, runtime, tuple(plugins))
