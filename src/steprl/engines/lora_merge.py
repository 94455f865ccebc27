"""LoRA on the engine side: adapters in, merged weights out, no peft at generation time.

The learner trains LoRA adapters (`training/learn/lora.py`); generating through an unmerged peft model
was measured 16x slower than through merged weights (docs/models.md), so the engine keeps a
plain `transformers` copy of the base and, on every weight update, receives only the adapter
tensors (an `AdapterUpdate`: A, B and the scaling of each targeted Linear) and writes

    W = W0 + scaling * B @ A

into its copy. `LoraMerger` keeps W0 for the targeted weights only (a fraction of the model), so
each update is computed from the base, never from the previous merge: repeated updates do not
accumulate, and rounding does not drift.

The record lives here, in `rollout`, because both layers use it: the learner builds it and the
engines (in-process, or on Ray rollout workers: it pickles) apply it. It needs no peft.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class LoraDelta:
    """One targeted Linear's adapter: its weight becomes W0 + scaling * b @ a."""

    module: str  # the module's path in the plain model, e.g. "model.layers.0.self_attn.q_proj"
    a: torch.Tensor  # (r, in_features)
    b: torch.Tensor  # (out_features, r)
    scaling: float  # alpha / r (alpha / sqrt(r) with rsLoRA)


@dataclass(frozen=True)
class AdapterUpdate:
    """What a LoRA weight update sends: the adapters only (picklable; tensors on any device)."""

    deltas: tuple[LoraDelta, ...]

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(d.module for d in self.deltas)

    def numel(self) -> int:
        return sum(d.a.numel() + d.b.numel() for d in self.deltas)

    def nbytes(self) -> int:
        """Tensor bytes on the wire (the scalings and names are a few bytes more)."""
        return sum(d.a.numel() * d.a.element_size() + d.b.numel() * d.b.element_size() for d in self.deltas)

    def to(self, device: str | torch.device) -> AdapterUpdate:
        """A copy with every tensor on `device` (CPU before pickling to Ray workers)."""
        return AdapterUpdate(
            tuple(
                LoraDelta(d.module, d.a.detach().to(device), d.b.detach().to(device), d.scaling)
                for d in self.deltas
            )
        )


class LoraMergeError(ValueError):
    """An adapter update does not fit the engine's model (wrong module name or shape)."""


class LoraMerger:
    """Applies `AdapterUpdate`s to a plain model in place, from the base weights W0.

    W0 of a module is captured the first time an update names it, so the model must hold the
    base weights then (the engine's copy is made before any adapter is trained). Memory: one
    copy of each targeted weight, in the model's dtype.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._base: dict[str, torch.Tensor] = {}  # module path -> W0

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(self._base)

    @torch.no_grad()
    def apply(self, update: AdapterUpdate) -> None:
        """Write W0 + scaling * B @ A into every module the update names (fp32 arithmetic, then
        the weight's own dtype: a bf16 engine copy gets one rounding per update, not a sum of them)."""
        linears = {d.module: self._linear(d) for d in update.deltas}  # check all before writing any
        for d in update.deltas:
            weight = linears[d.module].weight
            if d.module not in self._base:
                self._base[d.module] = weight.detach().clone()
            w0 = self._base[d.module]
            delta = d.b.to(weight.device, torch.float32) @ d.a.to(weight.device, torch.float32)
            weight.copy_((w0.float() + d.scaling * delta).to(weight.dtype))

    def _linear(self, d: LoraDelta) -> nn.Linear:
        try:
            module = self.model.get_submodule(d.module)
        except AttributeError:
            raise LoraMergeError(
                f"adapter for {d.module!r}, which the engine's model does not have: the engine must "
                "hold a plain copy of the same base the learner wraps"
            ) from None
        if not isinstance(module, nn.Linear):
            raise LoraMergeError(f"adapter for {d.module!r}, a {type(module).__name__}: only Linear merges")
        want = (module.out_features, module.in_features)
        got = (d.b.shape[0], d.a.shape[1])
        if d.a.dim() != 2 or d.b.dim() != 2 or d.b.shape[1] != d.a.shape[0] or got != want:
            raise LoraMergeError(
                f"adapter for {d.module!r} has A {tuple(d.a.shape)}, B {tuple(d.b.shape)}; "
                f"the weight is {want} (out, in)"
            )
        return module


def load_update(
    model: torch.nn.Module, update: Mapping[str, torch.Tensor] | AdapterUpdate, merger: LoraMerger | None
) -> LoraMerger | None:
    """New weights into an engine's plain `model`: a full state dict replaces them (no merger
    after it: later adapters merge into these), an `AdapterUpdate` is merged from W0 by `merger`
    (made at the first one). Returns the merger the engine keeps."""
    if isinstance(update, AdapterUpdate):
        merger = merger if merger is not None else LoraMerger(model)
        merger.apply(update)
        return merger
    model.load_state_dict(update)
    return None


__all__ = ["AdapterUpdate", "LoraDelta", "LoraMergeError", "LoraMerger", "load_update"]
