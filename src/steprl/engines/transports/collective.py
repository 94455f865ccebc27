"""A collective broadcast of the weights: one process group of their own (gloo), the sender its
rank 0 (the learner's process, or learner rank 0 of an FSDP2 group) and each engine worker a
receiver, every bucket broadcast once to all of them (`runtime.weight_sync: broadcast`).

Why a group of its own: the learner's ranks already have `torch.distributed`'s default group
(their FSDP2 collectives), and the engine workers are not in it; this group is made from a
`TCPStore` the controller keeps (`GroupHost`), under a fresh prefix each time its members
change (a replaced worker), so a rebuilt group never reads the keys of the one it replaces.

What crosses, per update: a header (the version and every name), then per bucket a JSON
description (names, dtypes, shapes, each tensor's CRC-32) and one flat byte payload. The payload
is laid out by *part*: from one process a part is the bucket's tensors back to back; from N
FSDP2 ranks, part r is rank r's dim-0 shards of the bucket's tensors (`send_sharded`), gathered
into rank 0's payload buffer as they are (one `gather` per bucket), so rank 0 never holds a
tensor twice nor the whole model: its extra memory is one bucket (plus padding to the largest
part). From one process on the CPU each tensor is broadcast from its own memory (a CUDA
learner's is copied to host memory first). A receiver joins each tensor's parts (dim-0 shards
are consecutive bytes of the full tensor) and checks it against the sender's CRC
(`Receiver`), so a changed byte is refused by name. Deadlines are the group's timeout: a member
that dies or stops reading fails every collective within it, never a silent hang; a sender
that cannot make a bucket says so in-band (`{"abort": why}`), and every receiver stops with it.
"""

from __future__ import annotations

import json
import threading
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from steprl.engines.lora_merge import AdapterUpdate, LoraDelta
from steprl.engines.weights import Bucket, WeightSyncError, WeightUpdate, checksum, plan_buckets

T = TypeVar("T")


@dataclass(frozen=True)
class GroupAddress:
    """Where a group's members meet: the controller's store and this group's prefix in it."""

    host: str
    port: int
    name: str  # the store prefix, fresh for each group formed
    world: int  # the sender (rank 0) and the receivers
    timeout_s: float  # every collective's deadline


class GroupHost:
    """The rendezvous the controller keeps for the run (a `TCPStore` server on `host`)."""

    def __init__(self, host: str = "127.0.0.1", timeout_s: float = 300.0) -> None:
        self.host, self._formed = host, 0
        self.store = dist.TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )

    def address(self, world: int, timeout_s: float) -> GroupAddress:
        self._formed += 1
        return GroupAddress(self.host, int(self.store.port), f"weights-{self._formed}", world, timeout_s)


def join(address: GroupAddress, rank: int) -> dist.ProcessGroupGloo:
    """This member's end of the group (blocks until every member has joined, or the deadline)."""
    timeout = timedelta(seconds=address.timeout_s)
    store = dist.TCPStore(address.host, address.port, is_master=False, timeout=timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore(address.name, store), rank, address.world, timeout)


# ---- the wire -------------------------------------------------------------------------------


def _bcast(group: dist.ProcessGroupGloo, tensor: torch.Tensor) -> None:
    group.broadcast(tensor, 0).wait()  # type: ignore[attr-defined]  # a Backend method, untyped


def _send_json(group: dist.ProcessGroupGloo, obj: Any) -> None:
    raw = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    _bcast(group, torch.tensor([raw.numel()], dtype=torch.int64))
    _bcast(group, raw)


def _recv_json(group: dist.ProcessGroupGloo) -> Any:
    size = torch.zeros(1, dtype=torch.int64)
    _bcast(group, size)
    raw = torch.empty(int(size.item()), dtype=torch.uint8)
    _bcast(group, raw)
    got = json.loads(bytes(raw.numpy()))
    if "abort" in got:  # the sender could not make the rest of the update
        raise WeightSyncError(f"the weights sender stopped the update: {got['abort']}")
    return got


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightSyncError(f"a weight bucket names an unknown dtype {name!r}")
    return dtype


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 view (a copy only if it is not contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@dataclass(frozen=True)
class _Layout:
    """One bucket on the wire: `tensors` as (name, dtype, shape), `sizes[p][k]` the bytes of
    tensor k in part p; part p starts at p * `stride` in the payload."""

    tensors: list[tuple[str, str, list[int]]]
    sizes: list[list[int]]

    @property
    def stride(self) -> int:
        return max((sum(s) for s in self.sizes), default=0)

    def pieces(self, payload: torch.Tensor, k: int) -> list[torch.Tensor]:
        """Tensor k's bytes in `payload`, part by part."""
        out = []
        for p, sizes in enumerate(self.sizes):
            start = p * self.stride + sum(sizes[:k])
            out.append(payload[start : start + sizes[k]])
        return out

    def crcs(self, payload: torch.Tensor) -> dict[str, int]:
        """Each tensor's CRC-32 as it is whole (a CRC chained over its parts in order)."""
        out = {}
        for k, (name, _, _) in enumerate(self.tensors):
            crc = 0
            for piece in self.pieces(payload, k):
                crc = zlib.crc32(piece.numpy().data, crc) if piece.numel() else crc
            out[name] = crc
        return out


def _send_bucket(
    group: dist.ProcessGroupGloo,
    layout: _Layout,
    pieces: Sequence[torch.Tensor],
    checksums: Mapping[str, int],
    at: tuple[int, int, int],
) -> int:
    """One bucket: its description, then its payload as `pieces` (consecutive byte ranges of
    it, each broadcast as it lies in memory: a tensor's own bytes need no copy). `at`: the
    bucket's (version, index, count)."""
    version, index, count = at
    meta = {"version": version, "index": index, "count": count, "tensors": layout.tensors}
    meta |= {"sizes": layout.sizes, "checksums": dict(checksums), "pieces": [p.numel() for p in pieces]}
    _send_json(group, meta)
    for piece in pieces:
        if piece.numel():
            _bcast(group, piece)
    return sum(p.numel() for p in pieces)


def send(group: dist.ProcessGroupGloo, update: WeightUpdate) -> int:
    """Rank 0: broadcast `update` (its buckets as they come, each checked by `Receiver` on the
    way out too; a LoRA adapter as its A and B matrices, one bucket). Returns the bytes sent.
    If making a bucket fails here (not the group), the receivers are told in-band, so they stop
    with its reason instead of waiting out the group's timeout."""
    header: dict[str, Any] = {"version": update.version, "names": list(update.names)}
    if update.adapter is not None:
        deltas = update.adapter.deltas
        header["adapter"] = [[d.module, d.scaling] for d in deltas]
        named = {f"{d.module}/{ab}": getattr(d, ab) for d in deltas for ab in "ab"}
        update = WeightUpdate.of_tensors(named, update.version, bucket_bytes=2**62, tied=False)
        header["names"] = list(update.names)
    _send_json(group, header)
    sent = 0
    buckets = iter(update.buckets())
    while True:
        try:
            bucket = next(buckets, None)
            if bucket is None:
                return sent
            tensors = [(n, str(t.dtype), list(t.shape)) for n, t in bucket.tensors.items()]
            flat = [_bytes(t.cpu()) for t in bucket.tensors.values()]  # views on a CPU; else copies
            crcs = {n: checksum(t) for n, t in bucket.tensors.items()}
        except Exception as exc:
            _send_json(group, {"abort": f"{type(exc).__name__}: {str(exc).strip()[:300]}"})
            raise
        at = (bucket.version, bucket.index, bucket.count)
        sent += _send_bucket(group, _Layout(tensors, [[f.numel() for f in flat]]), flat, crcs, at)


def receive(group: dist.ProcessGroupGloo) -> WeightUpdate:
    """A receiver: the next update on `group`, its header read now and each bucket read as the
    update is consumed (it must be consumed whole, once: the sender is broadcasting it)."""
    header = _recv_json(group)
    version, names = int(header["version"]), tuple(header["names"])

    def produce() -> Iterator[Bucket]:
        count = None if names else 0  # an update of nothing sends no bucket
        index = 0
        while count is None or index < count:
            meta = _recv_json(group)
            layout = _Layout([tuple(t) for t in meta["tensors"]], meta["sizes"])
            payload = torch.empty(layout.stride * len(layout.sizes), dtype=torch.uint8)
            if sum(meta["pieces"]) != payload.numel():
                where = f"bucket {meta['index']} of version {version}"
                raise WeightSyncError(f"{where}: its pieces do not cover it")
            start = 0
            for size in meta["pieces"]:  # received in place, piece by piece
                if size:
                    _bcast(group, payload[start : start + size])
                start += size
            tensors = {}
            for k, (name, dtype, shape) in enumerate(layout.tensors):
                pieces = [p for p in layout.pieces(payload, k) if p.numel()]
                raw = pieces[0] if len(pieces) == 1 else torch.cat(pieces) if pieces else payload[:0]
                kind = _dtype(dtype)
                if raw.storage_offset() % kind.itemsize:  # after a tensor of odd bytes: realigned
                    raw = raw.clone()
                tensors[name] = raw.view(kind).reshape(shape)
            version_, index_, count_ = int(meta["version"]), int(meta["index"]), int(meta["count"])
            yield Bucket(version_, index_, count_, tensors, meta["checksums"])
            count, index = int(meta["count"]), index + 1

    update = WeightUpdate(version, names, produce)
    if "adapter" not in header:
        return update
    got = {k: v.clone() for b in update.buckets() for k, v in b.tensors.items()}  # small: read now
    deltas = tuple(LoraDelta(m, got[f"{m}/a"], got[f"{m}/b"], float(c)) for m, c in header["adapter"])
    return WeightUpdate.of_adapter(AdapterUpdate(deltas), version)


# ---- from FSDP2 ranks ------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _rows(n: int, world: int, rank: int) -> int:
    """Rows of a dim-0 shard of `n` rows on `rank` of `world` (`torch.chunk`, FSDP2's split)."""
    c = -(-n // world) if n else 0
    return max(0, min(n, (rank + 1) * c) - rank * c)


def send_sharded(
    group: dist.ProcessGroupGloo | None,
    state: Mapping[str, torch.Tensor],
    names: Sequence[str],
    version: int,
    bucket_bytes: int,
    *,
    rank: int,
    world: int,
) -> int:
    """Every learner rank calls this with its `state` (DTensors sharded on dim 0, or replicated):
    bucket by bucket the ranks' shards are gathered into rank 0's payload (one `gather` on the
    default group), which rank 0 broadcasts on `group` (None on the other ranks). A broadcast
    that fails (a worker gone) does not end rank 0's part early: it goes on gathering every
    bucket with the others, so the ranks' next collectives still pair up, and raises after."""
    tensors = {n: state[n] for n in names}
    failed: BaseException | None = None

    def sharded(t: torch.Tensor) -> bool:
        return any(p.is_shard() for p in getattr(t, "placements", ()))

    sizes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
    plan = plan_buckets(sizes, bucket_bytes)
    if rank == 0:
        assert group is not None, "rank 0 broadcasts: it must have joined the weights group"
        try:
            _send_json(group, {"version": version, "names": list(names)})
        except Exception as exc:  # noqa: BLE001 - raised after the gathers below
            failed, group = exc, None
    sent, ranks = 0, range(world)
    for index, bucket in enumerate(plan):
        desc, parts = [], []
        for n in bucket:
            t = tensors[n]
            row = (t.numel() // t.shape[0] if t.dim() and t.shape[0] else 0) * t.element_size()
            desc.append((n, str(t.dtype), list(t.shape)))
            split = sharded(t)  # dim-0 chunks on every rank, else whole on rank 0 only
            parts.append([_rows(t.shape[0], world, r) * row if split else sizes[n] * (r == 0) for r in ranks])
        layout = _Layout(desc, [[p[r] for p in parts] for r in range(world)])
        mine = [_bytes(_local(tensors[n])) for n in bucket]
        mine = [m if layout.sizes[rank][k] else m[:0] for k, m in enumerate(mine)]
        if [m.numel() for m in mine] != layout.sizes[rank]:
            raise WeightSyncError(f"rank {rank}'s shards of bucket {index} are not FSDP2's dim-0 chunks")
        device = mine[0].device if mine else torch.device("cpu")
        local = torch.zeros(layout.stride, dtype=torch.uint8, device=device)
        if mine:
            torch.cat(mine, out=local[: sum(layout.sizes[rank])])
        payload = torch.empty(layout.stride * world, dtype=torch.uint8, device=device) if rank == 0 else None
        dist.gather(local, list(payload.view(world, -1)) if payload is not None else None, dst=0)
        del local
        if group is not None and payload is not None:
            payload = payload.cpu()
            at = (version, index, len(plan))
            try:
                sent += _send_bucket(group, layout, [payload], layout.crcs(payload), at)
            except Exception as exc:  # noqa: BLE001 - the others still gather: raised after
                failed, group = exc, None
    if failed is not None:
        raise failed
    return sent


# ---- the registry's transport -------------------------------------------------------------


def in_thread(fn: Callable[[], T]) -> Future[T]:
    """`fn()` on a thread of its own (a sender broadcasts while the receivers read): its result
    or its error in the future."""
    done: Future[T] = Future()

    def run() -> None:
        try:
            done.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            done.set_exception(exc)

    threading.Thread(target=run, name="steprl-weights-broadcast", daemon=True).start()
    return done


class Broadcast:
    """`WEIGHT_SYNC["broadcast"]` as a `Transport`: `send` broadcasts on the `sender` end in a
    thread (the receivers read at the same time, each from its own end), `receive` reads the
    next update on the `receiver` end, `release` waits for the send and raises its error."""

    def __init__(
        self, sender: dist.ProcessGroupGloo | None = None, receiver: dist.ProcessGroupGloo | None = None
    ) -> None:
        self.sender, self.receiver = sender, receiver

    @staticmethod
    def loopback(timeout_s: float = 60.0) -> Broadcast:
        """Both ends of a two-member group in this process (its checker: a real gloo group)."""
        host = GroupHost(timeout_s=timeout_s)
        address = host.address(2, timeout_s)
        ends: dict[int, dist.ProcessGroupGloo] = {}
        threads = [threading.Thread(target=lambda r=r: ends.setdefault(r, join(address, r))) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
        if len(ends) != 2:
            raise WeightSyncError(f"a loopback weights group did not form within {timeout_s:g} s")
        transport = Broadcast(ends[0], ends[1])
        transport._host = host  # type: ignore[attr-defined]  # the store lives as long as the group
        return transport

    def send(self, update: WeightUpdate) -> Future[int]:
        assert self.sender is not None, "this end receives only"
        sender = self.sender
        return in_thread(lambda: send(sender, update))

    def receive(self, handle: Any = None) -> WeightUpdate:
        assert self.receiver is not None, "this end sends only"
        return receive(self.receiver)

    def release(self, handle: Future[int]) -> None:
        handle.result()


__all__ = ["Broadcast", "GroupAddress", "GroupHost", "in_thread", "join", "receive", "send", "send_sharded"]
