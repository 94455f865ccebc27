"""The critic: V(prefix) for every position, for PPO/GAE and step-level GAE.

Two forms, picked by `algorithm.critic`:
* "separate": its own small transformer (a copy of the policy's backbone at the start) plus a
  scalar head, with its own AdamW. The usual PPO set-up (verl, StepPO).
* "shared": a scalar head on the policy's last hidden state, trained jointly with the policy
  loss (`vf_coef`), so only one transformer is kept in memory.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from steprl.algorithms.losses import value_loss
from steprl.registry import Registry, instance_of
from steprl.rollout.views import Sample
from steprl.training.learn.batching import Collator, collate, device_of
from steprl.training.learn.guards import grad_metrics, guarded_epochs
from steprl.training.learn.learner_protocol import Learner


class ValueHead(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.proj.weight)  # start at V = 0: no bias before the first update
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden.float()).squeeze(-1)


def hidden_states(model: nn.Module, input_ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """Last-layer hidden states (B, T, H) of a transformers causal LM.

    `logits_to_keep=1`: the value head never reads logits, so the LM head runs on one position
    instead of making a (B, T, V) tensor."""
    out = model(input_ids=input_ids, attention_mask=attention, output_hidden_states=True, logits_to_keep=1)
    return out.hidden_states[-1]


def values_of(
    model: nn.Module, head: ValueHead, input_ids: torch.Tensor, attention: torch.Tensor
) -> torch.Tensor:
    """(B, T-1): V of the prefix that predicts target t (aligned like the learner's log-probs)."""
    return head(hidden_states(model, input_ids, attention))[:, :-1]


def value_tensors(
    model: nn.Module, head: ValueHead, samples: Sequence[Sample], pad_id: int, micro_batch_size: int
) -> list[torch.Tensor]:
    """Target-aligned values per sample, (len - 1,) each (entry t: V of the prefix that predicts
    input_ids[t + 1]), on the CPU."""
    out: list[torch.Tensor] = []
    with torch.no_grad():
        for m0 in range(0, len(samples), micro_batch_size):
            chunk = samples[m0 : m0 + micro_batch_size]
            b = collate(chunk, pad_id).to(device_of(model))
            v = values_of(model, head, b.input_ids, b.attention).cpu()
            out += [v[i, : len(s.input_ids) - 1] for i, s in enumerate(chunk)]
    return out


def per_token_values(
    model: nn.Module, head: ValueHead, samples: Sequence[Sample], pad_id: int, micro_batch_size: int
) -> list[tuple[float, ...]]:
    """`value_tensors` as floats: what `Critic.values` returns."""
    return [tuple(v.tolist()) for v in value_tensors(model, head, samples, pad_id, micro_batch_size)]


@runtime_checkable
class Critic(Protocol):
    """V(prefix) per position, trained by `update` (a run component: its state is checkpointed
    under the name `critic`)."""

    def values(self, samples: Sequence[Sample]) -> list[tuple[float, ...]]:
        """Target-aligned values per sample: entry t is V of the prefix that predicts token t+1."""
        ...

    def update(
        self,
        samples: Sequence[Sample],
        old_values: Sequence[Sequence[float]],
        *,
        epochs: int,
        mini_batches: int,
        generator: torch.Generator,
    ) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class SeparateCritic:
    """A value model of its own: backbone copied from the policy, scalar head, AdamW."""

    def __init__(
        self,
        policy: nn.Module,
        *,
        lr: float,
        value_clip: float | None,
        grad_clip: float,
        micro_batch_size: int,
        pad_id: int,
    ) -> None:
        self.model = copy.deepcopy(policy).train()
        config: Any = policy.config
        self.head = ValueHead(int(config.hidden_size)).to(device_of(policy))
        self.value_clip = value_clip
        self.grad_clip = grad_clip
        self.micro_batch_size = micro_batch_size
        self.pad_id = pad_id
        params = [*self.model.parameters(), *self.head.parameters()]
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)

    def values(self, samples: Sequence[Sample]) -> list[tuple[float, ...]]:
        return per_token_values(self.model, self.head, samples, self.pad_id, self.micro_batch_size)

    def state_dict(self) -> dict[str, Any]:
        """Its own backbone, head and optimizer."""
        return {
            "model": self.model.state_dict(),
            "head": self.head.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])

    def update(
        self,
        samples: Sequence[Sample],
        old_values: Sequence[Sequence[float]],
        *,
        epochs: int,
        mini_batches: int,
        generator: torch.Generator,
    ) -> dict[str, float]:
        """Clipped value regression onto `Sample.returns` (token-mean over action tokens)."""
        losses: list[float] = []
        collated = Collator(samples, self.pad_id)  # each row collated once for all epochs

        def backward(mb: list[int]) -> None:
            n_tokens = float(sum(sum(samples[i].loss_mask) for i in mb))
            total = 0.0
            for m0 in range(0, len(mb), self.micro_batch_size):
                idx = mb[m0 : m0 + self.micro_batch_size]
                b = collated(idx).to(self.head.proj.weight.device)
                old = collate_values([old_values[i] for i in idx], b.loss_mask.shape).to(b.input_ids.device)
                v = values_of(self.model, self.head, b.input_ids, b.attention)
                loss = value_loss(v, old, b.returns, b.loss_mask, clip=self.value_clip, num_tokens=n_tokens)
                loss.backward()
                total += loss.item()
            losses.append(total)

        params = [*self.model.parameters(), *self.head.parameters()]
        norms = guarded_epochs(
            self.optimizer,
            params,
            self.grad_clip,
            len(samples),
            epochs=epochs,
            mini_batches=mini_batches,
            generator=generator,
            backward=backward,
        )
        stats = grad_metrics("critic", norms, float("inf"))
        return {
            "critic/value_loss": sum(losses) / max(len(losses), 1),
            "critic/nonfinite_skips": stats["critic/nonfinite_skips"],
        }


class SharedCritic:
    """A value head on the policy's hidden states: the learner's, reached through its protocol
    (`compute(values=True)`). The learner trains it jointly with the policy (`vf_coef`), so
    `update` has nothing left to do."""

    def __init__(self, learner: Learner) -> None:
        self.learner = learner

    def values(self, samples: Sequence[Sample]) -> list[tuple[float, ...]]:
        computed = self.learner.compute(samples, values=True)
        assert computed.values is not None, "the learner holds no value head (algorithm.critic: shared)"
        return [tuple(v.tolist()) for v in computed.values]

    def update(
        self, samples: Sequence[Sample], old_values: Sequence[Sequence[float]], **_: Any
    ) -> dict[str, float]:
        return {}  # the learner trains the head with the policy

    def state_dict(self) -> dict[str, Any]:
        return {}  # the head is the learner's (its checkpoint holds it)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


@dataclass(frozen=True)
class CriticArgs:
    """What any critic is made from."""

    policy: nn.Module  # the policy model as the run starts (a separate critic copies its backbone)
    learner: Learner  # the learner (a shared critic's values are its value head's)
    lr: float
    value_clip: float | None
    grad_clip: float
    micro_batch_size: int
    pad_id: int


@dataclass(frozen=True)
class CriticSpec:
    make: Callable[[CriticArgs], Critic]
    shares_head: bool  # True: the learner holds a value head and trains it (vf_coef)
    about: str


def _separate(a: CriticArgs) -> Critic:
    return SeparateCritic(
        a.policy,
        lr=a.lr,
        value_clip=a.value_clip,
        grad_clip=a.grad_clip,
        micro_batch_size=a.micro_batch_size,
        pad_id=a.pad_id,
    )


def _shared(a: CriticArgs) -> Critic:
    return SharedCritic(a.learner)


#: `algorithm.critic` (besides "none"): one entry per kind, `check_critic` run over each
CRITICS: Registry[CriticSpec] = Registry(
    {
        "separate": CriticSpec(_separate, False, "its own backbone (a copy of the policy's), head and AdamW"),
        "shared": CriticSpec(_shared, True, "a head on the policy's hidden states, trained with the policy"),
    },
    key="algorithm.critic",
    what="critic",
    accept=instance_of(CriticSpec),
    expected="a CriticSpec",
    checker=None,
    checked_by="check_critic, on a small model's samples (tests/training/test_critics.py)",
)


def check_critic(critic: Critic, samples: Sequence[Sample]) -> None:
    """Values are target-aligned (one per position but the last); a state round trip restores
    them exactly; `update` returns float stats."""
    assert isinstance(critic, Critic), f"{type(critic).__name__} does not implement Critic"
    values = critic.values(samples)
    assert [len(v) for v in values] == [len(s.input_ids) - 1 for s in samples], "values not target-aligned"
    saved = copy.deepcopy(critic.state_dict())
    stats = critic.update(
        samples, values, epochs=1, mini_batches=1, generator=torch.Generator().manual_seed(0)
    )
    assert all(isinstance(v, float) for v in stats.values()), stats
    critic.load_state_dict(saved)
    assert critic.values(samples) == values, "load_state_dict(state_dict()) did not restore the values"


def collate_values(rows: Sequence[Sequence[float]], shape: torch.Size) -> torch.Tensor:
    """Per-sample target-aligned value tuples -> (B, T-1) tensor, 0 past each row's end."""
    out = torch.zeros(shape)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out
