"""The LM head as the learner and the engine both apply it: hidden states -> fp32 logits.

One function for both sides, so that a bf16 model's sampled-token log-probs are computed the same
way where they are sampled (the engine) and where they are trained (the learner).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def head_logits(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """hidden (N, H) -> fp32 logits (N, V), as the model's forward makes them (soft-cap included).

    fp32 weights even for a bf16 model: the engine (a bf16 engine samples from these) and the
    learner compute the same fp32 log-probs.
    """
    hf: Any = model  # a transformers model, a peft wrapper or anything exposing the same two
    head = hf.get_output_embeddings()
    cap = getattr(text_config(model), "final_logit_softcapping", None)  # Gemma 2/3: cap * tanh(z / cap)
    if isinstance(head, nn.Linear):

        def linear(h: torch.Tensor) -> torch.Tensor:
            # .float() is the parameter itself for fp32 models; a bf16 head is cast per call so
            # each recompute in the backward builds its own graph to the parameter
            bias = head.bias.float() if head.bias is not None else None
            return F.linear(h.float(), head.weight.float(), bias)
    else:  # e.g. a peft LoRA layer on lm_head: only its own forward knows the adapter

        def linear(h: torch.Tensor) -> torch.Tensor:
            return head(h).float()

    def logits(h: torch.Tensor) -> torch.Tensor:
        z = linear(h)
        return torch.tanh(z / cap) * cap if cap else z

    return logits


def text_config(model: nn.Module) -> Any:
    """The language model's config (a multimodal config keeps it under `text_config`)."""
    cfg: Any = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


class GenerationHead:
    """`head_logits` for generation (no graph), for an engine whose head is not fp32: the fp32
    copy of the head's weight is kept while the weight is unchanged, since the engine calls it at
    every decode step (Gemma 3's 262,144 x 640 head is 671 MB in fp32). Any in-place change
    (a weight update, a LoRA merge, an optimizer step on a shared model) bumps the tensor's
    version counter, and a moved or recast weight is another tensor: either makes a new copy."""

    def __init__(self, model: nn.Module) -> None:
        hf: Any = model
        self.head = hf.get_output_embeddings()
        self.cap = getattr(text_config(model), "final_logit_softcapping", None)
        self.fallback = None if isinstance(self.head, nn.Linear) else head_logits(model)
        self._of: tuple[Any, ...] = ()  # the tensors the copy was made of, and their versions
        self._weight: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None

    @torch.no_grad()
    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if self.fallback is not None:  # a head with its own forward (a peft layer)
            return self.fallback(h)
        w, b = self.head.weight, self.head.bias
        of = (w, w._version, b, None if b is None else b._version)
        stale = not self._of or self._of[0] is not w or self._of[2] is not b or self._of[1::2] != of[1::2]
        if stale:
            self._weight, self._bias, self._of = w.float(), (None if b is None else b.float()), of
        assert self._weight is not None
        z = F.linear(h.float(), self._weight, self._bias)
        return torch.tanh(z / self.cap) * self.cap if self.cap else z
