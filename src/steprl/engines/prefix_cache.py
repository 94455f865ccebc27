"""KV entries kept across the turns of a trajectory, so a turn prefills only what is new.

After a generation the engine stores, per row, the keys and values of `prompt + action[:-1]`
(the last sampled token was never fed back). An append-only agent loop's next prompt is that
plus the last action token and the observation, so the next request finds the entry by its
prefix and prefills only those few tokens, where HF `generate` per turn (and this engine
before) re-prefilled the whole context every turn.

An entry is taken out when it is used (the trajectory stores a longer one after its turn), all
are dropped when the weights change (their keys and values were made by the old ones), and the
oldest go first once their total size passes the budget. Values are the same as a fresh
prefill's up to float rounding (~1e-7 on CPU): the batched attention sums in another order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

#: per model layer: (keys, values), each (kv_heads, length, head_dim)
RowKV = tuple[tuple[torch.Tensor, torch.Tensor], ...]


class PrefixCache:
    """LRU of token-id prefix -> its KV, bounded in bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], RowKV] = OrderedDict()
        self._lengths: dict[int, int] = {}  # entry length -> how many entries have it
        self.bytes = 0
        self.hits = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _size(kv: RowKV) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)

    def put(self, ids: tuple[int, ...], kv: RowKV) -> None:
        if not ids or self.max_bytes <= 0:
            return
        self._drop(ids)
        self._entries[ids] = kv
        self._lengths[len(ids)] = self._lengths.get(len(ids), 0) + 1
        self.bytes += self._size(kv)
        while self.bytes > self.max_bytes and self._entries:
            self._drop(next(iter(self._entries)))

    def take(self, prompt: Sequence[int]) -> tuple[int, RowKV] | None:
        """The longest stored proper prefix of `prompt` (removed from the cache) and its length."""
        p = tuple(prompt)
        for n in sorted(self._lengths, reverse=True):
            if n < len(p) and p[:n] in self._entries:
                kv = self._entries[p[:n]]
                self._drop(p[:n])
                self.hits += 1
                self.reused_tokens += n
                return n, kv
        return None

    def _drop(self, ids: tuple[int, ...]) -> None:
        kv = self._entries.pop(ids, None)
        if kv is None:
            return
        self.bytes -= self._size(kv)
        self._lengths[len(ids)] -= 1
        if not self._lengths[len(ids)]:
            del self._lengths[len(ids)]

    def clear(self) -> None:
        self._entries.clear()
        self._lengths.clear()
        self.bytes = 0
