"""Ray's processes go with a SIGKILLed trainer (issue 23, item 18): within seconds, not the 60 s
that Ray's dashboard and runtime-env agents took on their own (`hosting/ray_reaper.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from steprl.hosting import ray_reaper

TRAINER = """
import time
from steprl.hosting.ray_backend import ensure_ray
ensure_ray(num_cpus=1)
print("READY", flush=True)
time.sleep(300)
"""


def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reaper reads /proc")
def test_the_agents_of_a_sigkilled_trainers_ray_go_within_seconds() -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local Ray of its own
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    agents: dict[int, int] = {}
    try:
        assert trainer.stdout is not None and b"READY" in trainer.stdout.readline()
        assert _wait(lambda: len(ray_reaper.note(trainer.pid)) >= 2, 30.0)  # dashboard + runtime-env agents
        time.sleep(ray_reaper.NOTE_S + 2 * ray_reaper.POLL_S)  # the watcher has noted them too
        agents = ray_reaper.note(trainer.pid)
        trainer.kill()
        trainer.wait()
        killed_at = time.monotonic()
        assert _wait(lambda: not ray_reaper.still_alive(agents), 5.0), ray_reaper.still_alive(agents)
        gone_s = time.monotonic() - killed_at
        print(f"the raylet's {len(agents)} children were gone {gone_s:.1f}s after the kill")
    finally:
        if trainer.poll() is None:
            trainer.kill()
        ray_reaper.reap(agents)  # never leave them behind, even when the assertion failed
