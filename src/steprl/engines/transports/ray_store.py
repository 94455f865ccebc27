"""Ray's object store: each bucket `ray.put` once (on CPU), the handle a list of references
that Ray rollout workers read in order, one bucket in memory at a time, each sealed with its
tensors' checksums (checked by every reader). Nothing is pickled
twice: a worker rebuilt later reads the same objects (`RayRolloutPool` keeps the handles its
replay needs, and releases them when they leave it)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from steprl.engines.weights import WeightUpdate, seal


@dataclass(frozen=True)
class RayHandle:
    version: int
    names: tuple[str, ...]
    buckets: tuple[Any, ...]  # ray.ObjectRef of each Bucket, in order
    adapter: Any = None  # ray.ObjectRef of an AdapterUpdate (LoRA)
    delta_from: int | None = None  # the buckets are a delta against this version (engines/delta.py)


class RayObjectStore:
    """Needs a running Ray (`ray.init`) in the sender and the receivers."""

    def send(self, update: WeightUpdate) -> RayHandle:
        import ray

        if update.adapter is not None:
            return RayHandle(update.version, (), (), ray.put(update.adapter.to("cpu")))
        refs = tuple(
            ray.put(seal(replace(b, tensors={k: v.detach().cpu() for k, v in b.tensors.items()})))
            for b in update.buckets()
        )
        return RayHandle(update.version, update.names, refs, delta_from=update.delta_from)

    def receive(self, handle: RayHandle) -> WeightUpdate:
        import ray

        if handle.adapter is not None:
            return WeightUpdate.of_adapter(ray.get(handle.adapter), handle.version)
        buckets = handle.buckets
        return WeightUpdate(
            handle.version, handle.names, lambda: (ray.get(r) for r in buckets), delta_from=handle.delta_from
        )

    def release(self, handle: RayHandle) -> None:
        """The objects go when no reference is left (Ray's reference counting): drop ours."""


__all__ = ["RayHandle", "RayObjectStore"]
