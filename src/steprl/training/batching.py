"""Collating training rows into right-padded, target-aligned tensors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from steprl.rollout.views import Sample


@dataclass(frozen=True)
class Batch:
    """Right-padded tensors for one micro-batch. Targets are input_ids[:, 1:].

    input_ids, attention: (B, T). Every other field is (B, T-1), aligned with the targets:
    position t is about the prediction of input_ids[:, t+1].
    """

    input_ids: torch.Tensor
    attention: torch.Tensor
    loss_mask: torch.Tensor
    old_logp: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor

    def to(self, device: str | torch.device) -> Batch:
        return Batch(
            *(
                t.to(device)
                for t in (
                    self.input_ids,
                    self.attention,
                    self.loss_mask,
                    self.old_logp,
                    self.advantages,
                    self.returns,
                )
            )
        )


def _fill(dst: torch.Tensor, i: int, values: Sequence[float]) -> None:
    if values:
        dst[i, : len(values)] = torch.tensor(values, dtype=dst.dtype)


def collate(samples: Sequence[Sample], pad_id: int) -> Batch:
    """Pad rows on the right (causal attention makes right padding invisible to real tokens)."""
    width = max(len(s.input_ids) for s in samples)
    bsz = len(samples)
    ids = torch.full((bsz, width), pad_id, dtype=torch.long)
    attn = torch.zeros((bsz, width), dtype=torch.long)
    per_token = {k: torch.zeros((bsz, width)) for k in ("mask", "old", "adv", "ret")}
    for i, s in enumerate(samples):
        ids[i, : len(s.input_ids)] = torch.tensor(s.input_ids)
        attn[i, : len(s.input_ids)] = 1
        _fill(per_token["mask"], i, s.loss_mask)
        _fill(per_token["old"], i, s.old_logprobs)
        _fill(per_token["adv"], i, s.advantages)
        _fill(per_token["ret"], i, s.returns)
    mask = per_token["mask"][:, 1:]
    return Batch(
        ids, attn, mask, per_token["old"][:, 1:], per_token["adv"][:, 1:] * mask, per_token["ret"][:, 1:]
    )


def token_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each next token and the entropy of each predictive distribution.

    Same numerics as the engine: fp32 logits divided by the sampling temperature. Returns
    logp, entropy: (B, T-1).
    """
    logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1, :].float()
    if temperature > 0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def minibatches(n: int, num: int, generator: torch.Generator) -> list[list[int]]:
    """Shuffle n row indices and split them into `num` near-equal mini-batches."""
    order = torch.randperm(n, generator=generator).tolist()
    size = max(1, -(-n // num))
    return [order[i : i + size] for i in range(0, n, size)]
