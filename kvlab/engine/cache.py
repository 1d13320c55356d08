"""The caches kvlab builds: ``new_cache`` for plain prefills, ``slot_cache`` for a policy's state.

Every layer keeps every key it is given, including on a model's sliding-window layers: the
attention function applies each layer's window itself, and a ``KVState`` drops keys that have
left a window through its ``SlotLayer``s. A cache built from the config instead would drop them
inside transformers, behind the bookkeeping's back.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import Callable, Sequence

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


@dataclass(frozen=True)
class SlotField:
    """One piece of per-slot metadata: its dtype, what a newly recorded slot holds (None: ``record`` gives it)
    and what a padding slot holds."""

    dtype: torch.dtype
    fresh: float | bool | None
    pad: float | bool


# Every per-slot field of a ``SlotLayer``, each [kv_heads, slots]. Cuts, snapshots, padding and ``record``
# read this one table, so a new field is one line here.
SLOT_FIELDS: dict[str, SlotField] = {
    "positions": SlotField(torch.long, None, -1),  # the token's original position
    "rope_positions": SlotField(torch.long, None, -1),  # the position its key is rotated to
    "accumulated": SlotField(torch.float32, 0.0, 0.0),  # attention it has received (H2O)
    "reconstruction": SlotField(torch.float32, 0.0, 0.0),  # the most attention a repeat query gave it (KVzip)
    "key_quantized": SlotField(torch.bool, False, False),  # KIVI: the key is stored quantized
    "value_quantized": SlotField(torch.bool, False, False),  # KIVI: the value is stored quantized
    "real": SlotField(torch.bool, True, False),  # False: padding of a head that holds fewer keys than another
}


@dataclass(frozen=True)
class PageExtremes:
    """The element-wise min and max key of each complete page of a layer's first keys (Quest's page metadata).

    It describes the keys tensor it was taken from, ``source``, and no other: appends and truncations that
    keep its pages carry it over to the layer's new keys tensor; any other change of the keys leaves it
    describing a tensor the layer no longer holds, so its owner takes it again from the keys. Its tensors
    are replaced, never changed in place: a snapshot holds it as it was.
    """

    source: weakref.ref  # the keys [1, kv_heads, slots, head_dim] it was taken from
    page_size: int
    low: torch.Tensor  # [kv_heads, pages, head_dim] float32
    high: torch.Tensor  # [kv_heads, pages, head_dim] float32

    @property
    def slots(self) -> int:
        """The first keys it covers: its complete pages' slots."""
        return self.low.shape[1] * self.page_size

    def describes(self, keys: torch.Tensor | None) -> bool:
        """Whether it was taken from ``keys`` (the very tensor)."""
        return keys is not None and self.source() is keys

    def moved_to(self, keys: torch.Tensor) -> "PageExtremes":
        """Its pages that ``keys`` holds, describing ``keys``: a tensor whose first keys are its source's."""
        pages = min(self.low.shape[1], keys.shape[-2] // self.page_size)
        return replace(self, source=weakref.ref(keys), low=self.low[:, :pages], high=self.high[:, :pages])


def _gather(t: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """``t`` gathered along its slot axis ``dim`` by ``index`` [kv_heads, kept] (the axis before ``dim`` is heads)."""
    shape = [1] * (dim - 1) + list(index.shape) + [1] * (t.ndim - dim - 1)
    return t.gather(dim, index.view(shape).expand(*t.shape[: dim - 1], *index.shape, *t.shape[dim + 1 :]))


class SlotLayer(DynamicLayer):
    """One layer of a policy's cache: its keys and values and, per slot, where the token came from.

    ``keys``/``values`` are [1, kv_heads, slots, head_dim]; the fields of ``SLOT_FIELDS`` are
    [kv_heads, slots]. Keys the model writes during a forward are uncommitted until ``record`` gives
    them their metadata; every cut goes through ``take``, ``keep``, ``drop_before`` or ``truncate``,
    which move keys, values and every field together, so they cannot disagree once recorded. Tensors
    are replaced, never changed in place, so ``state`` is a cheap snapshot.

    Heads may hold different numbers of keys (``keep``): a head with fewer is padded on the left, so
    every head's newest keys end the layer. Padding slots hold zero keys and values and the ``pad``
    value of every field (``real`` False, position −1); attention masks them and bytes do not count them.

    ``pages`` is the page min and max of sparse reads (Quest), set by their owner; it stays valid across
    appends and truncations (which keep the pages they leave whole), and is part of a snapshot.
    """

    def __init__(self, kv_heads: int, device: torch.device) -> None:
        super().__init__()
        for name, f in SLOT_FIELDS.items():
            setattr(self, name, torch.zeros(kv_heads, 0, dtype=f.dtype, device=device))
        self.pages: PageExtremes | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new keys and values (transformers' concatenation); the page extremes carry over."""
        old = self.keys
        out = super().update(key_states, value_states, *args, **kwargs)
        if self.pages is not None and self.pages.describes(old):
            self.pages = self.pages.moved_to(self.keys)
        return out

    @property
    def held(self) -> int:
        """Committed slots."""
        return self.positions.shape[-1]

    def record(self, original: torch.Tensor, rope: torch.Tensor, sums: torch.Tensor | None = None) -> None:
        """Commit the newest ``len(original)`` keys: their original and rotary positions [n] and, for
        H2O, this forward's attention column sums over every slot [kv_heads, held + n]."""
        heads, n = self.positions.shape[0], original.shape[0]
        if sums is not None:
            self.accumulated = self.accumulated + sums[:, : self.held]
        given = {"positions": original.expand(heads, n), "rope_positions": rope.expand(heads, n),
                 "accumulated": None if sums is None else sums[:, self.held :]}
        for name, f in SLOT_FIELDS.items():
            old = getattr(self, name)
            new = given.get(name)
            if new is None:
                new = torch.full((heads, n), f.fresh, dtype=f.dtype, device=old.device)
            setattr(self, name, torch.cat([old, new.to(f.dtype)], dim=-1))

    def rescore(self, name: str, chosen: torch.Tensor, scores: torch.Tensor) -> None:
        """Set field ``name`` to ``scores`` [kv_heads, slots] at the ``chosen`` slots [kv_heads, slots] (bool),
        leaving the others; a new tensor, so snapshots keep the old scores."""
        old = getattr(self, name)
        setattr(self, name, torch.where(chosen, scores.to(old.dtype), old))

    def _cut(self, cut: Callable[[torch.Tensor, int], torch.Tensor]) -> None:
        """Apply one cut along the slot axis (axis 2 of keys and values, 1 of every field) to all of them."""
        self.keys, self.values = cut(self.keys, 2), cut(self.values, 2)
        for name in SLOT_FIELDS:
            setattr(self, name, cut(getattr(self, name), 1))

    def take(self, index: torch.Tensor) -> None:
        """Keep slots ``index`` [kv_heads, kept] (ascending per head), drop the rest."""
        self._cut(lambda t, dim: _gather(t, dim, index))

    def keep(self, keep: torch.Tensor) -> None:
        """Keep the real slots of ``keep`` [kv_heads, slots] (bool; any number per head), drop the rest.

        The layer narrows to its fullest head; a head keeping fewer is padded on its left.
        """
        keep = keep & self.real
        slots, width = keep.shape[-1], int(keep.sum(-1).max())
        rank = keep.long() * slots + torch.arange(slots, device=keep.device)  # dropped slots first, each in slot order
        index = rank.argsort(dim=-1)[:, slots - width :]  # [kv_heads, width]: some dropped slots, then the kept
        self.take(index)
        self.pad(keep.gather(1, index))

    def pad(self, real: torch.Tensor) -> None:
        """Turn the slots outside ``real`` [kv_heads, slots] into padding: zero keys and values, ``pad`` fields."""
        if bool(real.all()):
            return
        hole = ~real[None, :, :, None]  # [1, kv_heads, slots, 1]
        self.keys, self.values = self.keys.masked_fill(hole, 0), self.values.masked_fill(hole, 0)
        for name, f in SLOT_FIELDS.items():
            setattr(self, name, getattr(self, name).masked_fill(~real, f.pad))

    def head_lengths(self) -> torch.Tensor:
        """[kv_heads] keys each head really holds (padding not counted)."""
        return self.real.sum(-1)

    @property
    def uneven(self) -> bool:
        """Whether some head holds padding (fewer keys than another)."""
        return not bool(self.real.all())

    def drop_before(self, start: int) -> None:
        """Drop the first ``start`` slots of every head."""
        self._cut(lambda t, dim: t.narrow(dim, start, t.shape[dim] - start))

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` slots: drops uncommitted keys, and committed ones past ``n``."""
        if self.keys is None:  # never written
            return
        old = self.keys
        self._cut(lambda t, dim: t.narrow(dim, 0, min(n, t.shape[dim])))
        if self.pages is not None and self.pages.describes(old):  # the pages the cut keeps whole stay
            self.pages = self.pages.moved_to(self.keys)

    def state(self) -> dict:
        """Everything ``load`` needs; cheap, because tensors are replaced, never changed in place."""
        return {name: getattr(self, name) for name in ("keys", "values", "is_initialized", "pages", *SLOT_FIELDS)}

    def load(self, state: dict) -> None:
        """Return to a ``state``."""
        for name, value in state.items():
            setattr(self, name, value)


def slot_cache(lm: LoadedModel) -> DynamicCache:
    """An empty cache of ``SlotLayer``s, one per layer of ``lm``: a policy's cache."""
    cache = DynamicCache()
    cache.layers.extend(SlotLayer(lm.facts.n_kv_heads, lm.device) for _ in range(lm.facts.n_layers))
    return cache
