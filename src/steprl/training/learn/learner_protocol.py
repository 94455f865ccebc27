"""The learner's protocol: the only way the rest of steprl reaches the policy it trains, its
reference, its value head and its optimizer.

Everything the trainer, the batch maker, health (levers, the snapshot ring, the MI probe), the
cross-policy ratios and the checkpoint need from the learner is a method here, with plain
inputs and outputs (token rows in, per-row tensors and float stats out), so that a group of
processes (FSDP ranks behind one controller, as verl's worker group) can implement it: nothing
outside the implementation holds an `nn.Module` or an optimizer of the learner's.
`training/learn/learner.py`'s `LocalLearner` (one process, one device) is the first implementation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from steprl.engines.weights import WeightUpdate
from steprl.rollout.views import Sample


@dataclass(frozen=True)
class Computed:
    """One pass of the learner over rows, without gradient: per row, (len-1,) target-aligned
    tensors, 0 off the row's loss mask (all that the KL, proximal, EMPG and ratio terms read).
    A field is None when it was not asked for."""

    logprobs: tuple[torch.Tensor, ...] | None = None  # under the current policy
    ref_logprobs: tuple[torch.Tensor, ...] | None = None  # under the frozen KL reference
    entropies: tuple[torch.Tensor, ...] | None = None  # token entropies under the current policy
    values: tuple[torch.Tensor, ...] | None = None  # the shared value head's V of each prefix


@dataclass(frozen=True)
class LearnerLevers:
    """What a lever may set on the learner for the next update (absolute values, applied every
    step so a resume or a rollback sees the same); None leaves a value as it is."""

    lr: float | None = None
    entropy_coef: float | None = None  # loss -= entropy_coef * agg(entropy)
    kl_coef: float | None = None  # loss += kl_coef * agg(kl to the reference); 0 when the KL is in the reward


@runtime_checkable
class Learner(Protocol):
    """The trainable policy (with a shared value head, if any), its KL reference and optimizer."""

    @property
    def temperature(self) -> float:
        """The softmax temperature log-probs are taken at (the engine's sampling temperature)."""
        ...

    def compute(
        self,
        rows: Sequence[Sample],
        *,
        logprobs: bool = False,
        ref_logprobs: bool = False,
        entropies: bool = False,
        values: bool = False,
        eval_mode: bool = False,
    ) -> Computed:
        """What is asked for, in one policy pass (log-probs and entropies together), one
        reference pass and one pass of the shared value head (`algorithm.critic: shared`; values
        are not masked: every position's). `eval_mode`: dropout off and no global RNG consumed
        (a probe)."""
        ...

    def update(
        self,
        rows: Sequence[Sample],
        *,
        epochs: int,
        mini_batches: int,
        generator: torch.Generator,
        old_values: Sequence[Sequence[float]] | None = None,
        envs: Sequence[str] | None = None,
    ) -> dict[str, float]:
        """PPO epochs over the step's rows (one optimizer step per mini-batch): the stats."""
        ...

    def weights(self, version: int) -> WeightUpdate:
        """The current policy for the engines as `version`: full tensors in named, bounded
        buckets, or a LoRA adapter. Consumed before the next `update` (it may read the live
        weights: a second full copy is what it avoids)."""
        ...

    def apply(self, levers: LearnerLevers) -> None:
        """Set the learning rate and the loss coefficients for the next update."""
        ...

    def snapshot(self) -> Any:
        """The trainable weights and the optimizer state now (opaque; `restore` takes it back;
        `torch.save`-able: a health snapshot ring is checkpointed)."""
        ...

    def restore(self, snapshot: Any) -> None:
        """The trainable weights and optimizer state of a `snapshot`, exactly."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint's state.pt holds of the learner besides the HF-format policy:
        `optimizer`, `value_head`, `adapters` (LoRA: the exact trainable tensors); a sharded
        learner instead names the directory its ranks wrote (`sharded`: `sharded_state.py`)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any], checkpoint: Path) -> None:
        """Restore a checkpoint: `state` (from `state_dict`) and the policy in `checkpoint`."""
        ...

    def save_model(self, directory: Path, final: Path) -> None:
        """The policy in HF format into `directory` (LoRA: the adapters, whose config names the
        base); `final` is where the directory will be renamed to. Learner ranks also write
        their shards of the weights and optimizer state there (torch.distributed.checkpoint)."""
        ...

    def close(self) -> None:
        """Release what the learner holds (processes, process groups); idempotent."""
        ...


def check_learner(make: Callable[[], Learner], rows: Sequence[Sample]) -> None:
    """What every implementation must do, on `rows` with advantages set: compute is repeatable
    and matches the rows' own log-probs when they came from this policy; a snapshot restores
    the weights and optimizer exactly; `weights` is a copy; the levers change the next update."""
    learner = make()
    assert isinstance(learner, Learner), f"{type(learner).__name__} does not implement Learner"
    first = learner.compute(rows, logprobs=True, entropies=True)
    again = learner.compute(rows, logprobs=True, entropies=True)
    assert first.logprobs is not None and first.entropies is not None
    assert first.ref_logprobs is None, "ref_logprobs computed without being asked for"
    assert again.logprobs is not None
    for a, b in zip(first.logprobs, again.logprobs, strict=True):
        assert torch.equal(a, b), "compute is not repeatable"
    before = _tensors(learner.weights(1))
    snap = learner.snapshot()
    stats = learner.update(rows, epochs=1, mini_batches=1, generator=torch.Generator().manual_seed(0))
    assert stats.get("actor/optimizer_steps", 1.0) != 0.0 and "actor/pg_loss" in stats, stats
    changed = learner.compute(rows, logprobs=True)
    assert changed.logprobs is not None
    assert any(not torch.equal(a, b) for a, b in zip(first.logprobs, changed.logprobs, strict=True)), (
        "an update changed no log-prob"
    )
    now = learner.weights(2)
    after = _tensors(now)
    assert now.version == 2 and set(after) == set(before), "weights() names other tensors"
    assert any(not torch.equal(before[k], v) for k, v in after.items()), "weights() missed the update"
    learner.restore(snap)
    back = learner.compute(rows, logprobs=True)
    assert back.logprobs is not None
    for a, b in zip(first.logprobs, back.logprobs, strict=True):
        assert torch.equal(a, b), "restore(snapshot()) did not bring the weights back exactly"
    learner.close()
    learner.close()


def _tensors(update: WeightUpdate) -> dict[str, torch.Tensor]:
    """An update's tensors: the full weights, or a LoRA update's A and B matrices."""
    if update.adapter is not None:
        return {f"{d.module}.{k}": t for d in update.adapter.deltas for k, t in (("a", d.a), ("b", d.b))}
    return update.full()


__all__ = ["Computed", "Learner", "LearnerLevers", "check_learner"]
