"""Which envs a Ray rollout worker builds and where their instances live (`WorkerEnvs`), and the
`make_env` the worker's agent loop calls (`worker_envs`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from steprl.envs.base import Env
from steprl.envs.deadline import DeadlineEnv, EnvCalls
from steprl.hosting.backend import EnvRoute, route_env
from steprl.hosting.ray_backend import RayEnvBackend
from steprl.types import Task


@dataclass(frozen=True)
class WorkerEnvs:
    """Which env the rollout workers build and where its instances live.

    `inprocess`: inside the rollout worker's own process (the worker is the isolation unit).
    `ray`: in `env_workers` `EnvWorker` actors owned by each rollout worker (they die with it),
    with the per-call deadline and supervision of `RayEnvBackend`.
    """

    #: one registered env name (no params), or the run's envs (several: each task's env by `task.env`)
    envs: str | tuple[EnvRoute, ...]
    placement: Literal["inprocess", "ray"] = "inprocess"
    env_workers: int = 1  # per rollout worker, placement "ray" only
    call_timeout_s: float = 30.0  # the deadline of one env call
    plugins: tuple[str, ...] = ()  # modules that register the run's envs, imported by each worker

    @property
    def routes(self) -> tuple[EnvRoute, ...]:
        return (EnvRoute(self.envs, self.envs, {}),) if isinstance(self.envs, str) else self.envs


def _deadline_env(
    factory: Callable[..., Env], params: Mapping[str, Any], timeout_s: float, calls: EnvCalls, task: Task
) -> Env:
    return DeadlineEnv(factory(**params), timeout_s, calls)


def worker_envs(
    envs: WorkerEnvs, factories: Mapping[str, Callable[..., Env]]
) -> tuple[Callable[[Task], Env], list[RayEnvBackend]]:
    """The worker's `make_env` (one env: whatever its tasks call it; several: by `task.env`, as
    `RoutedBackend` does) and the env backends it owns (closed with it)."""
    backends: list[RayEnvBackend] = []
    calls = EnvCalls()  # in-process envs: a sync call that blocks ends env_timeout here too
    makers: dict[str, Callable[[Task], Env]] = {}
    for route in envs.routes:
        factory, params = factories[route.key], dict(route.params)
        if envs.placement == "ray":
            backend = RayEnvBackend(
                route.name,
                params,
                num_workers=envs.env_workers,
                call_timeout_s=envs.call_timeout_s,
                factory=factory,
                plugins=envs.plugins,
            )
            backends.append(backend)
            makers[route.key] = backend.make_env
        else:
            makers[route.key] = functools.partial(_deadline_env, factory, params, envs.call_timeout_s, calls)
    make_env = next(iter(makers.values())) if len(makers) == 1 else functools.partial(route_env, makers)
    return make_env, backends


__all__ = ["WorkerEnvs", "worker_envs"]
