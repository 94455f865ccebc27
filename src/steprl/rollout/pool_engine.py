"""`PoolEngine`: the engine of a run whose trainer holds none (`runtime.placement: separate`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from steprl.engines.base import Generation, SamplingParams
from steprl.engines.weights import AnyUpdate

if TYPE_CHECKING:  # Ray, only where a pool exists
    from steprl.rollout.ray_workers import RayRolloutPool


class PoolEngine:
    """The `ServingEngine` a run with `runtime.placement: separate` holds: no weights, only the
    pool. Each request goes to a rollout worker's engine (evaluation, the weight-sync probe), so
    the trainer process holds no engine copy; weights reach the workers through the pool's sync
    (`RayProducer.publish`), so `update_weights` here only follows the version."""

    snapshots = None  # cross-policy snapshots live in the workers' engines (refused with separate)
    max_positions: int | None = None

    def __init__(self, pool: RayRolloutPool) -> None:
        self.pool = pool

    @property
    def version(self) -> int:
        return self.pool.version

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, *, seed: int | None = None
    ) -> Generation:
        gen: Generation = await self.pool.generate(prompt_ids, sampling, seed)
        return gen

    def update_weights(self, state_dict: AnyUpdate, version: int) -> None:
        """Nothing to load here: the pool's workers get the weights (`RayRolloutPool.sync_weights`)."""

    def reset_scheduler(self) -> None:
        """The requests live in the workers; an abandoned one finishes there unread."""

    def close(self) -> None:
        """The pool is closed by its owner."""


__all__ = ["PoolEngine"]
