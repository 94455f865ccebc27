"""The Gemma-3-270M conversion the tests share: made once per checkout in `.cache/steprl`, under
a file lock, so two test processes (pytest-xdist) never convert it twice, never read it half
made, and no test depends on another having run first."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

from steprl.models.sources import gemma_dir

CACHE = Path(__file__).resolve().parents[1] / ".cache" / "steprl"


@contextlib.contextmanager
def gemma_lock() -> Iterator[None]:
    """Held while the conversion may be made (or measured being made)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".gemma-3-270m.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def converted_gemma() -> Path:
    """The converted directory, made first if it is not there (about a minute, once)."""
    with gemma_lock():
        return gemma_dir(CACHE, lambda _line: None)
