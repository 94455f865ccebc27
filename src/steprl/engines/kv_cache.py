"""The engine's KV cache: preallocated per layer, written in place.

transformers' `DynamicLayer` grows by `torch.cat` at every decode step, which copies the whole
cache each token: at the default demo's shape that copy was over half of a decode step's time
(measured in `docs/performance.md`). `GrowingLayer` keeps a buffer with room to spare (doubling
when full) and returns views of its filled part, so a decode step writes one column per layer.
The values are the ones `torch.cat` would hold; only where they live changes.

Only plain full-attention layers are replaced; any other layer type a model's config asks for
(sliding windows, linear attention) keeps transformers' own class.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views of a buffer grown by doubling."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._k = key_states.new_empty((*key_states.shape[:2], 0, key_states.shape[-1]))
        self._v = value_states.new_empty((*value_states.shape[:2], 0, value_states.shape[-1]))
        self._n = 0
        self.keys, self.values = self._k, self._v
        self.is_initialized = True

    def preload(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Start from stored keys and values (B, kv_heads, L, head_dim) instead of empty."""
        self.device = keys.device
        n = keys.shape[-2]
        self._k = keys.new_empty((*keys.shape[:2], n + max(32, n // 2), keys.shape[-1]))
        self._v = values.new_empty((*values.shape[:2], n + max(32, n // 2), values.shape[-1]))
        self._k[..., :n, :], self._v[..., :n, :], self._n = keys, values, n
        self.keys, self.values = self._k[..., :n, :], self._v[..., :n, :]
        self.is_initialized = True

    def drop_left(self, n: int) -> None:
        """Forget the first `n` columns (no row reads them any more)."""
        self._k, self._v, self._n = self._k[..., n:, :], self._v[..., n:, :], self._n - n
        self.keys, self.values = self._k[..., : self._n, :], self._v[..., : self._n, :]

    def _reserve(self, needed: int) -> None:
        cap = self._k.shape[-2]
        if needed <= cap:
            return
        cap = max(needed, 2 * cap, 32)
        k = self._k.new_empty((*self._k.shape[:2], cap, self._k.shape[-1]))
        v = self._v.new_empty((*self._v.shape[:2], cap, self._v.shape[-1]))
        k[..., : self._n, :] = self._k[..., : self._n, :]
        v[..., : self._n, :] = self._v[..., : self._n, :]
        self._k, self._v = k, v

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        self._reserve(self._n + q)
        self._k[..., self._n : self._n + q, :] = key_states
        self._v[..., self._n : self._n + q, :] = value_states
        self._n += q
        self.keys, self.values = self._k[..., : self._n, :], self._v[..., : self._n, :]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._n if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0 and self.is_initialized:
            self._n = max(0, self._n + tokens_to_remove)
            self.keys, self.values = self._k[..., : self._n, :], self._v[..., : self._n, :]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:  # copies the filled columns only; the spare room stays
            k, v = (
                self._k.new_empty((len(indices), *self._k.shape[1:])),
                self._v.new_empty((len(indices), *self._v.shape[1:])),
            )
            k[..., : self._n, :] = self._k[indices, :, : self._n]
            v[..., : self._n, :] = self._v[indices, :, : self._n]
            self._k, self._v = k, v
            self.keys, self.values = self._k[..., : self._n, :], self._v[..., : self._n, :]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._k = self._k.repeat_interleave(repeats, dim=0)
            self._v = self._v.repeat_interleave(repeats, dim=0)
            self.keys, self.values = self._k[..., : self._n, :], self._v[..., : self._n, :]

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False


def engine_cache(model: torch.nn.Module) -> DynamicCache:
    """An empty cache for `model`: its config's layer types, full-attention ones as `GrowingLayer`."""
    config: Any = model.config
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    if cache.layer_class_to_replicate is DynamicLayer:  # a config without layer types: made lazily
        cache.layer_class_to_replicate = GrowingLayer
    return cache


def preloadable(cache: DynamicCache) -> bool:
    """True when every layer of `cache` is a `GrowingLayer` (stored prefixes can be loaded)."""
    return bool(cache.layers) and all(type(layer) is GrowingLayer for layer in cache.layers)
