"""The Ray env backend: env instances live in `EnvWorker` actors, the agent loop talks to them
through `RayEnv` proxies, and `RayEnvBackend` supervises the workers.

Failure semantics (reference/reliability.md §2, ENV-02/11/13):

* the env raises -> the worker returns the exception as data (`EnvFailure`: type, message,
  traceback), drops that one instance and keeps serving the others; the proxy raises
  `RayEnvError` (an `InfraError`), so the trajectory ends `infra_failed` and the text reaches
  `Trajectory.info`, never the model's context;
* a call passes `call_timeout_s` -> `EnvTimeout` (trajectory `env_timeout`); the call is
  cancelled (async envs) and the instance destroyed, never reused; a worker whose threads are
  mostly stuck in abandoned sync calls is replaced;
* the worker process dies (SIGKILL, OOM, node loss) -> every episode on it ends `infra_failed`
  and the backend starts a fresh actor in its slot; episodes on other workers go on. Gymnasium's
  `AsyncVectorEnv` instead closes the env and re-raises, ending the whole batch.

The worker itself is in `ray_envs.py`. The factory is resolved from the registry in *this*
process and shipped to the workers by value (cloudpickle), so envs registered at run time
(tests, notebooks) work on workers whose own registry only has the built-ins; built-in
factories pickle by reference to `steprl`, which must be importable on every node.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import sys
import weakref
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from steprl.envs.base import Env, EnvTimeout, InfraError, Observation, ToolInfo, Transition
from steprl.envs.registry import get_spec
from steprl.hosting import ray_reaper
from steprl.hosting.ray_batch import RayCalls
from steprl.hosting.ray_envs import EnvFailure, EnvMeta, EnvWorker, WorkerStats
from steprl.types import Task

__all__ = [
    "EnvFailure",
    "EnvMeta",
    "EnvWorker",
    "RayEnv",
    "RayEnvBackend",
    "RayEnvError",
    "RayEnvTimeout",
    "WorkerStats",
    "ensure_ray",
]


def ensure_ray(*, num_cpus: int | None = None) -> None:
    """Start or join Ray unless this process already did.

    `RAY_ADDRESS` set (e.g. `ray://head:10001` or `head:6379`): join that cluster. Unset: start a
    private local instance (`address="local"`, so a stray cluster on the same machine is never
    joined by accident), and a watcher that kills its agents and workers within a second of this
    process's death (`ray_reaper.py`; Ray's own agents outlive a SIGKILLed driver by 60 s). The
    dashboard is never started: it opens ports we do not need.
    """
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, include_dashboard=False)
    else:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)
        ray_reaper.start()


class RayEnvError(InfraError):
    """The env raised inside a Ray worker; `remote_type` and `remote_traceback` say what and where."""

    def __init__(self, failure: EnvFailure) -> None:
        super().__init__(f"{failure.method} raised {failure.type_name}: {failure.message}")
        self.remote_type = failure.type_name
        self.remote_traceback = failure.traceback


class RayEnvTimeout(EnvTimeout):
    """The env raised `EnvTimeout` itself inside a Ray worker."""


_EnvWorkerActor = ray.remote(EnvWorker)
_Worker = tuple[int, int]  # (slot, generation): one worker actor
#: How long a worker may take to answer `destroy` before it is replaced (its loop is stuck).
#: An `EnvTimeout` is raised at most this long after the call's own deadline.
_DESTROY_GRACE_S = 5.0


# ---- the proxy the agent loop sees ------------------------------------------------------------


@dataclass
class _Slot:
    """One worker position: the current actor, how many times it was replaced, its live envs."""

    actor: Any
    generation: int = 0
    live: int = 0


class RayEnv:
    """An `Env` whose instance lives in an `EnvWorker`. Every call has a deadline; any failure
    raises an `InfraError` (the loop ends the trajectory `infra_failed` / `env_timeout`)."""

    def __init__(self, backend: RayEnvBackend, index: int, slot: _Slot, instance_id: str) -> None:
        self._backend = backend
        self._index = index
        self._generation = slot.generation
        self._actor = slot.actor
        self._id = instance_id
        self._timeout_s = backend.call_timeout_s
        # Created at the first reset, batched with the other episodes' creates (or at once, when
        # stop_strings / system_prompt / tools are read before that).
        self._created: Any = None
        self._meta: EnvMeta | None = None
        self._released = False

    @property
    def stop_strings(self) -> Sequence[str]:
        return self._meta_blocking().stop_strings

    @property
    def system_prompt(self) -> str:
        return self._meta_blocking().system_prompt

    @property
    def tools(self) -> Mapping[str, ToolInfo]:
        return {t.name: t for t in self._meta_blocking().tools}

    async def reset(self, task: Task, seed: int) -> Observation:
        if self._meta is None:
            created = self._created if self._created is not None else self._call("create")
            self._meta = await self._await("create", created)
        obs: Observation
        obs, self._meta = await self._await("reset", self._call("reset", task, seed))
        return obs

    async def step(self, action: str) -> Transition:
        transition: Transition = await self._await("step", self._call("step", action))
        return transition

    async def close(self) -> None:
        if self._released:
            return
        try:
            await self._await("close", self._call("close"))
        finally:
            self._release()

    def _call(self, method: str, *args: Any) -> asyncio.Future[Any]:
        """Sent with the other calls made to this worker in this event-loop tick."""
        return self._backend._calls(self._index, self._generation, self._actor).call(self._id, method, *args)

    def _meta_blocking(self) -> EnvMeta:
        """The loop reads these after `reset` (already fetched); direct users may read them first."""
        if self._meta is None:
            if self._created is None:
                self._created = self._actor.create.remote(self._id)
            try:
                reply = ray.get(self._created, timeout=self._timeout_s)
            except RayActorError as exc:
                self._release()
                self._backend._replace(self._index, self._generation, reason=type(exc).__name__)
                raise InfraError(
                    f"Ray env worker {self._index} died during create; it was replaced"
                ) from None
            except (GetTimeoutError, RayError) as exc:
                self._release()
                raise InfraError(f"env worker {self._index}: create failed ({type(exc).__name__})") from None
            if isinstance(reply, EnvFailure):
                self._release()
                raise RayEnvError(reply)
            self._meta = reply
        return self._meta

    async def _await(self, method: str, ref: Any) -> Any:
        try:
            reply = await asyncio.wait_for(ref, self._timeout_s)
        except TimeoutError:
            if isinstance(ref, ray.ObjectRef):
                ray.cancel(ref)  # stops an async env's coroutine; a sync env's thread runs on
            # (a batched call is stopped by the worker's `destroy`, below)
            self._release()
            await self._backend._abandon(self._index, self._generation, self._id)
            raise EnvTimeout(
                f"env {method} on Ray worker {self._index} took over {self._timeout_s:g}s; the instance "
                "was destroyed. Raise runtime.env_call_timeout_s if the env is legitimately slow."
            ) from None
        except RayActorError as exc:
            self._release()
            self._backend._replace(self._index, self._generation, reason=type(exc).__name__)
            raise InfraError(
                f"Ray env worker {self._index} died during {method} ({type(exc).__name__}); it was "
                "replaced and this episode is lost. Check the worker's log (OOM, segfault)."
            ) from None
        except RayError as exc:  # e.g. the reply could not be serialised
            self._release()
            raise InfraError(f"Ray call {method} on env worker {self._index} failed: {exc}") from None
        if isinstance(reply, EnvFailure):
            self._release()  # the worker dropped the instance
            raise (RayEnvTimeout if reply.is_timeout else RayEnvError)(reply)
        return reply

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self._backend._release(self._index, self._generation)


# ---- the backend (supervisor) -----------------------------------------------------------------


class RayEnvBackend:
    """`EnvBackend` over `num_workers` `EnvWorker` actors; new instances go to the least-loaded
    worker (ties round-robin). Dead workers are replaced on the first failed call."""

    name = "ray"

    def __init__(
        self,
        env: str,
        params: Mapping[str, Any],
        *,
        num_workers: int = 2,
        call_timeout_s: float = 30.0,
        max_calls_per_worker: int = 64,
        threads_per_worker: int = 16,
        cpus_per_worker: float = 0.25,
        start_timeout_s: float = 120.0,
        factory: Callable[..., Env] | None = None,
        plugins: Sequence[str] = (),
    ) -> None:
        """`factory` overrides the registry lookup of `env` (pass it where the name is not
        registered, e.g. inside another actor). `cpus_per_worker` is what Ray reserves per worker
        for placement; raise it for CPU-heavy envs, so Ray spreads them over more nodes. The
        workers must answer within `start_timeout_s`, so a misconfiguration fails here, once,
        instead of as one infra failure per episode."""
        if num_workers < 1:
            raise ValueError(f"runtime.env_workers must be >= 1, got {num_workers}.")
        if call_timeout_s <= 0:
            raise ValueError(f"runtime.env_call_timeout_s must be > 0, got {call_timeout_s}.")
        resolved = factory if factory is not None else get_spec(env, params).factory  # before starting Ray
        ensure_ray()
        self.env = env
        self.call_timeout_s = call_timeout_s
        #: (slot, why) for every worker replaced after dying, hanging or saturating with stuck calls
        self.replaced: list[tuple[int, str]] = []
        # pickled here, loaded by the worker after it has the driver's sys.path and plugins
        self._factory_ref = ray.put(ray.cloudpickle.dumps(resolved))
        self._sys_path = tuple(p or os.getcwd() for p in sys.path)
        self._params = dict(params)
        self._threads = threads_per_worker
        self._plugins = tuple(plugins)
        self._options = {
            "num_cpus": cpus_per_worker,
            "max_concurrency": max_calls_per_worker,
            "scheduling_strategy": "SPREAD",
            "max_restarts": 0,  # we replace workers ourselves, so the episodes on them fail loudly
        }
        self._slots = [_Slot(self._spawn()) for _ in range(num_workers)]
        self._next = itertools.count()
        self._ids = itertools.count()
        self._prefix = os.urandom(4).hex()
        self._closed = False
        #: env calls sent to the workers: "calls", in "batches" (actor calls), "late" (answered
        #: after their batch, by a call of their own)
        self.call_counts: Counter[str] = Counter()
        # per event loop: (slot, generation) -> the batcher of calls to that worker actor
        self._batchers: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, dict[tuple[int, int], RayCalls]
        ] = weakref.WeakKeyDictionary()
        self._await_start(start_timeout_s, cpus_per_worker)

    @classmethod
    def from_runtime(
        cls, env: str, params: Mapping[str, Any], runtime: Any, plugins: Sequence[str] = ()
    ) -> RayEnvBackend:
        """From `steprl.config.RuntimeSection`: env_workers, env_call_timeout_s and
        max_concurrent_envs (split evenly over the workers as their concurrent-call cap)."""
        workers = int(runtime.env_workers)
        calls = max(1, math.ceil(int(runtime.max_concurrent_envs) / workers))
        return cls(
            env,
            params,
            num_workers=workers,
            call_timeout_s=float(runtime.env_call_timeout_s),
            max_calls_per_worker=calls,
            threads_per_worker=min(calls, 32),
            plugins=plugins,
        )

    def make_env(self, task: Task) -> Env:
        if self._closed:
            raise RuntimeError("RayEnvBackend is closed; make a new backend for another run.")
        start = next(self._next)
        n = len(self._slots)
        index = min(((start + k) % n for k in range(n)), key=lambda i: self._slots[i].live)
        slot = self._slots[index]
        slot.live += 1
        return RayEnv(self, index, slot, f"{self._prefix}-{next(self._ids)}")

    def worker_stats(self, timeout_s: float = 10.0) -> list[WorkerStats | None]:
        """Each worker's stats, or None for one that did not answer within `timeout_s`."""
        refs = [s.actor.stats.remote() for s in self._slots]
        out: list[WorkerStats | None] = []
        for ref in refs:
            try:
                out.append(ray.get(ref, timeout=timeout_s))
            except (GetTimeoutError, RayError):
                out.append(None)
        return out

    def close(self) -> None:
        """Kill the workers (their env instances go with them). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for slot in self._slots:
            ray.kill(slot.actor, no_restart=True)

    def _await_start(self, timeout_s: float, cpus: float) -> None:
        try:
            ray.get([s.actor.stats.remote() for s in self._slots], timeout=timeout_s)
        except GetTimeoutError:
            self.close()
            raise RuntimeError(
                f"Ray did not start {len(self._slots)} env workers ({cpus:g} CPU each) within "
                f"{timeout_s:g}s; check `ray status` for free CPUs, or lower runtime.env_workers."
            ) from None
        except RayError as exc:
            self.close()
            raise RuntimeError(
                f"the Ray env workers for {self.env!r} failed to start: {exc}\nThe env factory must be "
                "importable on every node: install steprl (and your env package) there."
            ) from None

    def _spawn(self) -> Any:
        return _EnvWorkerActor.options(**self._options).remote(
            self._factory_ref, self._params, self._threads, self._plugins, self._sys_path
        )

    def _calls(self, index: int, generation: int, actor: Any) -> RayCalls:
        per_loop = self._batchers.setdefault(asyncio.get_running_loop(), {})
        found = per_loop.get((index, generation))
        if found is None:
            found = per_loop[(index, generation)] = RayCalls(actor, self.call_counts)
        return found

    def _release(self, index: int, generation: int) -> None:
        slot = self._slots[index]
        if slot.generation == generation:  # a replaced worker's counts are gone with it
            slot.live -= 1

    def _replace(self, index: int, generation: int, *, reason: str) -> None:
        """Start a fresh worker in slot `index`, once per generation (many proxies report the
        same death). Instances on the old worker are lost; their calls fail as infra."""
        slot = self._slots[index]
        if self._closed or slot.generation != generation:
            return
        ray.kill(slot.actor, no_restart=True)  # no-op if it is already dead
        self._slots[index] = _Slot(self._spawn(), generation + 1)
        self.replaced.append((index, reason))

    async def _abandon(self, index: int, generation: int, instance_id: str) -> None:
        """After a timeout: destroy the instance; replace the worker if it does not answer within
        `_DESTROY_GRACE_S` or half of its threads are stuck in abandoned calls."""
        slot = self._slots[index]
        if slot.generation != generation:
            return
        try:
            stats = await asyncio.wait_for(slot.actor.destroy.remote(instance_id), _DESTROY_GRACE_S)
        except (TimeoutError, RayError) as exc:
            self._replace(index, generation, reason=f"destroy failed: {type(exc).__name__}")
            return
        if stats.stuck_threads * 2 >= self._threads:
            self._replace(index, generation, reason="stuck threads")
