"""`TrainState`: everything a run carries from one RL step to the next besides the weights and
optimizers, so that a checkpoint plus this record continues a run exactly (CKPT-02).

Sampling needs no state here: every episode's seed is keyed by its task's position in the
stream (`rollout/seeds.py`), and the task source keeps its own position (a run component,
`training/sources/`, checkpointed by name beside this record). What remains
are the generators that are consumed as the run goes: mini-batch shuffling, and the global
torch / Python / NumPy generators (for anything else that draws from them).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from steprl.types import Task


@dataclass(frozen=True)
class RngState:
    """The generators a step consumes, captured between steps."""

    shuffle: torch.Tensor  # mini-batch order (learner and critic)
    torch_global: torch.Tensor
    python: tuple[Any, ...]
    numpy: dict[str, Any]
    #: each GPU's generator (dropout on a GPU draws from it); () without CUDA, and in checkpoints
    #: written before it was kept
    cuda: tuple[torch.Tensor, ...] = ()

    @staticmethod
    def capture(shuffle: torch.Generator) -> RngState:
        return RngState(
            shuffle.get_state(),
            torch.get_rng_state(),
            random.getstate(),
            np.random.get_state(legacy=False),
            # only where this process uses CUDA: asking starts it on every visible GPU
            tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else (),
        )

    def restore(self, shuffle: torch.Generator) -> None:
        shuffle.set_state(self.shuffle)
        torch.set_rng_state(self.torch_global)
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        if self.cuda and torch.cuda.is_available():  # a machine with fewer GPUs: the ones it has
            torch.cuda.set_rng_state_all(list(self.cuda)[: torch.cuda.device_count()])


@dataclass(frozen=True)
class TrainState:
    """Where the run is, after `step` RL steps (0 = before the first)."""

    step: int
    policy_version: int
    rng: RngState
    env_ids: dict[str, int] = field(default_factory=dict)  # env name -> index (per-env estimators)
    #: asynchronous training: tasks admitted but not trained yet (in flight or queued), by
    #: stream position; a resumed run gives them back to the task source, which re-issues them
    #: first (training/loop/pipeline.py); an evicted task is already back in the source
    pending: tuple[tuple[int, Task], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "policy_version": self.policy_version,
            "rng": {
                "shuffle": self.rng.shuffle,
                "torch_global": self.rng.torch_global,
                "python": self.rng.python,
                "numpy": self.rng.numpy,
                "cuda": list(self.rng.cuda),
            },
            "env_ids": dict(self.env_ids),
            "pending": [(i, task_dict(t)) for i, t in self.pending],
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> TrainState:
        r = d["rng"]
        return TrainState(
            step=int(d["step"]),
            policy_version=int(d["policy_version"]),
            rng=RngState(
                r["shuffle"], r["torch_global"], tuple(r["python"]), r["numpy"], tuple(r.get("cuda", ()))
            ),
            env_ids=dict(d["env_ids"]),
            pending=tuple((int(i), task_from_dict(t)) for i, t in d.get("pending", [])),
        )


def task_dict(t: Task) -> dict[str, Any]:
    """A task as plain data (its params are a read-only mapping, which pickle cannot write)."""
    return {
        "id": t.id,
        "prompt": t.prompt,
        "env": t.env,
        "seed": t.seed,
        "answer": t.answer,
        "params": dict(t.params),
    }


def task_from_dict(d: dict[str, Any]) -> Task:
    """The task `task_dict` wrote."""
    return Task(**{**d, "params": MappingProxyType(d["params"])})
