"""How a `WeightUpdate` crosses from the learner to the engines: `WEIGHT_SYNC`, one file per
transport plus one entry here, each checked by `check_weight_sync` in the tests.

A transport turns an update into a handle on the sender's side (`send`: what must cross a
process boundary, picklable where it must be) and back into an update on the receiver's
(`receive`: the buckets, read in order, one at a time where the medium allows); the receiver's
`Receiver` checks the stream whatever carried it. `release` frees what `send` made.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import torch

from steprl.engines.transports.collective import Broadcast
from steprl.engines.transports.files import SafetensorsFiles
from steprl.engines.transports.inprocess import InProcess
from steprl.engines.transports.ray_store import RayObjectStore
from steprl.engines.transports.socket_stream import SocketStream
from steprl.engines.weights import Bucket, WeightSyncError, WeightUpdate, load_in_place
from steprl.registry import Registry


class Transport(Protocol):
    def send(self, update: WeightUpdate) -> Any: ...

    def receive(self, handle: Any) -> WeightUpdate: ...

    def release(self, handle: Any) -> None: ...


#: name -> a transport, given a scratch directory it may write under
WEIGHT_SYNC: Registry[Callable[[Path], Transport]] = Registry(
    {
        "inprocess": lambda _: InProcess(),  # the HF engine beside the learner
        "ray": lambda _: RayObjectStore(),  # Ray rollout workers (runtime.rollout_workers)
        "socket": lambda _: SocketStream(),  # the vLLM worker process (rollout.engine: vllm)
        "files": SafetensorsFiles,  # the vLLM worker, where a socket cannot reach it (and adapters)
        # Ray rollout workers in a gloo group with the learner (runtime.weight_sync: broadcast);
        # here both ends of a real two-member group in one process
        "broadcast": lambda _: Broadcast.loopback(),
    },
    key="weight_sync",
    what="weight transport",
    accept=lambda obj: inspect.isfunction(obj) or isinstance(obj, type),  # a builtin is callable too
    expected="a transport factory; name a function (scratch: Path) -> Transport",
    checker=None,
    checked_by="check_weight_sync, between two small models; ray: a Ray cluster "
    "(tests/rollout/test_weight_sync.py)",
)


def check_weight_sync(transport: Transport, sender: torch.nn.Module, receiver: torch.nn.Module) -> int:
    """`receiver` ends bit-identical to `sender` through `transport` (in buckets small enough
    that there are several), and a stream with a bucket lost, or two swapped, or (a transport
    that copies the bytes) one byte changed, is refused with a `WeightSyncError`. Returns how
    many buckets the update took."""
    own = sender.state_dict()
    smallest = min(t.numel() * t.element_size() for t in own.values())
    update = WeightUpdate.of_tensors(own, version=7, bucket_bytes=max(smallest, 1))
    handle = transport.send(update)
    try:
        got = transport.receive(handle)
        assert got.version == 7 and got.names == update.names, (got.version, got.names[:3])
        buckets: list[Bucket] = []  # as they arrived (a collective sends each once)
        load_in_place(receiver, _replay(got, _recorded(got, buckets)))
        theirs = receiver.state_dict()
        for name, tensor in own.items():
            assert torch.equal(theirs[name], tensor), f"{name} differs after the transport"
        assert len(buckets) >= 3, f"{len(buckets)} buckets: too few to lose one in the middle"
        broken_streams = [
            ([buckets[0], *buckets[2:]], "lost"),
            ([buckets[1], buckets[0], *buckets[2:]], "swapped"),
            (buckets[:-1], "the last lost"),
        ]
        if handle is not update:  # the bytes were copied: each bucket must carry its checksums
            assert all(b.checksums for b in buckets), "a transport that copies must seal its buckets"
            broken_streams.append(([buckets[0], _flipped(buckets[1]), *buckets[2:]], "changed in flight"))
        for broken, why in broken_streams:
            try:
                load_in_place(receiver, _replay(got, broken))
            except WeightSyncError:
                continue
            raise AssertionError(f"a stream with a bucket {why} was accepted")
        return len(buckets)
    finally:
        transport.release(handle)


def _flipped(bucket: Bucket) -> Bucket:
    """`bucket` with one byte of its first tensor changed, its checksums kept."""
    name, tensor = next(iter(bucket.tensors.items()))
    raw = tensor.detach().clone().contiguous()
    raw.view(torch.uint8).reshape(-1)[0] ^= 1
    return replace(bucket, tensors={**bucket.tensors, name: raw})


def _recorded(update: WeightUpdate, into: list[Bucket]) -> Iterator[Bucket]:
    for bucket in update.produce():
        into.append(bucket)
        yield bucket


def _replay(update: WeightUpdate, buckets: Iterable[Bucket]) -> WeightUpdate:
    return WeightUpdate(update.version, update.names, lambda: iter(buckets))


__all__ = ["WEIGHT_SYNC", "Transport", "check_weight_sync"]
