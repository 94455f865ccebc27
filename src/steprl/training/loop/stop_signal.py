"""SIGINT / SIGTERM during a run: finish the current step, or stop at once inside a wait that
only an env or the engine can end (`_StopOnSignal.interruptible`)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType


class StopRequested(KeyboardInterrupt):
    """A signal arrived in an interruptible wait (`StopOnSignal.interruptible`). A
    KeyboardInterrupt, so that no `except Exception` (an episode's, asyncio's) swallows it."""


class StopOnSignal:
    """SIGINT / SIGTERM: finish the current step, then stop (checkpoint, close, exit non-zero).
    A second signal stops at once, as the default handlers do.

    Inside `interruptible()` (a wait on rollouts, demonstrations or an evaluation: only an env
    or the engine can end it, and nothing is half-written) the signal raises `StopRequested`
    at once instead, so a run whose envs are slow or hung stops promptly; the trainer then
    checkpoints the last finished step (the dropped rollouts' tasks are in it)."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self._previous: dict[int, object] = {}
        self._waiting = 0

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        if self.signal is not None:  # it came while we were busy: stop before waiting again
            raise StopRequested(self.signal)
        self._waiting += 1
        try:
            yield
        finally:
            self._waiting -= 1

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is not None:  # the second one: no more waiting
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
        self.signal = signal.Signals(signum).name
        if self._waiting:
            print(f"\n{self.signal}: stopping (again to stop at once)", flush=True)
            raise StopRequested(self.signal)
        print(
            f"\n{self.signal}: finishing the current step, then saving a checkpoint (again to stop now)",
            flush=True,
        )

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)  # type: ignore[arg-type]


__all__ = ["StopOnSignal", "StopRequested"]
