"""The weights to Ray rollout workers by a collective broadcast (`runtime.weight_sync:
broadcast`): `WeightGroup`, which a `RayRolloutPool` holds instead of putting each bucket in
the object store.

The group's members are the sender (rank 0) and every rollout worker. The sender is where the
learner's weights are: this process for a one-process learner (`LocalSender`, a thread), or
learner rank 0 for FSDP2 ranks (the `remote` a `LearnerGroup`'s update carries; every rank
takes part, gathering one bucket at a time, `transports/collective.py: send_sharded`). The group
is formed at the first sync and again whenever its members change (a worker replaced, another
sender): each member joins under a fresh prefix of the controller's store (`GroupHost`).

A sync: the sender broadcasts and each worker receives, all within `sync_timeout_s` (the
group's own deadline too, so nobody waits on a dead peer past it). A worker that died or hung
is reported back for the pool to replace; a bucket refused (its checksum) or a sender that
failed is a `WeightSyncError`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, Protocol

import ray
from ray.exceptions import GetTimeoutError, RayError, RayTaskError

from steprl.engines.transports.collective import GroupAddress, GroupHost, in_thread, join, send
from steprl.engines.weights import WeightSyncError, WeightUpdate

#: how long a failed sync waits for the workers' answers: a worker that died is known by then,
#: and one held in a collective by a peer that hung is freed by then (its timeout began with ours)
GRACE_S = 5.0

#: waits for what a member started, at most the seconds given; raises what it raised
Waiter = Callable[[float], Any]


class Sender(Protocol):
    """Rank 0 of a weights group: where the learner's weights are."""

    def join(self, address: GroupAddress) -> Waiter: ...

    def send(self, update: WeightUpdate) -> Waiter: ...


def _in_thread(fn: Callable[[], Any]) -> Waiter:
    future = in_thread(fn)
    return lambda timeout: future.result(timeout)


class LocalSender:
    """This process is rank 0 (a one-process learner): its update's buckets, broadcast from a
    thread while the workers receive."""

    def __init__(self) -> None:
        self.group: Any = None

    def join(self, address: GroupAddress) -> Waiter:
        def joined() -> None:
            self.group = join(address, 0)

        return _in_thread(joined)

    def send(self, update: WeightUpdate) -> Waiter:
        group = self.group
        return _in_thread(lambda: send(group, update))


def ray_waiter(refs: Sequence[Any]) -> Waiter:
    return lambda timeout: ray.get(list(refs), timeout=timeout)


class WeightGroup:
    """The pool's weights group: formed on demand, one sync at a time."""

    def __init__(self, host: str, sync_timeout_s: float) -> None:
        self.host = GroupHost(host, timeout_s=sync_timeout_s)
        self.timeout_s = sync_timeout_s
        self.local = LocalSender()
        self._members: tuple[Any, ...] | None = None  # (sender, *worker actors) it was formed with

    def stale(self) -> None:
        """Form the group again before the next sync (a member left)."""
        self._members = None

    def sync(self, update: WeightUpdate, workers: Sequence[Any]) -> dict[int, tuple[str, bool]]:
        """`update` to every worker; returns {worker index: (why, dead)} for each worker that
        failed: dead or hung (the pool replaces it), or alive with the group broken under it
        (it stays; the group is formed again). Raises `WeightSyncError` for a refused bucket or
        a failed sender. The group is formed first if its members changed."""
        sender: Sender = update.remote if update.remote is not None else self.local
        deadline = time.monotonic() + self.timeout_s
        members = (sender, *workers)
        if self._members != members:
            # a dead member would hold every other one in the join until the deadline: ask first
            failed = self._wait_workers(workers, [w.pid.remote() for w in workers], deadline, "answering")
            if failed:
                return failed
            address = self.host.address(len(workers) + 1, self.timeout_s)
            sender_joined = sender.join(address)
            refs = [w.join_weights_group.remote(address, k + 1) for k, w in enumerate(workers)]
            failed = self._wait_workers(workers, refs, deadline, "joining the weights group")
            if failed:  # the sender waits for the missing member until the deadline
                with contextlib.suppress(Exception):
                    sender_joined(max(0.0, deadline - time.monotonic()))
                return failed
            self._wait_sender(sender_joined, deadline, update.version, "joining the weights group")
            self._members = members
        sent = sender.send(update)
        refs = [w.receive_weights.remote() for w in workers]
        doing = f"receiving version {update.version}"
        try:  # the sender first: its failure is either a worker's (gone, hung) or its own
            sent(max(0.0, deadline - time.monotonic()))
        except Exception as exc:  # noqa: BLE001 - classified below
            self._members = None  # the group is broken
            failed = self._wait_workers(workers, refs, time.monotonic() + GRACE_S, doing)
            if any(dead for _, dead in failed.values()):
                return failed
            self._sender_failed(exc, update.version, "broadcasting")
        failed = self._wait_workers(workers, refs, deadline, doing)
        if failed:
            self._members = None
        return failed

    def _wait_workers(
        self, workers: Sequence[Any], refs: Sequence[Any], deadline: float, doing: str
    ) -> dict[int, tuple[str, bool]]:
        """Each worker's answer by `deadline`: {index: (why, dead)} for those that failed. One
        still busy then is pinged, all at once, for up to `GRACE_S`: one that answers was only
        held up (in a collective that a peer that hung kept open, whose own timeout began about
        when the sender's or the deadline's did) and stays; one that does not is hung."""
        failed: dict[int, tuple[str, bool]] = {}
        late = []
        for k, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except RayTaskError as exc:
                cause = getattr(exc, "cause", None)
                if isinstance(cause, WeightSyncError):
                    self._members = None
                    raise WeightSyncError(f"rollout worker {k}: {cause}") from None
                failed[k] = (f"{doing}: {_line(cause or exc)}", False)  # the group broke under it
            except GetTimeoutError:
                late.append(k)
            except RayError as exc:  # dead
                failed[k] = (f"{doing}: {type(exc).__name__}", True)
        if late:
            pings = [workers[k].pid.remote() for k in late]
            answered, _ = ray.wait(pings, num_returns=len(pings), timeout=GRACE_S)
            for k, ping in zip(late, pings, strict=True):
                held = ping in answered
                failed[k] = (f"{doing}: " + ("held up by a peer" if held else "no answer (hung)"), not held)
        return failed

    def _wait_sender(self, waiter: Waiter, deadline: float, version: int, doing: str) -> None:
        try:
            waiter(max(0.0, deadline - time.monotonic()))
        except Exception as exc:  # noqa: BLE001 - any failure of rank 0 is the sync's
            self._sender_failed(exc, version, doing)

    def _sender_failed(self, exc: BaseException, version: int, doing: str) -> NoReturn:
        self._members = None
        raise WeightSyncError(
            f"the weights sender failed while {doing} version {version} ({_line(exc)}); "
            f"runtime.weight_sync_timeout_s is {self.timeout_s:g} s"
        ) from None


def _line(exc: BaseException) -> str:
    """`exc` as one line: its type and the last line of its message."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[-1][:300]}" if text else type(exc).__name__


__all__ = ["LocalSender", "Sender", "WeightGroup", "ray_waiter"]
