"""A socket: each bucket a header message (version, index, count, and each tensor's name, dtype,
shape and checksum) followed by each tensor's raw bytes, sent straight from the tensor's memory
(`multiprocessing.connection`'s `send_bytes`: no pickle of the data, nothing written to disk).
For an engine in another process on the same host that holds a connection already: the vLLM
worker (`engines/vllm_worker.py` restates `decode` and checks the same checksums), which reads
one bucket at a time into vLLM's in-place reload.

`SocketStream` is the registry's form of it (the handle: the messages, for the checker and for a
caller that sends them later); `VLLMEngine` streams the buckets as the learner produces them,
one in memory at a time (`chain`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from steprl.engines.weights import Bucket, WeightSyncError, WeightUpdate, seal

#: a header, then one raw message per tensor, in the header's order
Message = dict[str, Any] | bytes | memoryview


@dataclass(frozen=True)
class SocketHandle:
    version: int
    names: tuple[str, ...]
    messages: tuple[Message, ...]


def encode(bucket: Bucket) -> Iterator[Message]:
    """The header, then each tensor's bytes: a view of its memory (no copy where it is contiguous
    on the CPU), to be sent before the tensor changes."""
    sealed = seal(bucket) if not bucket.checksums else bucket
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in sealed.tensors.items()}
    yield {
        "op": "bucket",
        "version": sealed.version,
        "index": sealed.index,
        "count": sealed.count,
        "tensors": [(k, str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in tensors.items()],
        "checksums": dict(sealed.checksums),
    }
    for v in tensors.values():
        yield v.reshape(-1).view(torch.uint8).numpy().data if v.numel() else b""


def decode(header: dict[str, Any], raw: Sequence[bytes | memoryview]) -> Bucket:
    """A bucket from its header and its tensors' bytes (checked by the `Receiver` that takes it)."""
    if header.get("op") != "bucket" or len(raw) != len(header["tensors"]):
        raise WeightSyncError(f"not a weight bucket: {str(header)[:80]} with {len(raw)} tensors")
    tensors = {}
    for (name, dtype, shape), data in zip(header["tensors"], raw, strict=True):
        with warnings.catch_warnings():  # read-only bytes: the tensor is only read (copied into a model)
            warnings.simplefilter("ignore", UserWarning)
            flat = (
                torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
            )
        tensors[name] = flat.view(getattr(torch, dtype)).reshape(shape)
    return Bucket(header["version"], header["index"], header["count"], tensors, header["checksums"])


def chain(update: WeightUpdate) -> Iterator[Message]:
    """`update`'s messages, each bucket encoded as it is produced (one in memory at a time)."""
    for bucket in update.buckets():
        yield from encode(bucket)


class SocketStream:
    """The messages in memory (a connection would carry them one by one)."""

    def send(self, update: WeightUpdate) -> SocketHandle:
        if update.adapter is not None:
            raise WeightSyncError("the socket stream carries full tensors: send an adapter as files")
        # the bytes copied: the handle outlives the tensors' values
        messages = tuple(m if isinstance(m, dict) else bytes(m) for m in chain(update))
        return SocketHandle(update.version, update.names, messages)

    def receive(self, handle: SocketHandle) -> WeightUpdate:
        def produce() -> Iterator[Bucket]:
            messages = iter(handle.messages)
            for header in messages:
                assert isinstance(header, dict)
                yield decode(header, [next(messages) for _ in header["tensors"]])  # type: ignore[misc]

        return WeightUpdate(handle.version, handle.names, produce)

    def release(self, handle: SocketHandle) -> None:
        """Nothing outside the handle was made."""


__all__ = ["SocketHandle", "SocketStream", "chain", "decode", "encode"]
