"""What every step-reward kind reads and the model pieces they share.

A kind (`StepRewardModel`) sees one step's finished groups as `StepData`: the estimators' own
`AdvantageInputs` (outcomes, groups, and every step of every trajectory flattened to S, in
trajectory order), the training rows the learner reads (`views`, with their exact ids and the
engine's log-probs) and the trajectories (for each step's env info). It returns one reward per
step, (S,), and fits its own model on the same record. Token tensors here are target-aligned
(column t scores input token t + 1), as in `AdvantageInputs`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from steprl.algorithms.inputs import AdvantageInputs
from steprl.rollout.views import Sample, targets
from steprl.training.learn.batching import Batch, Collator, device_of, last_hidden, logprobs_at
from steprl.training.learn.critic import ValueHead
from steprl.types import Trajectory


@dataclass(frozen=True)
class StepData:
    """One step's trainable groups at the three levels; `views[i].traj_index` indexes
    `trajectories`, and row i of `x`'s token tensors is `views[i]`."""

    x: AdvantageInputs
    views: tuple[Sample, ...]
    trajectories: tuple[Trajectory, ...]
    #: the views as tensors, made once for the scoring and every fitting epoch (`rows_batch`)
    collators: dict[int, Collator] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_steps(self) -> int:
        return int(self.x.step_traj.numel())

    def step_info(self, key: str) -> list[Any]:
        """`Step.info[key]` of every step, in S order (None where a step lacks it)."""
        return [s.info.get(key) for t in self.trajectories for s in t.steps]

    def grounded(self) -> Tensor:
        """(S,) 1.0 where the env took the step's action as a valid one (SPA-RL's grounding
        signal: `action_kind` is not "invalid"), else 0.0."""
        return torch.tensor([float(kind != "invalid") for kind in self.step_info("action_kind")])

    def behaviour_logprobs(self) -> Tensor:
        """(B, T) the engine's log-probs of the sampled tokens, 0 off the mask."""
        out = torch.zeros_like(self.x.mask)
        for i, v in enumerate(self.views):
            old = targets(v.old_logprobs)
            out[i, : len(old)] = torch.tensor(old)
        return out * self.x.mask


@runtime_checkable
class StepRewardModel(Protocol):
    """A step-reward kind: `score` one reward per step (no gradient), `fit` its own model on
    finished groups (a kind without training returns {}), and its state out and back in exactly
    (weights and optimizer: a resume continues it bit for bit)."""

    trains: bool  # whether `fit` changes anything (the drift guard waits for fits only if so)

    def score(self, data: StepData) -> Tensor: ...

    def fit(self, data: StepData) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Any) -> None: ...


@dataclass(frozen=True)
class ModelContext:
    """What the trainer hands a kind when the run starts: the policy as it starts (a kind copies
    what it trains), the reference (`algorithm.kl_coef` > 0) or None, and the learner's shapes."""

    policy: nn.Module
    ref_model: nn.Module | None
    pad_id: int
    micro_batch_size: int
    temperature: float
    grad_clip: float


def frozen_reference(ctx: ModelContext) -> nn.Module:
    """The run's KL reference, or a frozen copy of the policy as the run starts."""
    if ctx.ref_model is not None:
        return ctx.ref_model
    ref = copy.deepcopy(ctx.policy).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def step_sums(per_token: Tensor, token_step: Tensor, num_steps: int) -> Tensor:
    """(B, T) -> (S,): each step's sum over its action tokens (token_step: -1 off them)."""
    on = token_step >= 0
    return torch.zeros(num_steps, dtype=per_token.dtype).index_add(0, token_step[on], per_token[on])


def trajectory_sums(per_step: Tensor, step_traj: Tensor, num_traj: int) -> Tensor:
    """(S,) -> (N,): each trajectory's sum over its steps."""
    return torch.zeros(num_traj, dtype=per_step.dtype).index_add(0, step_traj, per_step)


def chunks_by_trajectory(data: StepData, size: int) -> Iterator[list[int]]:
    """Row indices, `size` trajectories' rows at a time: a loss over a trajectory's steps (a
    sum, a DPO pair member) sees all of them in one forward pass, whichever layout the rows use."""
    by_traj: dict[int, list[int]] = {}
    for i, v in enumerate(data.views):
        by_traj.setdefault(v.traj_index, []).append(i)
    trajs = sorted(by_traj)
    for k in range(0, len(trajs), max(1, size)):
        yield [i for t in trajs[k : k + size] for i in by_traj[t]]


def rows_batch(data: StepData, rows: Sequence[int], pad_id: int) -> tuple[Batch, Tensor]:
    """The rows collated (unpacked) and their slice of the global token_step, (b, T'). Each
    row of a step becomes tensors once for the scoring and every fitting epoch (`Collator`)."""
    if pad_id not in data.collators:
        data.collators[pad_id] = Collator(data.views, pad_id)
    collated = data.collators[pad_id]
    b = collated(rows)
    width = b.loss_mask.shape[1]
    return b, data.x.token_step[list(rows), :width]


def token_logprobs(model: nn.Module, b: Batch, temperature: float) -> Tensor:
    """(b, T') log-probs of the sampled tokens under `model`, 0 off the mask (with gradient when
    enabled): the learner's own computation, so an unchanged copy reproduces its numbers."""
    # the step data lives on the CPU; the model where the learner put it (a GPU): the batch goes
    # there and the log-probs come back (`.cpu()` keeps the graph)
    g = b.to(device_of(model))
    logp, _ = logprobs_at(
        model, last_hidden(model, g.input_ids, g.attention), g.input_ids, g.loss_mask, temperature
    )
    return logp.cpu()


class ValueModel(nn.Module):
    """A backbone copied from the policy and a scalar head (zero at the start), read at chosen
    token positions: the model `progress` and `mc_value` train, as the separate critic does."""

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        self.backbone = copy.deepcopy(policy).train()
        config: Any = policy.config
        self.head = ValueHead(int(config.hidden_size)).to(device_of(policy))

    def at(self, b: Batch, rows: Tensor, cols: Tensor) -> Tensor:
        """(K,) the head on the hidden state at input positions (rows[k], cols[k]), on the CPU
        where the step data is (the backbone may be on a GPU)."""
        dev = device_of(self.backbone)
        hidden = last_hidden(self.backbone, b.input_ids.to(dev), b.attention.to(dev))
        return self.head(hidden[rows.to(dev), cols.to(dev)]).cpu()


class ValueKind:
    """What `progress` and `mc_value` share: a `ValueModel` with its own AdamW, fitted by one
    optimizer step per epoch on a loss summed over micro-batches of whole trajectories, and
    checkpointed whole. A kind says its per-fit targets and the loss of one chunk of rows."""

    trains = True

    def __init__(self, ctx: ModelContext, *, lr: float, epochs: int) -> None:
        self.ctx, self.epochs = ctx, epochs
        self.model = ValueModel(ctx.policy)
        self.optimizer = adamw(self.model.parameters(), lr)

    def targets(self, data: StepData) -> Tensor:
        raise NotImplementedError

    def chunk_loss(self, data: StepData, rows: list[int], targets: Tensor) -> Tensor:
        raise NotImplementedError

    def fit(self, data: StepData) -> dict[str, float]:
        targets = self.targets(data)
        losses = []
        for _ in range(self.epochs):
            self.optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for rows in chunks_by_trajectory(data, self.ctx.micro_batch_size):
                loss = self.chunk_loss(data, rows, targets)
                loss.backward()
                total += loss.item()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.ctx.grad_clip)
            self.optimizer.step()
            losses.append(total)
        return {"step_reward/fit_loss": sum(losses) / len(losses)}

    def state_dict(self) -> dict[str, Any]:
        return model_state(self.model, self.optimizer)

    def load_state_dict(self, state: Any) -> None:
        load_model_state(self.model, self.optimizer, state)


def step_end_positions(token_step: Tensor, num_steps: int) -> tuple[Tensor, Tensor, Tensor]:
    """For a (b, T') slice: (rows, input positions, step ids) of each step's last action token
    in it. Target column t is input token t + 1, so the hidden state there has read the whole
    action: the state after acting."""
    nxt = torch.cat([token_step[:, 1:], torch.full_like(token_step[:, :1], -1)], dim=1)
    ends = (token_step >= 0) & (nxt != token_step)
    rows, cols = torch.nonzero(ends, as_tuple=True)
    return rows, cols + 1, token_step[rows, cols]


def step_start_positions(token_step: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(rows, input positions, step ids) of the state before each step's first action token:
    the hidden state at target column t has read everything before that token."""
    prev = torch.cat([torch.full_like(token_step[:, :1], -1), token_step[:, :-1]], dim=1)
    starts = (token_step >= 0) & (prev != token_step)
    rows, cols = torch.nonzero(starts, as_tuple=True)
    return rows, cols, token_step[rows, cols]


def adamw(params: Sequence[nn.Parameter] | Iterator[nn.Parameter], lr: float) -> torch.optim.AdamW:
    return torch.optim.AdamW(list(params), lr=lr, weight_decay=0.0)


def model_state(model: nn.Module, optimizer: torch.optim.Optimizer, **extra: Any) -> dict[str, Any]:
    """Weights and optimizer as a checkpoint stores them (cloned: later steps do not alias)."""
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        **extra,
    }


def load_model_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: Any) -> None:
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


__all__ = [
    "ModelContext",
    "StepData",
    "StepRewardModel",
    "ValueKind",
    "ValueModel",
    "chunks_by_trajectory",
    "frozen_reference",
    "rows_batch",
    "step_end_positions",
    "step_start_positions",
    "step_sums",
    "token_logprobs",
    "trajectory_sums",
]
