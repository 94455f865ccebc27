"""One rank of the data-parallel learner (`runtime.learner_ranks` > 1; `learner_group.py` drives
the ranks as one `Learner`).

Each rank holds an FSDP2 shard of the policy (`fully_shard` on every transformer block and on
the root, over a one-dimensional device mesh: gloo on CPU) and runs `LocalLearner`'s own code
on its part of the rows, so the step is the one a single process takes:

* every rank gets all of the step's rows and the same shuffle generator, so each draws the
  same mini-batches; a mini-batch's rows are split across ranks balanced by tokens
  (`split_by_tokens`), and its loss denominators (tokens, sequences) are the whole
  mini-batch's, as one process computes them;
* FSDP averages the ranks' gradients, so a rank's loss is scaled by the number of ranks
  (`loss_scale`): the average is the sum one process would take;
* the gradient norm, its clip and the non-finite skip read the norm over every rank's shard
  (a DTensor: the same on all ranks, so all skip or none do);
* a rank with fewer micro-batches than another runs passes that add nothing (loss times 0) so
  every rank takes part in every all-gather and reduce-scatter;
* the update's logged stats are summed over ranks, its log-prob gap is the max.

The KL reference (no gradient) is replicated, not sharded. Rows are not packed into prefix
trees on ranks (a tree runs a varying number of forward segments: the ranks' all-gathers would
fall out of step). LoRA: the adapters are their own FSDP units and the only trainable weights;
the KL reference is the rank's own sharded policy with its adapters off. A shared value head
(`algorithm.critic: shared`) is a submodule of the policy (`sharded_state.HEAD`), in the root's
FSDP unit beside the LM head, so its values are computed as the logits are and its weights and
optimizer state sit in the sharded checkpoint beside the policy's. `grad_share/<env>`: each
rank measures its shard of each env's gradient; the squared norms are summed over ranks.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from steprl.engines.transports import collective
from steprl.engines.transports.collective import GroupAddress
from steprl.extras import require
from steprl.rollout.views import Sample
from steprl.training.learn import sharded_state
from steprl.training.learn.batching import local_tensor
from steprl.training.learn.learner import LocalLearner
from steprl.training.learn.lora import ADAPTER, ADAPTERS_OFF, AdaptersDisabled, is_peft

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def split_by_tokens(idx: Sequence[int], tokens: Sequence[int], world: int) -> list[list[int]]:
    """Rows `idx` (with `tokens[k]` tokens for row `idx[k]`) split into `world` parts balanced by
    tokens: the longest row first, each to the part with the fewest tokens so far (ties: the
    lower part); each part keeps the rows' order in `idx`. Deterministic: every rank computes
    every rank's part."""
    load = [0] * world
    owner: dict[int, int] = {}
    for k in sorted(range(len(idx)), key=lambda k: (-tokens[k], k)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[k], load[r] = r, load[r] + tokens[k]
    return [[i for k, i in enumerate(idx) if owner[k] == r] for r in range(world)]


def join_shards(
    parts: Sequence[Mapping[str, torch.Tensor]], shapes: Mapping[str, torch.Size]
) -> dict[str, torch.Tensor]:
    """The full weights from each rank's `local_state`: a tensor whose full shape is its local
    shape is replicated (rank 0's); any other is the ranks' dim-0 chunks in rank order."""
    full = {}
    for name, shape in shapes.items():
        chunks = [p[name] for p in parts]
        full[name] = chunks[0] if chunks[0].shape == shape else torch.cat(chunks, dim=0)
        if full[name].shape != shape:
            raise ValueError(f"{name}: joined shards are {tuple(full[name].shape)}, not {tuple(shape)}")
    return full


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks, each its own FSDP unit: the classes a Hugging Face model
    names in `_no_split_modules`, else the modules of its longest `ModuleList`."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if blocks:
        return blocks
    lists = [list(m.children()) for m in model.modules() if isinstance(m, nn.ModuleList)]
    return max(lists, key=len) if lists else []


def lora_linears(model: nn.Module) -> list[nn.Module]:
    """The LoRA A and B matrices of a peft model (none for a plain model)."""
    return [
        m
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and (".lora_A." in name + "." or ".lora_B." in name + ".")
    ]


@dataclass(frozen=True)
class ModelParts:
    """A model as its class, config and weights: each rank builds it anew (its constructor runs
    there; an unpickled transformers model misses what its class registers when it is made).
    `lora`: the peft config of a LoRA policy, whose adapters the rank puts back on its base."""

    cls: type[nn.Module]
    config: Any
    weights: dict[str, torch.Tensor]
    dtype: torch.dtype
    lora: Any = None

    @staticmethod
    def of(model: nn.Module) -> ModelParts:
        hf: Any = model
        base = hf.get_base_model() if is_peft(model) else model
        lora = copy.deepcopy(hf.peft_config[ADAPTER]) if is_peft(model) else None
        weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        dtype = next(base.parameters()).dtype
        return ModelParts(type(base), copy.deepcopy(base.config), weights, dtype, lora)

    def build(self) -> nn.Module:
        model: Any = self.cls(self.config).to(self.dtype)
        if self.lora is not None:  # the same adapters (fp32 over any base), then the exact weights
            peft = require("peft", extra="lora", feature="model.lora")
            with warnings.catch_warnings():  # transformers' deprecation notes from inside peft
                warnings.simplefilter("ignore", FutureWarning)
                model = peft.get_peft_model(model, copy.deepcopy(self.lora))
        model.load_state_dict(self.weights)
        return model.train()


def start_rank(
    parts: ModelParts, settings: dict[str, Any], *, rank: int, world: int, init_method: str, timeout_s: float
) -> RankLearner:
    """Join the process group and build this rank's learner: the one way a rank starts, in a Ray
    actor (`learner_group.py`) or in a process of its own (`benchmarks/learner_gpu_kit.py`, as
    torchrun would start it). On CUDA the rank computes on its one GPU: the only one visible (Ray
    sets `CUDA_VISIBLE_DEVICES`), else the one `LOCAL_RANK` names; NCCL joins the ranks."""
    cuda = str(settings.get("device", "cpu")).startswith("cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        settings = {**settings, "device": f"cuda:{torch.cuda.current_device()}"}
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    return RankLearner(parts.build(), rank=rank, world=world, **settings)


class RankLearner(LocalLearner):
    """`LocalLearner` on this rank's FSDP2 shard and its share of the rows; the process group
    (`torch.distributed`) is initialised before it is made."""

    def __init__(self, model: nn.Module, *, rank: int, world: int, **settings: Any) -> None:
        settings = dict(settings)
        device = torch.device(settings.get("device", "cpu")).type
        mesh = init_device_mesh(device, (world,))
        policies: dict[str, Any] = {}
        if settings.pop("mixed_precision", False) and device == "cuda":
            # bf16 all-gathers and compute; fp32 gradient reduction, weights and optimizer state
            policies["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        if settings.pop("cpu_offload", False):
            # the shards, their gradients and the optimizer state live in host memory; the GPU
            # holds a block's gathered weights while it runs, and AdamW steps on the CPU
            policies["offload_policy"] = CPUOffloadPolicy(pin_memory=device == "cuda")
        if settings.get("value_head") is not None:  # a shared critic: its head in the root's unit
            model.add_module(sharded_state.HEAD, settings["value_head"])
        # LoRA: each adapter matrix is its own unit, so a block's unit holds only base weights (one
        # dtype, as FSDP2 needs: fp32 adapters over a bf16 base) and only adapters get gradients
        for adapter in lora_linears(model):
            fully_shard(adapter, mesh=mesh, **policies)
        for block in transformer_blocks(model):
            fully_shard(block, mesh=mesh, **policies)
        fully_shard(model, mesh=mesh, **policies)
        if settings.get("ref_model") == ADAPTERS_OFF:
            settings = {**settings, "ref_model": AdaptersDisabled(model)}
        super().__init__(model, placed=True, **settings)
        self.rank, self.world = rank, world
        self.loss_scale = float(world)

    # ---- the data-parallel hooks of LocalLearner -----------------------------------------

    def _my_micro_batches(self, samples: Sequence[Sample], idx: list[int]) -> tuple[list[list[int]], int]:
        parts = split_by_tokens(idx, [len(samples[i].input_ids) for i in idx], self.world)
        micro = [self._micro_batches(samples, part) if part else [] for part in parts]
        return micro[self.rank], max(len(m) for m in micro) - len(micro[self.rank])

    def _before_backward(self, *, last: bool) -> None:
        # gradients accumulate unsharded over a part's micro-batches and are reduce-scattered
        # once, after its last backward: one reduce-scatter per block per mini-batch
        self.model.set_requires_gradient_sync(last)  # type: ignore[operator]

    def _gathered(self, out: dict[int, Any]) -> dict[int, Any]:
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, out)
        return {i: v for part in parts for i, v in part.items()}

    def _reduced(
        self, sums: dict[str, float], tokens: float, gap: float
    ) -> tuple[dict[str, float], float, float]:
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, (sums, tokens, gap))
        total: dict[str, float] = {}
        for part_sums, _, _ in parts:  # rank order: every rank adds in the same order
            for k, v in part_sums.items():
                total[k] = total.get(k, 0.0) + v
        return total, sum(p[1] for p in parts), max(p[2] for p in parts)

    # ---- what the group gathers or scatters ----------------------------------------------

    def update_from(
        self, samples: Sequence[Sample], generator_state: torch.Tensor, **kw: Any
    ) -> dict[str, float]:
        """`update` with the controller's shuffle generator, as it stood."""
        generator = torch.Generator()
        generator.set_state(generator_state)
        return self.update(samples, generator=generator, **kw)

    def full_state(self) -> dict[str, torch.Tensor]:
        """The full weights on rank 0 (CPU), nothing on the others: every rank takes part."""
        return dict(get_model_state_dict(self.model, options=_FULL))  # type: ignore[arg-type]

    def local_state(self, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """This rank's dim-0 shard of every weight (or of `names`; a replicated tensor whole), on
        the CPU: the controller joins the ranks' shards (`join_shards`) without a collective. A
        gloo gather of Gemma-3-270M's weights tensor by tensor took 22 s; this is one message per
        rank."""
        out = {}
        wanted = set(names) if names is not None else None
        for name, t in self.model.state_dict().items():
            if wanted is not None and name not in wanted:
                continue
            sharded = isinstance(t, DTensor) and any(p.is_shard() for p in t.placements)
            if sharded and [p.is_shard(0) for p in t.placements] != [True]:
                raise ValueError(f"{name}: sharded as {t.placements}; only dim-0 shards are joined")
            out[name] = local_tensor(t).detach().cpu().clone()
        return out

    def join_weights_group(self, address: GroupAddress) -> None:
        """Rank 0 joins the engines' weights group as its sender (the others gather for it)."""
        self._weights_group = collective.join(address, 0) if self.rank == 0 else None

    def broadcast_weights(self, version: int, names: Sequence[str], bucket_bytes: int) -> int:
        """Every rank: the weights `names` to the weights group as `version`, one bucket at a
        time (`collective.send_sharded`). Returns the bytes rank 0 sent."""
        group = getattr(self, "_weights_group", None)
        state = self.model.state_dict()
        return collective.send_sharded(
            group, state, names, version, bucket_bytes, rank=self.rank, world=self.world
        )

    def snapshot(self) -> dict[str, Any]:
        """This rank's shards of the weights and the optimizer state (plain tensors)."""
        state = [
            {
                k: local_tensor(v).clone() if torch.is_tensor(v) else v
                for k, v in self.optimizer.state[p].items()
            }
            for p in self.params
        ]
        return {"params": [local_tensor(p.detach()).clone() for p in self.params], "optimizer": state}

    def restore(self, snapshot: Mapping[str, Any]) -> None:
        with torch.no_grad():
            for p, saved in zip(self.params, snapshot["params"], strict=True):
                local_tensor(p).copy_(saved)
            for p, saved_state in zip(self.params, snapshot["optimizer"], strict=True):
                if not saved_state:  # before the first step: Adam starts its moments again
                    self.optimizer.state.pop(p, None)
                    continue
                now = self.optimizer.state[p]
                for k, v in saved_state.items():
                    if k in now and torch.is_tensor(v):
                        local_tensor(now[k]).copy_(v)
                    elif torch.is_tensor(v) and isinstance(p, DTensor) and v.shape == local_tensor(p).shape:
                        now[k] = DTensor.from_local(v.clone(), p.device_mesh, p.placements)
                    else:
                        now[k] = v.clone() if torch.is_tensor(v) else v

    def state_dict(self) -> dict[str, Any]:
        """What state.pt records of the learner: where the ranks' shards are (`save_sharded`
        writes them with the checkpoint's model), not the optimizer state itself."""
        return {
            "optimizer": None,
            "value_head": None,
            "adapters": None,
            "ranks": self.world,
            "sharded": sharded_state.LEARNER_DIR,
            "sharded_optimizer": bool(self.optimizer.state),
        }

    def load_state_dict(self, state: Mapping[str, Any], checkpoint: Path) -> None:
        raise NotImplementedError("the group loads full weights (load_full) or shards (load_sharded)")

    def save_sharded(self, directory: str) -> None:
        """This rank's shards of the weights and optimizer state, into the checkpoint being
        written (every rank at once: torch.distributed.checkpoint)."""
        sharded_state.save(self.model, self.optimizer, Path(directory) / sharded_state.LEARNER_DIR)

    def load_sharded(self, checkpoint: str, stepped: bool) -> None:
        """A checkpoint's shards, written on any number of ranks, resharded to this group."""
        path = Path(checkpoint) / sharded_state.LEARNER_DIR
        sharded_state.load(self.model, self.optimizer, path, stepped=stepped)

    def load_full(self, weights: Mapping[str, torch.Tensor], optimizer: Mapping[str, Any]) -> None:
        """Every rank is given the full weights and optimizer state and keeps its shards."""
        set_model_state_dict(self.model, dict(weights), options=StateDictOptions(full_state_dict=True))
        set_optimizer_state_dict(
            self.model, self.optimizer, dict(optimizer), options=StateDictOptions(full_state_dict=True)
        )


__all__ = ["ModelParts", "RankLearner", "join_shards", "split_by_tokens", "start_rank", "transformer_blocks"]
