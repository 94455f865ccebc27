"""A policy version on its way from the learner to the engines: `WeightUpdate`.

Full weights travel as named buckets of bounded size (`BUCKET_BYTES`), produced as they are
consumed: the learner hands out views of its own tensors, and an engine in the same process
copies each bucket into its model in place, so no second full copy of the weights exists
beyond the engine's own (the dict of clones this replaces was one per version). A LoRA update
is the adapters, whole (they are small). Every receiver checks the stream: buckets of one
version, each index once and in order, every name exactly once; a bucket lost, repeated or
reordered is a `WeightSyncError` naming it, never a model with some tensors of the old version.
A transport that copies the bytes (the object store, files) seals each bucket with a CRC-32 per
tensor (`seal`), and the receiver checks each tensor against it: a bucket changed in flight is
refused by name. How buckets cross a process boundary (Ray's object store, files) is a transport:
`training/weight_sync.py: WEIGHT_SYNC`.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from steprl.engines import lora_merge
from steprl.engines.lora_merge import AdapterUpdate, LoraMerger
from steprl.errors import UserError

#: the most tensor bytes in one bucket (a tensor larger than this travels alone): big enough
#: that a bucket's fixed cost is small, small enough that a transport never holds a model
BUCKET_BYTES = 256 * 2**20


class WeightSyncError(UserError, RuntimeError):
    """A weight update arrived incomplete, out of order or changed, or not in time: the engine
    must not serve it, and the run stops in one line wherever the sync was (a step, a resume's
    first push, a rollback)."""


@dataclass(frozen=True)
class Bucket:
    """Bucket `index` of `count` of policy `version`: full tensors by name (on any device);
    `checksums`: each tensor's CRC-32 as the sender had it (`seal`), or none (in-process)."""

    version: int
    index: int
    count: int
    tensors: Mapping[str, torch.Tensor]
    checksums: Mapping[str, int] = field(default_factory=dict)
    #: a delta bucket (`engines/delta.py`): each tensor is a compressed XOR against the base
    #: version, rebuilt by the receiver with this (`DeltaMeta` by name), then checked
    delta: Mapping[str, Any] | None = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(frozen=True)
class WeightUpdate:
    """Policy `version`: full tensors (`names`, in buckets from `produce`) or a LoRA `adapter`;
    `nbytes`: the tensor bytes an engine receives (0 where the maker did not say)."""

    version: int
    names: tuple[str, ...] = ()
    produce: Callable[[], Iterable[Bucket]] = field(default=lambda: (), repr=False)
    adapter: AdapterUpdate | None = None
    nbytes: int = 0
    #: the named tensors the buckets are cut from (`of_tensors`), so `rebucketed` can cut again
    source: Mapping[str, torch.Tensor] | None = field(default=None, repr=False)
    #: where the buckets are made when not here: the learner's ranks, as a weights group's
    #: sender (`rollout/weight_group.py: Sender`; its `gather` is what `produce` yields here)
    remote: Any = field(default=None, repr=False)
    bucket_bytes: int = BUCKET_BYTES  # the buckets' size, for a `remote` sender
    #: a delta against this version (`engines/delta.py`): the receiver must hold it exactly
    delta_from: int | None = None

    @staticmethod
    def of_tensors(
        named: Mapping[str, torch.Tensor],
        version: int,
        bucket_bytes: int = BUCKET_BYTES,
        *,
        tied: bool = True,
    ) -> WeightUpdate:
        """Buckets over `named` as they are when consumed (views: nothing is copied here). A tensor
        that is another's storage (tied embeddings: Gemma's head is its 640 MB embedding) travels
        once: the receiver's model ties them the same way (`load_in_place` checks). `tied=False`
        sends every name (vLLM keeps its own repacked copy of a tied head)."""
        named = untied(named) if tied else named
        sizes = {k: v.numel() * v.element_size() for k, v in named.items()}
        plan = plan_buckets(sizes, bucket_bytes)

        def produce() -> Iterator[Bucket]:
            for i, names in enumerate(plan):
                yield Bucket(version, i, len(plan), {n: named[n].detach() for n in names})

        return WeightUpdate(version, tuple(named), produce, nbytes=sum(sizes.values()), source=named)

    def rebucketed(self, bucket_bytes: int) -> WeightUpdate:
        """The same tensors in buckets of at most `bucket_bytes` (`runtime.weight_bucket_mib`);
        an adapter, or an update not made by `of_tensors`, as it is."""
        if self.remote is not None:  # gathered here (if asked) in buckets of that size too
            remote, version = self.remote, self.version
            produce = lambda: remote.gather(version, bucket_bytes)  # noqa: E731
            return replace(self, bucket_bytes=bucket_bytes, produce=produce)
        if self.source is None or self.adapter is not None:
            return self
        return WeightUpdate.of_tensors(self.source, self.version, bucket_bytes, tied=False)

    @staticmethod
    def of_adapter(adapter: AdapterUpdate, version: int) -> WeightUpdate:
        return WeightUpdate(version, adapter=adapter, nbytes=adapter.nbytes())

    def buckets(self) -> Iterator[Bucket]:
        """The buckets, checked in order as they come (`Receiver`)."""
        receiver = Receiver(self.version, self.names)
        for bucket in self.produce():
            receiver.take(bucket)
            yield bucket
        receiver.finish()

    def full(self) -> dict[str, torch.Tensor]:
        """Every tensor, copied (a test's or a file writer's view; engines load bucket by bucket)."""
        return {k: v.detach().clone() for b in self.buckets() for k, v in b.tensors.items()}


def checksum(tensor: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes as laid out contiguously (about 1.8 GB/s here: less than a copy)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return zlib.crc32(flat.view(torch.uint8).numpy().data) if flat.numel() else 0


def seal(bucket: Bucket) -> Bucket:
    """`bucket` with each tensor's checksum, for a transport that copies the bytes."""
    return replace(bucket, checksums={k: checksum(v) for k, v in bucket.tensors.items()})


def plan_buckets(sizes: Mapping[str, int], bucket_bytes: int) -> list[tuple[str, ...]]:
    """Names in order, cut into runs of at most `bucket_bytes` (a larger tensor alone)."""
    plan: list[tuple[str, ...]] = []
    run: list[str] = []
    used = 0
    for name, size in sizes.items():
        if run and used + size > bucket_bytes:
            plan.append(tuple(run))
            run, used = [], 0
        run.append(name)
        used += size
    if run:
        plan.append(tuple(run))
    return plan


class Receiver:
    """Checks one version's bucket stream: raises `WeightSyncError` at the first wrong bucket."""

    def __init__(self, version: int, names: tuple[str, ...]) -> None:
        self.version, self.expected = version, set(names)
        self.seen: set[str] = set()
        self.next_index: int = 0
        self.count: int | None = None

    def take(self, bucket: Bucket) -> None:
        where = f"bucket {bucket.index} of {bucket.count} of version {bucket.version}"
        if bucket.version != self.version:
            raise WeightSyncError(f"{where} arrived in the update to version {self.version}")
        if bucket.index != self.next_index or (self.count is not None and bucket.count != self.count):
            raise WeightSyncError(
                f"{where} arrived where bucket {self.next_index} was due: a bucket was lost or reordered"
            )
        names = set(bucket.tensors)
        if names & self.seen or names - self.expected:
            raise WeightSyncError(
                f"{where} repeats or adds tensors: {sorted(names & self.seen or names - self.expected)[:3]}"
            )
        for name, expected in bucket.checksums.items():
            if checksum(bucket.tensors[name]) != expected:
                raise WeightSyncError(
                    f"{where}: {name} changed in flight (its checksum differs from the sender's)"
                )
        self.seen |= names
        self.next_index, self.count = self.next_index + 1, bucket.count

    def finish(self) -> None:
        missing = self.expected - self.seen
        if missing or (self.count is not None and self.next_index != self.count):
            raise WeightSyncError(
                f"the update to version {self.version} ended after {self.next_index} of "
                f"{self.count} buckets, {len(missing)} tensors missing (e.g. {sorted(missing)[:2]})"
            )


def load_in_place(model: torch.nn.Module, update: WeightUpdate) -> None:
    """Copy a full update into `model`'s tensors, bucket by bucket (shapes must match)."""
    own = model.state_dict()  # tensors sharing the model's storage
    unknown = set(update.names) - set(own)
    if unknown:
        raise WeightSyncError(
            f"the update to version {update.version} names tensors this model lacks: {sorted(unknown)[:3]}"
        )
    absent = set(own) - set(update.names) - set(untied(own))  # tied here to a tensor it names
    not_tied = [n for n in set(own) - set(update.names) if n not in absent]
    if not_tied:  # a tensor the sender left out as tied, which this model keeps apart
        raise WeightSyncError(
            f"the update to version {update.version} leaves out {sorted(not_tied)[:3]}, which this model "
            "does not tie to a tensor it sends"
        )
    with torch.no_grad():
        for bucket in update.buckets():
            for name, tensor in bucket.tensors.items():
                own[name].copy_(tensor)


def untied(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`named` without a tensor that views the same memory as an earlier one (a tied weight)."""
    seen: set[tuple[int, tuple[int, ...], torch.dtype]] = set()
    out = {}
    for name, t in named.items():
        key = (t.data_ptr(), tuple(t.shape), t.dtype)
        if t.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


#: what an engine's `update_weights` takes
AnyUpdate = WeightUpdate | Mapping[str, torch.Tensor] | AdapterUpdate


def as_update(update: AnyUpdate, version: int) -> WeightUpdate:
    """Any accepted form as a `WeightUpdate` of `version` (a state dict's tensors as views)."""
    if isinstance(update, WeightUpdate):
        return update
    if isinstance(update, AdapterUpdate):
        return WeightUpdate.of_adapter(update, version)
    return WeightUpdate.of_tensors(update, version)


def load_update(model: torch.nn.Module, update: AnyUpdate, merger: LoraMerger | None) -> LoraMerger | None:
    """New weights into an engine's plain `model`: full tensors copied in place (no merger after
    them: later adapters merge into these), a LoRA adapter merged from W0 by `merger` (made at
    the first one). Returns the merger the engine keeps. (A plain state dict is still taken:
    a test's, or a caller's that built one.)"""
    if isinstance(update, WeightUpdate):
        if update.adapter is not None:
            return lora_merge.load_update(model, update.adapter, merger)
        load_in_place(model, update)
        return None
    return lora_merge.load_update(model, update, merger)


__all__ = [
    "BUCKET_BYTES",
    "AnyUpdate",
    "Bucket",
    "Receiver",
    "WeightSyncError",
    "WeightUpdate",
    "as_update",
    "checksum",
    "load_in_place",
    "load_update",
    "plan_buckets",
    "seal",
    "untied",
]
