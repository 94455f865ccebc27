"""The in-process learner (`LocalLearner`, the first implementation of
`training/learn/learner_protocol.Learner`): recompute log-probs on exact token ids and take PPO-style
optimizer steps, on one device.

It is algorithm-blind: the policy loss and aggregation are looked up by name by the trainer and
handed in. Rows are packed trajectories or single steps (`rollout.views.Sample`) carrying their
per-token advantages (and critic targets, when a shared value head is trained).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from steprl.algorithms.inputs import PolicyLossInputs
from steprl.algorithms.losses import PolicyLossOutput, aggregate, approx_kl_k3, kl_penalty, masked_mean
from steprl.config import ConfigError
from steprl.engines.weights import WeightUpdate
from steprl.rollout.views import Sample
from steprl.training.learn import batching, optimizer_state, sharded_state, snapshot_layout
from steprl.training.learn import checkpoint as ckpt
from steprl.training.learn.batching import (
    Batch,
    Collator,
    batch_hidden,
    logprobs_at,
    minibatches,
    token_budget_batches,
)
from steprl.training.learn.critic import ValueHead, collate_values
from steprl.training.learn.grad_share import GradShare, by_env
from steprl.training.learn.guards import grad_metrics, guarded_epochs
from steprl.training.learn.learner_protocol import Computed, LearnerLevers
from steprl.training.learn.lora import adapter_update, eval_mode, is_peft

PolicyLoss = Callable[[PolicyLossInputs], PolicyLossOutput]


@dataclass(frozen=True)
class Regularizers:
    """Terms added to the policy loss. KL is against a frozen reference policy (`ref_model`)."""

    entropy_coef: float = 0.0  # loss -= entropy_coef * agg(entropy)
    kl_coef: float = 0.0  # loss += kl_coef * agg(kl(logp, ref_logp)) when kl_in_loss
    kl_kind: str = "k3"
    vf_coef: float = 0.0  # shared value head: loss += vf_coef * value loss
    value_clip: float | None = 0.5


class LocalLearner:
    """Owns the trainable policy (plus a shared value head, if any), the frozen KL reference and
    the AdamW optimizer, in this process. Reached only through the `Learner` protocol."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        policy_loss: PolicyLoss,
        needs_proximal: bool,
        aggregation: str,
        loss_scale_factor: float | None,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        grad_clip: float,
        micro_batch_size: int,
        pad_id: int,
        temperature: float,
        regularizers: Regularizers = Regularizers(),
        ref_model: torch.nn.Module | None = None,
        value_head: ValueHead | None = None,
        device: str = "cpu",
        grad_spike_norm: float = float("inf"),
        pack: bool = False,
        max_tokens: int | None = None,
        activation_checkpointing: bool = False,
        placed: bool = False,  # FSDP2 put the shards where they live (the mesh's device, or host memory)
    ) -> None:
        self.model = (model if placed else model.to(device)).train()
        if activation_checkpointing:  # transformers' own: each decoder layer recomputed in backward
            hf: Any = self.model
            if hasattr(hf, "activation_checkpointing_enable"):  # transformers >= 5.25
                hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.device = device
        self.policy_loss = policy_loss
        self.needs_proximal = needs_proximal
        self.aggregation = aggregation
        self.loss_scale_factor = loss_scale_factor
        self.grad_clip = grad_clip
        self.grad_spike_norm = grad_spike_norm
        self.micro_batch_size = micro_batch_size
        self.max_tokens = max_tokens  # per micro-batch, rows x padded length (None: rows only)
        if pack and activation_checkpointing:
            raise ValueError("packed rows need the KV cache: pack=False with activation checkpointing")
        if pack and value_head is not None:
            raise ValueError("packed rows carry no per-row values: pack=False with a shared value head")
        self.pack = pack  # rows sharing a prefix are computed once (training/learn/packing.py)
        self._prox_is_current = False
        self._collator: Collator | None = None
        self.pad_id = pad_id
        self.temperature = temperature
        self.reg = regularizers
        # the frozen reference (KL in the loss, or in the reward: `compute(ref_logprobs=True)`)
        self.ref_model = ref_model.to(device).eval() if ref_model is not None else None
        # on ranks the head is the root unit's (placed, maybe offloaded): not moved here
        self.value_head = value_head.to(device) if value_head is not None and not placed else value_head
        # only what requires grad: with LoRA the base is frozen and the optimizer holds the adapters
        params = [p for p in model.parameters() if p.requires_grad]
        heads = value_head.parameters() if value_head is not None else ()
        params += [p for p in heads if all(p is not q for q in params)]  # on ranks: in the model
        self.params = params
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas)

    def weights(self, version: int) -> WeightUpdate:
        """What the engines need for the current policy: the full weights in buckets of views
        (no copy: read before the next update), or with LoRA only the adapters (the engines
        merge them into their copy of the base)."""
        if is_peft(self.model):
            return WeightUpdate.of_adapter(adapter_update(self.model), version)
        return WeightUpdate.of_tensors(self.model.state_dict(), version)

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
        if ref_logprobs and self.ref_model is None:
            raise ValueError("ref_logprobs asked of a learner with no reference model (kl_coef 0)")
        if values and self.value_head is None:
            raise ValueError("values asked of a learner with no value head (algorithm.critic: shared)")
        with _probe_mode(self.model, self.device) if eval_mode else _nothing():
            got = self._row_stats(rows, policy=logprobs or entropies, ref=ref_logprobs, values=values)
        return Computed(
            logprobs=got.get("logp") if logprobs else None,
            ref_logprobs=got.get("ref"),
            entropies=got.get("ent") if entropies else None,
            values=got.get("values"),
        )

    def apply(self, levers: LearnerLevers) -> None:
        if levers.lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = levers.lr
        if levers.entropy_coef is not None:
            self.reg = dataclasses.replace(self.reg, entropy_coef=levers.entropy_coef)
        if levers.kl_coef is not None:
            self.reg = dataclasses.replace(self.reg, kl_coef=levers.kl_coef)

    def snapshot(self) -> dict[str, Any]:
        return {
            "params": [p.detach().clone() for p in self.params],
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
        }

    def restore(self, snapshot: Mapping[str, Any]) -> None:
        # taken on ranks (a run resumed with another runtime.learner_ranks): joined into one
        snapshot = snapshot_layout.for_one(snapshot, self.optimizer.state_dict()["param_groups"])
        with torch.no_grad():
            for p, saved in zip(self.params, snapshot["params"], strict=True):
                p.copy_(saved)
        self.optimizer.load_state_dict(copy.deepcopy(snapshot["optimizer"]))

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "value_head": self.value_head.state_dict() if self.value_head is not None else None,
            # LoRA: the adapters (and only they) are trainable; exact tensors, not the re-saved format
            "adapters": (
                {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}
                if is_peft(self.model)
                else None
            ),
        }

    def load_state_dict(self, state: Mapping[str, Any], checkpoint: Path) -> None:
        if state.get("sharded"):  # written by learner ranks: every tensor read whole
            path = checkpoint / state["sharded"]
            stepped = bool(state.get("sharded_optimizer", True))
            sharded_state.load(self.model, self.optimizer, path, stepped=stepped, head=self.value_head)
            return
        if state["adapters"] is not None:
            params = dict(self.model.named_parameters())
            missing = set(state["adapters"]) - set(params)
            if missing:
                raise ConfigError(
                    f"{checkpoint}: adapters do not fit this model (e.g. {sorted(missing)[:2]}); "
                    "check model.lora"
                )
            for n, t in state["adapters"].items():
                params[n].data.copy_(t)
        else:
            ckpt.load_model_weights(self.model, checkpoint)
        optimizer = state["optimizer"]
        if state.get("ranks"):  # written by learner ranks (keyed by parameter name): reshard to one
            names = [n for n, p in self.model.named_parameters() if p.requires_grad]
            optimizer = optimizer_state.by_index(optimizer, names)
        self.optimizer.load_state_dict(optimizer)
        if self.value_head is not None and state["value_head"] is not None:
            self.value_head.load_state_dict(state["value_head"])

    def save_model(self, directory: Path, final: Path) -> None:
        ckpt.write_model(self.model, directory, final)

    def close(self) -> None:
        """Nothing to release in one process."""

    def footprint(self) -> int:
        """Bytes of the trainable weights, their gradients and the optimizer state held by this
        process (a rank's: its shards): what sharding divides (`benchmarks/learner_scale.py`)."""
        local = batching.local_tensor
        total = 0
        for p in self.params:
            total += 2 * local(p).numel() * local(p).element_size()  # the weight and its gradient
            for v in self.optimizer.state[p].values():
                if torch.is_tensor(v) and v.dim() > 0:
                    total += local(v).numel() * local(v).element_size()
        return total

    def _collated(self, samples: Sequence[Sample]) -> Collator:
        """The `Collator` of this set of rows (the last call's when the rows are the same objects),
        so every pass over a step's rows collates each row once."""
        if self._collator is None or not self._collator.holds(samples):
            self._collator = Collator(samples, self.pad_id)
        return self._collator

    @torch.no_grad()
    def _row_stats(
        self, samples: Sequence[Sample], *, policy: bool = True, ref: bool = False, values: bool = False
    ) -> dict[str, tuple[torch.Tensor, ...]]:
        """Per-sample (len-1,) target-aligned tensors, from one pass over each micro-batch:
        `logp` and `ent` under the policy and `ref` under the reference (on loss-mask positions
        only, 0 elsewhere: all that the KL, proximal and EMPG terms read), `values` from the
        shared value head on the policy's hidden states."""
        collated = self._collated(samples)
        out: dict[int, dict[str, torch.Tensor]] = {}
        mine, idle = self._my_micro_batches(samples, list(range(len(samples))))
        for idx in mine:
            b = collated(idx, pack=self.pack).to(self.device)
            trained = b.layout.trained if b.layout is not None else ()
            got: dict[str, list[torch.Tensor]] = {}
            if policy or values:
                hidden = batch_hidden(self.model, b)
                if policy:
                    logp, ent = logprobs_at(
                        self.model, hidden, b.input_ids, b.loss_mask, self.temperature, pred=b.pred
                    )
                    # 0 off the row's own mask (a shared node may be another row's)
                    got["logp"] = [lp * m for lp, m in zip(b.per_sample(logp.cpu()), trained, strict=True)]
                    got["ent"] = [e * m for e, m in zip(b.per_sample(ent.cpu()), trained, strict=True)]
                if values and self.value_head is not None:
                    got["values"] = b.per_sample(self.value_head(hidden)[:, :-1].cpu())
            if ref and self.ref_model is not None:
                hidden = batch_hidden(self.ref_model, b)
                logp, _ = logprobs_at(
                    self.ref_model, hidden, b.input_ids, b.loss_mask, self.temperature, pred=b.pred
                )
                got["ref"] = [lp * m for lp, m in zip(b.per_sample(logp.cpu()), trained, strict=True)]
            for k, i in enumerate(idx):
                out[i] = {name: rows[k] for name, rows in got.items()}
        for _ in range(idle):  # a rank with fewer rows still takes part in every collective
            b = collated([0]).to(self.device)
            if policy or values:
                batch_hidden(self.model, b)
            if ref and self.ref_model is not None:
                batch_hidden(self.ref_model, b)
        out = self._gathered(out)
        names = out[0].keys() if out else ()
        return {name: tuple(out[i][name] for i in range(len(samples))) for name in names}

    def update(
        self,
        samples: Sequence[Sample],
        *,
        epochs: int,
        mini_batches: int,
        generator: torch.Generator,
        old_values: Sequence[Sequence[float]] | None = None,
        envs: Sequence[str] | None = None,
    ) -> dict[str, float]:
        """PPO epochs over the step's rows: shuffle, split into mini-batches, one AdamW step each.

        Each mini-batch's loss uses the mini-batch's own token and row counts as denominators,
        accumulated over micro-batches, so micro-batching changes memory, never the gradient.

        `envs` (each row's env, given when the run has several): each mini-batch's rows are then
        backpropagated env by env, and `grad_share/<env>` is each env's share of the gradient
        (see `GradShare`); the same passes, in another order, so the update is the same.
        """
        if not samples:
            return {"actor/optimizer_steps": 0.0}
        # proximal policy = the weights before this step's updates (AReaL's decoupled objective).
        # With one optimizer step per batch those are the weights of the one backward pass: its
        # own log-probs, detached, so no extra forward pass is needed.
        one_step = epochs == 1 and len(minibatches(len(samples), mini_batches, torch.Generator())) == 1
        wants_prox = self.needs_proximal and not one_step
        self._prox_is_current = self.needs_proximal and one_step
        # the reference pass only when the KL is in the loss (in the reward: make_batch asked)
        in_loss = self.ref_model is not None and self.reg.kl_coef != 0.0
        before = self._row_stats(samples, policy=wants_prox, ref=in_loss) if wants_prox or in_loss else {}
        prox, ref = before.get("logp"), before.get("ref")
        collated = self._collated(samples)
        sums: dict[str, float] = {}
        tokens_seen = 0.0
        share = GradShare(self.params) if envs is not None else None
        mismatch: list[float] = []  # engine vs learner over the first mini-batch, before any update

        def backward(mb: list[int]) -> None:
            nonlocal tokens_seen
            rows = [samples[i] for i in mb]
            n_tokens = float(sum(sum(s.loss_mask) for s in rows))
            n_seqs = float(sum(1 for s in rows if any(s.loss_mask)))
            first = not mismatch
            for part in by_env(mb, envs):
                mine, idle = self._my_micro_batches(samples, part)
                for k, idx in enumerate(mine):
                    self._before_backward(last=k == len(mine) + idle - 1)
                    b = collated(idx, pack=self.pack).to(self.device)
                    stats = self._backward(b, idx, prox, ref, old_values, n_tokens, n_seqs, self.loss_scale)
                    gap = stats.pop("mismatch")
                    mismatch.extend([gap] if first else [])
                    n = float(b.loss_mask.sum())
                    for key, val in stats.items():
                        sums[key] = sums.get(key, 0.0) + val * n
                    tokens_seen += n
                for k in range(idle):  # a rank with fewer rows: a pass that adds nothing, in step
                    self._before_backward(last=k == idle - 1)
                    b = collated([mb[0]]).to(self.device)
                    self._backward(b, [mb[0]], prox, ref, old_values, n_tokens, n_seqs, 0.0)
                if share is not None and envs is not None:
                    share.add(envs[part[0]])
            mismatch.extend([0.0] if first and not mismatch else [])
            if share is not None:
                share.reset()

        grad_norms = guarded_epochs(
            self.optimizer,
            self.params,
            self.grad_clip,
            len(samples),
            epochs=epochs,
            mini_batches=mini_batches,
            generator=generator,
            backward=backward,
        )
        sums, tokens_seen, gap = self._reduced(sums, tokens_seen, max(mismatch, default=0.0))
        metrics = {k: v / max(tokens_seen, 1.0) for k, v in sums.items()}
        metrics |= grad_metrics("actor", grad_norms, self.grad_spike_norm)
        metrics["actor/engine_logprob_diff_max"] = gap
        if share is None:
            return metrics
        return metrics | share.metrics(self._reduced(share.squared, 0.0, 0.0)[0])  # over ranks

    def _micro_batches(self, samples: Sequence[Sample], idx: list[int]) -> list[list[int]]:
        """Split a mini-batch's rows into micro-batches (memory only: the loss is the same).

        Plain rows: `micro_batch_size` at a time, fewer where `max_tokens` (rows x padded length)
        would be passed. Packed rows: in their original order, so a trajectory's rows (and a
        group's) land together and share their prefixes, as many as fit the tokens of
        `micro_batch_size` plain rows of the longest length (or `max_tokens`, if fewer).
        """
        if not self.pack:
            if self.max_tokens is None:
                return [idx[i : i + self.micro_batch_size] for i in range(0, len(idx), self.micro_batch_size)]
            return token_budget_batches(
                [len(samples[i].input_ids) for i in idx], idx, self.micro_batch_size, self.max_tokens
            )
        budget = self.micro_batch_size * max(len(samples[i].input_ids) for i in idx)
        budget = min(budget, self.max_tokens) if self.max_tokens is not None else budget
        out: list[list[int]] = [[]]
        unique = 0  # a bound on the nodes: the tokens not shared with the previous row
        for i in sorted(idx):
            row = samples[i].input_ids
            prev = samples[out[-1][-1]].input_ids if out[-1] else ()
            shared = next(
                (n for n, (a, b) in enumerate(zip(row, prev, strict=False)) if a != b),
                min(len(row), len(prev)),
            )
            if out[-1] and unique + len(row) - shared > budget:
                out.append([])
                unique, shared = 0, 0
            out[-1].append(i)
            unique += len(row) - shared
        return out

    # ---- what a data-parallel rank (`rank_learner.py`) changes: one process does all rows ----

    #: FSDP averages the ranks' gradients; a rank's loss, over the global denominators, is scaled
    #: by the number of ranks so the average is the sum one process would take (1 here)
    loss_scale = 1.0

    def _my_micro_batches(self, samples: Sequence[Sample], idx: list[int]) -> tuple[list[list[int]], int]:
        """The micro-batches of rows `idx` this process runs, and how many passes without rows
        it adds to stay in step with the other ranks (one process: all of them, none)."""
        return (self._micro_batches(samples, idx) if idx else []), 0

    def _before_backward(self, *, last: bool) -> None:
        """Before each backward pass of a mini-batch part; `last`: the part's final one."""

    def _gathered(self, out: dict[int, Any]) -> dict[int, Any]:
        """Every row's result, from the rows each rank computed (one process: its own)."""
        return out

    def _reduced(
        self, sums: dict[str, float], tokens: float, gap: float
    ) -> tuple[dict[str, float], float, float]:
        """The update's stat sums and token count summed over ranks, the log-prob gap maxed."""
        return sums, tokens, gap

    def _backward(
        self,
        b: Batch,
        idx: list[int],
        prox: Sequence[torch.Tensor] | None,
        ref: Sequence[torch.Tensor] | None,
        old_values: Sequence[Sequence[float]] | None,
        n_tokens: float,
        n_seqs: float,
        scale: float = 1.0,
    ) -> dict[str, float]:
        m = b.loss_mask
        # log-probs only where trained, in chunks: no (B, T, V) logits (a shared value head
        # reads the same hidden states)
        hidden = batch_hidden(self.model, b)
        logp, entropy = logprobs_at(self.model, hidden, b.input_ids, m, self.temperature, pred=b.pred)
        if prox is not None:
            prox_logp = b.from_per_sample([prox[i] for i in idx]).to(m.device)
        else:
            prox_logp = logp.detach() if self._prox_is_current else b.old_logp
        result = self.policy_loss(PolicyLossInputs(logp, b.old_logp, prox_logp, b.advantages))

        def agg(x: torch.Tensor) -> torch.Tensor:
            return aggregate(
                x,
                m,
                self.aggregation,
                num_tokens=n_tokens,
                num_seqs=n_seqs,
                scale_factor=self.loss_scale_factor,
            )

        loss = agg(result.loss_per_token)
        stats: dict[str, float] = {}
        if self.reg.entropy_coef:
            loss = loss - self.reg.entropy_coef * agg(entropy)
        if ref is not None and self.reg.kl_coef:
            kl = kl_penalty(logp, b.from_per_sample([ref[i] for i in idx]).to(m.device), self.reg.kl_kind)
            loss = loss + self.reg.kl_coef * agg(kl)
            stats["actor/kl_to_ref"] = float(masked_mean(kl.detach(), m))
        if self.value_head is not None and old_values is not None:
            from steprl.algorithms.losses import value_loss

            v = self.value_head(hidden)[:, :-1]
            old_v = collate_values([old_values[i] for i in idx], m.shape).to(m.device)
            vl = value_loss(v, old_v, b.returns, m, clip=self.reg.value_clip, num_tokens=n_tokens)
            loss = loss + self.reg.vf_coef * vl
            stats["critic/value_loss"] = vl.item() * n_tokens / max(float(m.sum()), 1.0)
        (loss * scale if scale != 1.0 else loss).backward()
        with torch.no_grad():
            stats.update(
                {
                    "actor/pg_loss": float(masked_mean(result.loss_per_token, m)),
                    "actor/entropy": float(masked_mean(entropy, m)),
                    "actor/clip_frac": float(masked_mean(result.clipped.float(), m)),
                    "actor/approx_kl": float(masked_mean(approx_kl_k3(logp, b.old_logp), m)),
                    "mismatch": float(((logp - b.old_logp).abs() * m).max()) if m.sum() else 0.0,
                }
            )
        return stats


@contextlib.contextmanager
def _probe_mode(model: torch.nn.Module, device: str) -> Iterator[None]:
    """A probe's pass: no dropout and no global RNG moved (the run's sampling stays the same)."""
    dev = torch.device(device)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), eval_mode(model):
        yield


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


__all__ = ["GradShare", "LocalLearner", "Regularizers", "by_env"]
