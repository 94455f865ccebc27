"""The trainer's side of the health rules (`training/controllers/health.py` decides, this
carries out): the levers applied to the learner and the batch every step, the mutual-information
probe every `health.mi_every` steps, the in-memory ring of recent weights a rollback restores,
alert lines, and the `health.jsonl` log of every firing."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from steprl.config import Config
from steprl.diagnostics.sinks import no_link, open_output
from steprl.health.actions import Levers
from steprl.training.build import Parts
from steprl.training.controllers import Adjustments
from steprl.training.health_snapshots import SnapshotRing
from steprl.training.learner_protocol import Learner, LearnerLevers
from steprl.training.pipeline import Pipeline
from steprl.types import Trajectory

HEALTH_LOG = "health.jsonl"  # <run_dir>/health.jsonl: one record per firing


def apply_levers(cfg: Config, learner: Learner, settings: Adjustments) -> Adjustments:
    """Set the learning rate, the entropy bonus and the KL coefficient the health levers ask
    for (every step: a resume or a rollback sees the same values); returns `settings` with the
    reward-KL coefficient scaled when the KL is in the reward."""
    levers = settings.levers or Levers()
    algo = cfg.algorithm
    learner.apply(
        LearnerLevers(
            lr=cfg.trainer.lr * levers.lr_scale,
            entropy_coef=algo.entropy_coef if levers.entropy_coef is None else levers.entropy_coef,
            kl_coef=algo.kl_coef * levers.kl_scale if algo.kl_in == "loss" else 0.0,
        )
    )
    if algo.kl_in == "reward" and levers.kl_scale != 1.0:
        base = algo.kl_coef if settings.kl_coef is None else settings.kl_coef
        return dataclasses.replace(settings, kl_coef=base * levers.kl_scale)
    return settings


def group_filter(base: Callable[..., torch.Tensor], settings: Adjustments) -> Callable[..., torch.Tensor]:
    """The configured group filter, then (the `filter` action) only groups whose reward std
    (population) is at least `levers.min_group_std`."""
    least = settings.levers.min_group_std if settings.levers is not None else None
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
    from steprl.training.mi_probe import mi_probe  # noqa: PLC0415

    return mi_probe(learner, trajectories, prompts=h.mi_prompts, samples=h.mi_samples)


def carry_out(
    parts: Parts,
    settings: Adjustments,
    step: int,
    version: int,
    pipeline: Pipeline,
    log: Callable[[str], None],
) -> tuple[int, list[dict[str, Any]]]:
    """What the firings at `step` do once: alert lines and a rollback (its weights published as
    a new policy version through the pipeline's `roll_back`: rollouts of the undone versions are
    evicted and run again, at any `rollout.max_staleness`; with `replay`, the undone steps' tasks
    are served again first). Returns the policy version and the firings' records, their outcomes
    completed."""
    events = [dict(e) for e in settings.events]
    once = settings.once
    ring = parts.components.get("health:snapshots")
    if once is not None and once.rollback and isinstance(ring, SnapshotRing):
        restored = ring.restore(once.rollback, step)
        if restored is not None:
            version += 1
            pipeline.roll_back(parts.learner.weights(version), version)
            if once.replay:  # this step's tasks (not in the ring yet), then the undone ones kept
                pipeline.replay([*ring.trained_after(restored), *pipeline.step_tasks])
        for e in events:
            if "rollback" in e["actions"] and e["acted"]:
                e["outcome"] += (
                    f" (restored the weights of step {restored})" if restored is not None else " (none kept)"
                )
    for e in events:  # every firing is one line, observed ones too
        shown = ", ".join(f"{k}={v:.3g}" for k, v in e["signals"].items() if v is not None)
        log(f"ALERT step {step}: health rule {e['rule']} fired ({shown}): {e['outcome']}")
    return version, events


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
    "apply_levers",
    "carry_out",
    "group_filter",
    "probe",
    "repair_log",
    "write_log",
]
