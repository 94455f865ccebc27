"""The learner: recompute log-probs on exact token ids and take PPO-style optimizer steps.

It is algorithm-blind: the policy loss and aggregation are functions handed in by the trainer
(looked up by name in `steprl.algorithms`). Rows are packed trajectories or single steps
(`rollout.views.Sample`); token-level advantages are the trajectory's scalar on its action tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from steprl.algorithms.losses import PolicyLossOutput, aggregate, approx_kl_k3, masked_mean
from steprl.rollout.views import Sample


@dataclass(frozen=True)
class Batch:
    """Right-padded tensors for one micro-batch. Targets are input_ids[:, 1:].

    input_ids, attention: (B, T). loss_mask, old_logp, advantages: (B, T-1), aligned with the
    targets: position t scores the prediction of input_ids[:, t+1].
    """

    input_ids: torch.Tensor
    attention: torch.Tensor
    loss_mask: torch.Tensor
    old_logp: torch.Tensor
    advantages: torch.Tensor


def collate(samples: Sequence[Sample], traj_advantages: torch.Tensor, pad_id: int) -> Batch:
    """Pad rows on the right (causal attention makes right padding invisible to real tokens)."""
    width = max(len(s.input_ids) for s in samples)
    bsz = len(samples)
    ids = torch.full((bsz, width), pad_id, dtype=torch.long)
    attn = torch.zeros((bsz, width), dtype=torch.long)
    mask = torch.zeros((bsz, width), dtype=torch.float32)
    old = torch.zeros((bsz, width), dtype=torch.float32)
    adv = torch.zeros((bsz, width), dtype=torch.float32)
    for i, s in enumerate(samples):
        n = len(s.input_ids)
        ids[i, :n] = torch.tensor(s.input_ids)
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        old[i, :n] = torch.tensor(s.old_logprobs, dtype=torch.float32)
        adv[i, :n] = traj_advantages[s.traj_index]
    return Batch(ids, attn, mask[:, 1:], old[:, 1:], adv[:, 1:] * mask[:, 1:])


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


PolicyLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], PolicyLossOutput]


class Learner:
    """Owns the trainable model and its AdamW optimizer."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        policy_loss: PolicyLoss,
        aggregation: str,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        grad_clip: float,
        micro_batch_size: int,
        pad_id: int,
        temperature: float,
        device: str = "cpu",
    ) -> None:
        self.model = model.to(device).train()
        self.device = device
        self.policy_loss = policy_loss
        self.aggregation = aggregation
        self.grad_clip = grad_clip
        self.micro_batch_size = micro_batch_size
        self.pad_id = pad_id
        self.temperature = temperature
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=betas)

    def state_dict_for_engine(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def update(
        self,
        samples: Sequence[Sample],
        traj_advantages: torch.Tensor,
        *,
        epochs: int,
        mini_batches: int,
        generator: torch.Generator,
    ) -> dict[str, float]:
        """PPO epochs over the step's rows: shuffle, split into mini-batches, one AdamW step each.

        Each mini-batch's loss is aggregated with the mini-batch's own token count, accumulated
        over micro-batches, so micro-batching changes memory, never the gradient.
        """
        if not samples:
            return {"actor/optimizer_steps": 0.0}
        sums: dict[str, float] = {}
        tokens_seen = 0.0
        grad_norms: list[float] = []
        first_mismatch: float | None = None
        for _epoch in range(epochs):
            order = torch.randperm(len(samples), generator=generator).tolist()
            size = max(1, -(-len(order) // mini_batches))
            for start in range(0, len(order), size):
                mb = [samples[i] for i in order[start : start + size]]
                mb_tokens = float(sum(sum(s.loss_mask) for s in mb))
                self.optimizer.zero_grad(set_to_none=True)
                for m0 in range(0, len(mb), self.micro_batch_size):
                    batch = collate(mb[m0 : m0 + self.micro_batch_size], traj_advantages, self.pad_id)
                    batch = Batch(
                        *(
                            t.to(self.device)
                            for t in (
                                batch.input_ids,
                                batch.attention,
                                batch.loss_mask,
                                batch.old_logp,
                                batch.advantages,
                            )
                        )
                    )
                    logp, entropy = token_logprobs(
                        self.model, batch.input_ids, batch.attention, self.temperature
                    )
                    out = self.policy_loss(logp, batch.old_logp, batch.advantages)
                    loss = aggregate(
                        out.loss_per_token, batch.loss_mask, self.aggregation, num_tokens=mb_tokens
                    )
                    loss.backward()
                    with torch.no_grad():
                        m = batch.loss_mask
                        n = float(m.sum())
                        if first_mismatch is None:  # engine vs learner, before any update
                            first_mismatch = float(((logp - batch.old_logp).abs() * m).max())
                        for key, val in (
                            ("actor/pg_loss", masked_mean(out.loss_per_token, m)),
                            ("actor/entropy", masked_mean(entropy, m)),
                            ("actor/clip_frac", masked_mean(out.clipped.float(), m)),
                            ("actor/approx_kl", masked_mean(approx_kl_k3(logp, batch.old_logp), m)),
                        ):
                            sums[key] = sums.get(key, 0.0) + float(val) * n
                        tokens_seen += n
                grad_norms.append(
                    float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip))
                )
                self.optimizer.step()
        metrics = {k: v / max(tokens_seen, 1.0) for k, v in sums.items()}
        metrics["actor/grad_norm"] = sum(grad_norms) / len(grad_norms)
        metrics["actor/optimizer_steps"] = float(len(grad_norms))
        metrics["actor/engine_logprob_diff_max"] = first_mismatch or 0.0
        return metrics
