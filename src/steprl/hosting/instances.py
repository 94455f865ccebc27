"""The env server's state: live env instances and their lifecycle.

An `Instance` is one env object plus what the server needs to serve it safely: a lock (one
call at a time per instance), its episode state (created -> ready -> done, or broken), the
idempotency record of its last step, and when it was last used (for the idle reaper).
`InstanceTable` owns the instances, the max-instances cap and the tombstones that let a call on
a closed instance get a precise 409 instead of a vague 404. Env calls run on `WorkerThreads`
(`threads.py`), so a hung env never stalls other clients.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from steprl.hosting.protocol import TransitionMsg
from steprl.hosting.threads import Overloaded, WorkerThreads, call_env

logger = logging.getLogger(__name__)


class ServeError(Exception):
    """A structured HTTP error: the server answers `status` with the error envelope."""

    def __init__(self, status: int, type_: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.headers = headers or {}


class InstanceState(StrEnum):
    CREATED = "created"  # built, never reset: step is a 409
    READY = "ready"  # reset: steps are accepted
    DONE = "done"  # the episode ended (terminated or truncated): step is a 409, reset allowed
    BROKEN = "broken"  # the env raised: only close is accepted


@dataclass(eq=False)
class Instance:
    """One env object and its serving state. Mutated only while `lock` is held."""

    id: str
    env_name: str
    env: Any
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    state: InstanceState = InstanceState.CREATED
    seq: int = 0  # seq of the last applied step (0 after a reset)
    last: TransitionMsg | None = None  # the answer to step `seq`, replayed for a duplicate
    busy: int = 0  # calls in flight (waiting for the lock or running): never reaped while > 0
    last_used: float = field(default_factory=time.monotonic)

    def touch(self) -> None:
        self.last_used = time.monotonic()


class InstanceTable:
    """Live instances, the max-instances cap, and tombstones of the recently closed ones.

    A create first `reserve`s a slot (False at the cap: the caller answers 503) while it builds
    the env, then `release`s it and, on success, `add`s the env in the same event-loop step.
    `pop` removes an instance and remembers why, so a later call on its id is a 409 that says
    so ("closed by the client", "reaped after ...").
    """

    def __init__(self, max_instances: int, *, tombstones: int = 10_000) -> None:
        if max_instances < 1:
            raise ValueError(f"max_instances must be >= 1, got {max_instances}")
        self.max_instances = max_instances
        self._live: dict[str, Instance] = {}
        self._reserved = 0
        self._gone: OrderedDict[str, str] = OrderedDict()
        self._tombstones = tombstones
        self.counts: Counter[str] = Counter()  # created, closed, reaped, destroyed, rejected_at_capacity

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Instance]:
        return iter(list(self._live.values()))

    def reserve(self) -> bool:
        if len(self._live) + self._reserved >= self.max_instances:
            self.counts["rejected_at_capacity"] += 1
            return False
        self._reserved += 1
        return True

    def release(self) -> None:
        self._reserved -= 1

    def add(self, env_name: str, env: Any) -> Instance:
        """Register a built env (its reservation was just released, with no await in between)."""
        inst = Instance(id=uuid.uuid4().hex, env_name=env_name, env=env)
        self._live[inst.id] = inst
        self.counts["created"] += 1
        return inst

    def get(self, instance_id: str) -> Instance:
        """The live instance; 409 if it was closed, reaped or destroyed; 404 if never seen."""
        inst = self._live.get(instance_id)
        if inst is not None:
            return inst
        why = self._gone.get(instance_id)
        if why is not None:
            raise ServeError(
                409,
                "instance_closed",
                f"env instance {instance_id} is gone ({why}); create a new one with POST /v1/envs",
            )
        raise ServeError(
            404,
            "not_found",
            f"unknown env instance {instance_id!r} (never created here, or the server restarted "
            "since); create one with POST /v1/envs",
        )

    def live(self, instance_id: str) -> Instance | None:
        """The live instance, or None (closed, reaped, destroyed or unknown)."""
        return self._live.get(instance_id)

    def is_gone(self, instance_id: str) -> bool:
        return instance_id in self._gone

    def pop(self, instance_id: str, why: str, counter: str) -> Instance | None:
        """Remove a live instance (None if it is not live) and remember why it went."""
        inst = self._live.pop(instance_id, None)
        if inst is None:
            return None
        self._gone[instance_id] = why
        while len(self._gone) > self._tombstones:
            self._gone.popitem(last=False)
        self.counts[counter] += 1
        return inst

    def idle(self, ttl_s: float) -> list[Instance]:
        """Instances with no call in flight and unused for more than `ttl_s` seconds."""
        cutoff = time.monotonic() - ttl_s
        return [i for i in self._live.values() if i.busy == 0 and i.last_used < cutoff]


async def close_quietly(threads: WorkerThreads, inst: Instance, timeout_s: float) -> str | None:
    """Close `inst.env` within `timeout_s`; the error text if it raised or hung, else None."""
    try:
        async with asyncio.timeout(timeout_s):
            await call_env(threads, inst.env.close)
    except TimeoutError:
        logger.warning("env %s (%s): close() passed its %.1fs deadline", inst.id, inst.env_name, timeout_s)
        return f"close() did not return within {timeout_s:g}s"
    except Overloaded as exc:
        return str(exc)
    except Exception as exc:
        logger.warning("env %s (%s): close() raised %s: %s", inst.id, inst.env_name, type(exc).__name__, exc)
        return f"{type(exc).__name__}: {exc}"
    return None


async def reap_forever(
    table: InstanceTable, ttl_s: float, destroy: Callable[[Instance, str, str], Awaitable[None]]
) -> None:
    """Every ~ttl/4 (at most 5 s), destroy instances idle for longer than `ttl_s`."""
    interval = min(max(ttl_s / 4, 0.05), 5.0)
    while True:
        await asyncio.sleep(interval)
        for inst in table.idle(ttl_s):
            await destroy(inst, f"reaped after {ttl_s:g}s idle", "reaped")
