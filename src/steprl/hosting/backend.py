"""`EnvBackend`: where env instances live. One visible dict, `BACKENDS`, picks it by name.

The agent loop only ever calls `backend.make_env(task)` and then the `Env` protocol
(reset/step/close) on what it gets, so in-process, HTTP and Ray environments are
interchangeable; the conformance suite (tests/hosting/test_conformance.py) runs the same tests
against all three.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from steprl.envs.base import Env, EnvTimeout, IncompleteEnv, missing_members
from steprl.envs.deadline import DeadlineEnv, EnvCalls, run_within
from steprl.envs.registry import EnvParamsError, get_spec, load_plugins
from steprl.errors import UserError
from steprl.extras import require_extra
from steprl.hosting.env_procs import EnvProcessError, EnvProcesses, ProcessEnv, isolates
from steprl.hosting.env_worker import Meta
from steprl.registry import Registry
from steprl.types import Task

T = TypeVar("T")
_log = logging.getLogger(__name__)


class EnvBackend(Protocol):
    """Makes one fresh env instance per episode; `close` releases what the backend holds."""

    name: str

    def make_env(self, task: Task) -> Env: ...

    def close(self) -> None: ...


class EnvStartError(UserError):
    """The run's env did not start: its factory or `close()` passed the call deadline at the
    start-up probe. One line that names the call and the setting."""


class InProcessBackend:
    """Env instances built by the registered factory, managed from this process. Each call
    answers within `call_timeout_s` (`envs/deadline.py`: a sync env's calls run on a thread of
    their own, so a call that blocks ends `env_timeout` instead of freezing every episode).

    `probe` builds one env and decides where the run's instances live: steprl's own envs and
    async envs here; a user's sync env in a process per instance (`env_procs.py`), so that a
    call past its deadline is killed rather than left running on the trainer's cores."""

    name = "inprocess"

    def __init__(
        self,
        env: str,
        params: Mapping[str, Any],
        *,
        call_timeout_s: float = 30.0,
        plugins: Sequence[str] = (),
    ) -> None:
        self._name = env
        self._factory = get_spec(env, params).factory
        self._params = dict(params)
        self._plugins = tuple(plugins)
        self.call_timeout_s = call_timeout_s
        self.calls = EnvCalls()  # waited for inline while quick; threads stuck past a deadline (bounded)
        self.processes: EnvProcesses | None = None  # set by `probe` for a user's sync env
        self._meta: Meta | None = None

    def make_env(self, task: Task) -> Env:
        if self.processes is not None and self._meta is not None:
            forked = ProcessEnv(self.processes, self._meta, self.call_timeout_s)
            return DeadlineEnv(forked, self.call_timeout_s, self.calls)
        return DeadlineEnv(self._factory(**self._params), self.call_timeout_s, self.calls)

    def probe(self) -> InProcessBackend:
        """Fail fast: build one env and check it has every member the core reads (else every
        episode would end `infra_failed` on the same AttributeError), or refuses its params (every
        episode would fail on them); its factory and `close()` each within the call deadline.
        Then start its processes if it runs in them. Call outside an event loop."""
        try:
            env = self._within(lambda: self._factory(**self._params), "its factory")
        except ValueError as exc:  # a value the factory checks (other errors keep their traceback)
            raise EnvParamsError(
                f"env {self._name!r} refused env.params {self._params}: {type(exc).__name__}: {exc}"
            ) from exc
        problem = missing_members(env)
        if "close" not in (problem or ""):
            closed = self._within(env.close, f"{type(env).__name__}.close()")
            if inspect.isawaitable(closed):
                asyncio.run(self._awaited_within(closed, f"{type(env).__name__}.close()"))
        if problem:
            raise IncompleteEnv(f"env {self._name!r}: its factory returned {problem}")
        if isolates(self._factory, env):
            self._meta = Meta.of(env)
            try:
                self.processes = EnvProcesses(self._name, self._params, self._factory, self._plugins).start()
            except EnvProcessError as exc:  # e.g. an env registered by a script's __main__
                _log.warning(
                    "env %r runs on threads in this process, not in processes of its own (%s): a "
                    "call past its deadline cannot be stopped there; register it in a module "
                    "(env.plugins) to isolate it",
                    self._name,
                    exc,
                )
        return self

    def _within(self, fn: Callable[[], T], what: str) -> T:
        try:
            return run_within(fn, self.call_timeout_s, what)
        except EnvTimeout as exc:
            raise self._start_error(exc) from None

    async def _awaited_within(self, value: Awaitable[object], what: str) -> None:
        try:
            await asyncio.wait_for(_awaited(value), self.call_timeout_s)
        except TimeoutError:
            raise self._start_error(
                EnvTimeout(f"{what} gave no answer within {self.call_timeout_s:g}s")
            ) from None

    def _start_error(self, exc: EnvTimeout) -> EnvStartError:
        return EnvStartError(
            f"env {self._name!r}: {exc} when the run's first env was built and closed; fix the env "
            "(a call that never returns), or raise runtime.env_call_timeout_s if it is only slow"
        )

    def close(self) -> None:
        if self.processes is not None:
            self.processes.close()
            self.processes = None


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
BACKENDS: Registry[Callable[[str, Mapping[str, Any], Any, Sequence[str]], EnvBackend]] = Registry(
    {
        "inprocess": lambda env, params, runtime, plugins: InProcessBackend(
            env, params, call_timeout_s=runtime.env_call_timeout_s, plugins=plugins
        ).probe(),
        "http": _http,
        "ray": _ray,
    },
    key="runtime.backend",
    what="env backend",
    accept=inspect.isfunction,
    expected="a backend factory; name a function (env, params, runtime, plugins) -> EnvBackend",
    checker=None,
    checked_by="the conformance suite: each backend serves the same envs (tests/hosting/test_conformance.py)",
)


@dataclass(frozen=True)
class EnvRoute:
    """One of a run's envs: the `task.env` its tasks carry (`key`), and the env it names."""

    key: str
    name: str
    params: Mapping[str, Any] = field(default_factory=dict)


class UnknownTaskEnv(ValueError):
    """A task whose `env` is none of the run's envs."""


def route_env(makers: Mapping[str, Callable[[Task], Env]], task: Task) -> Env:
    """The env of `task` from the maker of its `task.env` (a run with several envs)."""
    make = makers.get(task.env)
    if make is None:
        raise UnknownTaskEnv(
            f"task {task.id!r} names env {task.env!r}, which is none of the run's envs "
            f"{sorted(makers)}; a task source must keep each task's env"
        )
    return make(task)


class RoutedBackend:
    """Several envs in one run: each episode's env is made by the backend of its `task.env`
    (`EnvRoute.key`), so in-process, HTTP and Ray runs mix envs alike. Each env keeps its own
    backend (an HTTP backend its own server or server env, a Ray backend its own workers)."""

    def __init__(self, backends: Mapping[str, EnvBackend]) -> None:
        self.backends = dict(backends)
        self.name = next(iter(self.backends.values())).name
        self._makers = {key: b.make_env for key, b in self.backends.items()}

    def make_env(self, task: Task) -> Env:
        return route_env(self._makers, task)

    def close(self) -> None:
        for backend in self.backends.values():
            backend.close()


def make_backends(routes: Sequence[EnvRoute], runtime: Any, plugins: Sequence[str] = ()) -> EnvBackend:
    """One backend for a run's envs: the env's own for one env (whatever its tasks call it),
    a `RoutedBackend` by `task.env` for several. A backend that fails to start closes those
    started before it."""
    if len(routes) == 1:
        return make_backend(routes[0].name, routes[0].params, runtime, plugins)
    started: dict[str, EnvBackend] = {}
    try:
        for route in routes:
            started[route.key] = make_backend(route.name, route.params, runtime, plugins)
    except BaseException:
        for backend in started.values():
            backend.close()
        raise
    return RoutedBackend(started)


def make_backend(
    env: str, params: Mapping[str, Any], runtime: Any, plugins: Sequence[str] = ()
) -> EnvBackend:
    """The backend named by `runtime.backend` (a `steprl.config.RuntimeSection`). `plugins` are
    the modules that register the run's envs: imported here, and by the env server or the Ray
    workers that the backend starts, so every process resolves `env` the same way."""
    load_plugins(plugins)
    build = BACKENDS.lookup(runtime.backend)
    return build(env, params, runtime, tuple(plugins))
