"""Delta weight sync (`runtime.weight_delta: true`): each sync sends, per tensor, the XOR of the
new version's bytes with the version the engines hold, compressed (zlib, level 1), instead of
the tensor.

Why XOR of bytes: an engine in bf16 holds the learner's fp32 weights rounded, and an RL update
at lr 1e-6 moves only about 5% of them across a bf16 rounding step; the XOR is zero elsewhere
and compresses to 7-8% of the bytes (`benchmarks/delta_sync.py`). An fp32 engine sees every
weight change (AdamW moves them all): its delta is about two thirds of the bytes, so the delta
pays for bf16 (or fp16) engines across a slow link, not for fp32 ones.

The sender (`DeltaEncoder`) keeps what the engines hold: the last version sent, in each
tensor's engine dtype (`shadow`: the model once more, at the engine's precision). The first
sync, or one after the names change, is the full shadow. A receiver rebuilds each tensor from
its own copy (`applied`) and the rebuilt tensor is checked against the sender's CRC-32 of the
new version (`Receiver`): an engine that did not hold the base version, or a blob changed in
flight, is refused by name, never a model of mixed versions. An engine checks the base version
before it starts (`HFEngine.update_weights`).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

import torch

from steprl.engines.weights import Bucket, WeightSyncError, WeightUpdate, checksum


@dataclass(frozen=True)
class DeltaMeta:
    """What a receiver needs to rebuild one tensor: the new version's dtype, shape and CRC-32."""

    crc: int
    dtype: str
    shape: tuple[int, ...]


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _packed(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


class DeltaEncoder:
    """The sender's side: `encode` turns each full update into a delta against the previous
    one, in the engines' dtypes (`dtypes`: each tensor's dtype in the engine's model)."""

    def __init__(self, dtypes: Mapping[str, torch.dtype], level: int = 1) -> None:
        self.dtypes, self.level = dict(dtypes), level
        self.shadow: dict[str, torch.Tensor] | None = None
        self.version: int | None = None
        self._pending: tuple[dict[str, torch.Tensor], int] | None = None  # encoded, not yet held

    def encode(self, update: WeightUpdate) -> WeightUpdate:
        """`update` (full tensors) as the engines will hold it: a delta from the last version
        encoded, or the full tensors in the engines' dtypes (the first time, or when the names
        changed). Encoded now, bucket by bucket; `commit` once every engine has it. While one
        is encoded the old and the new version are both held: twice the model at the engines'
        precision, and the compressed buckets."""
        if update.adapter is not None:
            raise WeightSyncError("runtime.weight_delta sends full weights; LoRA sends its adapters alone")
        base = self.shadow if self.shadow is not None and set(self.shadow) == set(update.names) else None
        shadow: dict[str, torch.Tensor] = {}
        buckets = []
        for bucket in update.buckets():
            new = {n: self._as_engine(n, t) for n, t in bucket.tensors.items()}
            shadow |= new
            if base is None:
                buckets.append(Bucket(bucket.version, bucket.index, bucket.count, new))
                continue
            blobs, meta = {}, {}
            for name, t in new.items():
                xor = torch.bitwise_xor(_flat_bytes(t), _flat_bytes(base[name]))
                blobs[name] = _packed(zlib.compress(xor.numpy().data, self.level))
                meta[name] = DeltaMeta(checksum(t), str(t.dtype).removeprefix("torch."), tuple(t.shape))
            buckets.append(Bucket(bucket.version, bucket.index, bucket.count, blobs, delta=meta))
        delta_from = self.version if base is not None else None
        self._pending = (shadow, update.version)
        nbytes = sum(b.nbytes() for b in buckets)
        return WeightUpdate(
            update.version, update.names, lambda: iter(buckets), nbytes=nbytes, delta_from=delta_from
        )

    def _as_engine(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """`t` as the engines hold it: a copy on the CPU in the engine's dtype (rounded as
        `copy_` rounds it into the engine's tensor)."""
        return t.detach().to("cpu", self.dtypes.get(name, t.dtype), copy=True)

    def commit(self) -> None:
        """The last update encoded reached every engine: later deltas are against it (until
        then a sync that failed leaves the engines, and the encoder, on the version before)."""
        if self._pending is not None:
            self.shadow, self.version = self._pending
            self._pending = None

    def full(self) -> WeightUpdate:
        """The newest version encoded, whole (a worker started later, or during the sync that
        sends it, begins from it)."""
        shadow, version = self._pending or (self.shadow, self.version)
        assert shadow is not None and version is not None, "nothing encoded yet"
        return WeightUpdate.of_tensors(shadow, version, tied=False)


def applied(update: WeightUpdate, own: Mapping[str, torch.Tensor]) -> WeightUpdate:
    """A delta `update` rebuilt against `own` (the receiver's tensors, holding the base
    version): full buckets, each tensor sealed with the sender's CRC of the new version."""
    if update.delta_from is None:
        return update

    def produce() -> Iterator[Bucket]:
        for bucket in update.produce():
            if bucket.delta is None:
                where = f"bucket {bucket.index} of the delta to version {update.version}"
                raise WeightSyncError(f"{where} is not a delta")
            tensors, crcs = {}, {}
            for name, blob in bucket.tensors.items():
                meta, mine = bucket.delta[name], own[name]
                what = f"the delta of {name} to version {update.version}"
                try:
                    xor = _packed(zlib.decompress(blob.numpy().data))
                except zlib.error as exc:
                    raise WeightSyncError(f"{what} is corrupt: {exc}") from None
                size = mine.numel() * mine.element_size()
                if xor.numel() != size:
                    raise WeightSyncError(
                        f"{what} is {xor.numel()} bytes; this engine's tensor is {size} "
                        f"({mine.dtype}, {tuple(mine.shape)})"
                    )
                new = torch.bitwise_xor(_flat_bytes(mine.detach().cpu()), xor)
                tensors[name] = new.view(getattr(torch, meta.dtype)).reshape(meta.shape)
                crcs[name] = meta.crc
            yield replace(bucket, tensors=tensors, checksums=crcs, delta=None)

    return replace(update, produce=produce, delta_from=None)


__all__ = ["DeltaEncoder", "DeltaMeta", "applied"]
