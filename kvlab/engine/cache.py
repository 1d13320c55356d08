"""The caches kvlab builds: ``new_cache`` for plain prefills, ``slot_cache`` for a policy's state.

Every layer keeps every key it is given, including on a model's sliding-window layers: the
attention function applies each layer's window itself, and a ``KVState`` drops keys that have
left a window through its ``SlotLayer``s. A cache built from the config instead would drop them
inside transformers, behind the bookkeeping's back.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvlab.engine.facts import LoadedModel


def new_cache(lm: LoadedModel) -> DynamicCache:
    """An empty cache with one full ``DynamicLayer`` per layer of ``lm``."""
    cache = DynamicCache()
    cache.layers.extend(DynamicLayer() for _ in range(lm.facts.n_layers))
    return cache


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token-id sequences: how many tokens of ``b`` a cache
    of ``a`` holds exactly as a prefill of ``b`` would (causal attention never looks past them)."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


def cropped(lm: LoadedModel, cache: DynamicCache, tokens: int) -> DynamicCache:
    """A new cache holding the first ``tokens`` positions of ``cache`` (which stays untouched)."""
    out = new_cache(lm)
    for idx, layer in enumerate(cache.layers):
        out.update(layer.keys[:, :, :tokens], layer.values[:, :, :tokens], idx)  # [b, kv, tokens, d]
    return out


class SlotLayer(DynamicLayer):
    """One layer of a policy's cache: its keys and values and, per slot, where the token came from.

    ``keys``/``values`` are [1, kv_heads, slots, head_dim]; ``positions`` (the token's original
    position), ``rope_positions`` (the position its key is rotated to), ``accumulated`` (attention
    it has received, for H2O) and ``key_quantized``/``value_quantized`` (stored at KIVI's bits)
    are [kv_heads, slots]. Keys the model writes during a forward are
    uncommitted until ``record`` gives them their metadata; every cut goes through ``take``,
    ``drop_before`` or ``truncate``, which move keys, values and metadata together, so they cannot
    disagree once recorded.
    """

    def __init__(self, kv_heads: int, device: torch.device) -> None:
        super().__init__()
        self.positions = torch.zeros(kv_heads, 0, dtype=torch.long, device=device)
        self.rope_positions = self.positions.clone()
        self.accumulated = self.positions.float()
        self.key_quantized = self.positions.bool()  # KIVI: the slot's key / value is stored quantized
        self.value_quantized = self.positions.bool()

    @property
    def held(self) -> int:
        """Committed slots."""
        return self.positions.shape[-1]

    def record(self, original: torch.Tensor, rope: torch.Tensor, sums: torch.Tensor | None = None) -> None:
        """Commit the newest ``len(original)`` keys: their original and rotary positions [n] and, for
        H2O, this forward's attention column sums over every slot [kv_heads, held + n]."""
        heads, n = self.positions.shape[0], original.shape[0]
        if sums is not None:
            self.accumulated = torch.cat([self.accumulated + sums[:, : self.held], sums[:, self.held :]], dim=-1)
        self.positions = torch.cat([self.positions, original.expand(heads, n)], dim=-1)
        self.rope_positions = torch.cat([self.rope_positions, rope.expand(heads, n)], dim=-1)
        fresh = self.key_quantized.new_zeros(heads, n)
        self.key_quantized = torch.cat([self.key_quantized, fresh], dim=-1)
        self.value_quantized = torch.cat([self.value_quantized, fresh], dim=-1)

    def take(self, index: torch.Tensor) -> None:
        """Keep slots ``index`` [kv_heads, kept] (ascending per head), drop the rest."""
        gather = index[None, :, :, None].expand(1, -1, -1, self.keys.shape[-1])
        self.keys, self.values = self.keys.gather(2, gather), self.values.gather(2, gather)
        self.positions, self.rope_positions = self.positions.gather(1, index), self.rope_positions.gather(1, index)
        self.key_quantized = self.key_quantized.gather(1, index)
        self.value_quantized = self.value_quantized.gather(1, index)
        if self.accumulated.shape[-1]:
            self.accumulated = self.accumulated.gather(1, index)

    def drop_before(self, start: int) -> None:
        """Drop the first ``start`` slots of every head."""
        self.keys, self.values = self.keys[..., start:, :], self.values[..., start:, :]
        self.positions, self.rope_positions = self.positions[:, start:], self.rope_positions[:, start:]
        self.accumulated = self.accumulated[:, start:]
        self.key_quantized, self.value_quantized = self.key_quantized[:, start:], self.value_quantized[:, start:]

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` slots: drops uncommitted keys, and committed ones past ``n``."""
        if self.keys is None:  # never written
            return
        self.keys, self.values = self.keys[..., :n, :], self.values[..., :n, :]
        self.positions, self.rope_positions = self.positions[:, :n], self.rope_positions[:, :n]
        self.accumulated = self.accumulated[:, :n]
        self.key_quantized, self.value_quantized = self.key_quantized[:, :n], self.value_quantized[:, :n]

    def state(self) -> tuple:
        """Everything ``load`` needs; cheap, because tensors are replaced, never changed in place."""
        return (self.keys, self.values, self.is_initialized, self.positions, self.rope_positions, self.accumulated,
                self.key_quantized, self.value_quantized)

    def load(self, state: tuple) -> None:
        (self.keys, self.values, self.is_initialized, self.positions, self.rope_positions, self.accumulated,
         self.key_quantized, self.value_quantized) = state


def slot_cache(lm: LoadedModel) -> DynamicCache:
    """An empty cache of ``SlotLayer``s, one per layer of ``lm``: a policy's cache."""
    cache = DynamicCache()
    cache.layers.extend(SlotLayer(lm.facts.n_kv_heads, lm.device) for _ in range(lm.facts.n_layers))
    return cache
