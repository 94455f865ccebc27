"""The trainer's side of the health rules (`training/controllers/health.py` decides, this
carries out, for `training/loop/levers.py`): the group filter's narrowing, the mutual-information
probe every `health.mi_every` steps, the in-memory ring of recent weights a rollback restores,
alert lines, and the `health.jsonl` log of every firing."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from steprl.config import Config
from steprl.diagnostics.sinks import no_link, open_output
from steprl.training.controllers import Rollback
from steprl.training.learn.health_snapshots import SnapshotRing
from steprl.training.learn.learner_protocol import Learner
from steprl.training.loop.pipeline import Pipeline
from steprl.training.setup.build import Parts
from steprl.types import Trajectory

HEALTH_LOG = "health.jsonl"  # <run_dir>/health.jsonl: one record per firing


def group_filter(base: Callable[..., torch.Tensor], least: float | None) -> Callable[..., torch.Tensor]:
    """The configured group filter, then (the `min_group_std` lever) only groups whose reward std
    (population) is at least `least`."""
    if not least:
        return base

    def keep(rewards: Any) -> torch.Tensor:
        kept = base(rewards).tolist()
        return torch.tensor(
            [i for i in kept if float(torch.as_tensor(rewards[i]).double().std(correction=0)) >= least],
            dtype=torch.int64,
        )

    return keep


def probe(cfg: Config, learner: Learner, step: int, trajectories: list[Trajectory]) -> dict[str, float]:
    """RAGEN-2's mutual-information probe on the step's rollouts, every `health.mi_every` steps."""
    h = cfg.health
    if not (h.enabled and h.mi_every and step % h.mi_every == 0):
        return {}
    from steprl.training.loop.mi_probe import mi_probe  # noqa: PLC0415

    return mi_probe(learner, trajectories, prompts=h.mi_prompts, samples=h.mi_samples)


def roll_back(
    parts: Parts, rollback: Rollback, step: int, version: int, pipeline: Pipeline
) -> tuple[int, str]:
    """Restore the ring's weights of `rollback.steps` back and publish them as a new policy
    version through the pipeline's `roll_back` (rollouts of the undone versions are evicted and
    run again, at any `rollout.max_staleness`; with `replay`, the undone steps' tasks are served
    again first). Returns the policy version and what the firing's outcome adds."""
    ring = parts.components.get("health:snapshots")
    if not isinstance(ring, SnapshotRing):
        return version, ""  # no ring kept (health.snapshots: 0): nothing to restore
    restored = ring.restore(rollback.steps, step)
    if restored is None:
        return version, " (none kept)"
    version += 1
    pipeline.roll_back(parts.learner.weights(version), version)
    if rollback.replay:  # this step's tasks (not in the ring yet), then the undone ones kept
        pipeline.replay([*ring.trained_after(restored), *pipeline.step_tasks])
    return version, f" (restored the weights of step {restored})"


def alert(
    events: Sequence[Mapping[str, Any]], step: int, rolled_back: str, log: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Every firing is one ALERT line, observed ones too; returns the records, a rollback's
    outcome completed with `rolled_back`."""
    out = [dict(e) for e in events]
    for e in out:
        if "rollback" in e["actions"] and e["acted"] and rolled_back:
            e["outcome"] += rolled_back
        shown = ", ".join(f"{k}={v:.3g}" for k, v in e["signals"].items() if v is not None)
        log(f"ALERT step {step}: health rule {e['rule']} fired ({shown}): {e['outcome']}")
    return out


def write_log(run_dir: Path, events: list[dict[str, Any]]) -> None:
    """Append the firings to health.jsonl (before the step's metrics row, like its episodes)."""
    if not events:
        return
    with open_output(run_dir / HEALTH_LOG, "a") as f:
        for e in events:
            f.write(json.dumps(e, allow_nan=False, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def repair_log(run_dir: Path, step: int) -> None:
    """On resume: drop the firings of steps after the checkpoint (a resume runs them again) and
    any damaged line."""
    path = no_link(run_dir / HEALTH_LOG)
    if not path.exists():
        return
    kept = []
    for line in path.read_bytes().decode("utf-8", "replace").splitlines():
        try:
            if int(json.loads(line)["step"]) <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    with open_output(path, "w") as f:
        f.write("".join(k + "\n" for k in kept))


__all__ = [
    "HEALTH_LOG",
    "alert",
    "group_filter",
    "probe",
    "repair_log",
    "roll_back",
    "write_log",
]
