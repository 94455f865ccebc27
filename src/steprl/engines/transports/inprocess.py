"""In-process: the engine shares the learner's process, so the update is handed over as it is
and the engine copies each bucket straight from the learner's tensors (no copy in between)."""

from __future__ import annotations

from steprl.engines.weights import WeightUpdate


class InProcess:
    """The handle is the update itself."""

    def send(self, update: WeightUpdate) -> WeightUpdate:
        return update

    def receive(self, handle: WeightUpdate) -> WeightUpdate:
        return handle

    def release(self, handle: WeightUpdate) -> None:
        """Nothing was made."""


__all__ = ["InProcess"]
