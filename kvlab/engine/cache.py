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
from kvlab.engine.packed import PackedKV, slot_rows
from kvlab.engine.room import Room
from kvlab.engine.sparse import head_rows


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
    "key_group": SlotField(torch.long, -1, -1),  # KIVI: the packed key's group (its min and max); -1: not packed
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
        if pages < self.low.shape[1]:
            return PageExtremes(weakref.ref(keys), self.page_size, self.low[:, :pages], self.high[:, :pages])
        return PageExtremes(weakref.ref(keys), self.page_size, self.low, self.high)


def _gather(t: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """``t`` gathered along its slot axis ``dim`` by ``index`` [kv_heads, kept] (the axis before ``dim`` is heads).

    A field [kv_heads, slots] takes the index as it is; keys and values [1, kv_heads, slots, d] whole rows
    (``head_rows``: one row copy per slot, where a gather reads an index per element, 2–3× slower).
    """
    if t.ndim == index.ndim:
        return t.gather(dim, index)
    if t.ndim == 4 and dim == 2 and t.shape[0] == 1:
        return head_rows(t[0], index)
    shape = [1] * (dim - 1) + list(index.shape) + [1] * (t.ndim - dim - 1)
    return t.gather(dim, index.view(shape).expand(*t.shape[: dim - 1], *index.shape, *t.shape[dim + 1 :]))


class SlotLayer(DynamicLayer):
    """One layer of a policy's cache: its keys and values and, per slot, where the token came from.

    ``keys``/``values`` are [1, kv_heads, slots, head_dim]; the fields of ``SLOT_FIELDS`` are
    [kv_heads, slots]. Keys the model writes during a forward are uncommitted until ``record`` gives
    them their metadata; every cut goes through ``take``, ``keep``, ``drop_before`` or ``truncate``,
    which move keys, values and every field together, so they cannot disagree once recorded. Tensors
    are replaced, never changed in place (an append writes past the end of every view: ``Room``), so ``state``
    is a cheap snapshot.

    Heads may hold different numbers of keys (``keep``): a head with fewer is padded on the left, so
    every head's newest keys end the layer. Padding slots hold zero keys and values and the ``pad``
    value of every field (``real`` False, position −1); attention masks them and bytes do not count them.

    Under KIVI (``packed`` set by ``Kivi.quantize``) the layer holds its first ``packed.slots`` slots as
    packed codes, mins and maxes and full-precision rows, and only the slots after them as tensors
    (``_keys``/``_values``: new keys until they are packed). ``keys``/``values`` are then built when read,
    decoded and joined to those (KIVI's own non-fused path dequantizes the same way for each forward);
    the layer keeps no full-precision copy of a packed slot between reads.

    ``pages`` is the page min and max of sparse reads (Quest), set by their owner; it stays valid across
    appends and truncations (which keep the pages they leave whole), and is part of a snapshot.
    """

    def __init__(self, kv_heads: int, device: torch.device) -> None:
        self.packed: PackedKV | None = None
        self._room: Room | None = None
        self._uneven: bool | None = None  # whether ``real`` holds padding, once asked; None: not known
        super().__init__()
        for name, f in SLOT_FIELDS.items():
            setattr(self, name, torch.zeros(kv_heads, 0, dtype=f.dtype, device=device))
        self.pages: PageExtremes | None = None

    @property
    def keys(self) -> torch.Tensor | None:
        """[1, kv_heads, slots, head_dim]; decoded from ``packed`` where the layer holds one."""
        if self.packed is None:
            return self._keys
        return torch.cat([self.packed.keys(self)[None], self._keys], dim=2)

    @keys.setter
    def keys(self, keys: torch.Tensor | None) -> None:
        if self.packed is not None:
            self._rewrite(keys, self.values)
        else:
            self._keys = keys

    @property
    def values(self) -> torch.Tensor | None:
        """[1, kv_heads, slots, head_dim], as ``keys``."""
        if self.packed is None:
            return self._values
        return torch.cat([self.packed.values(self)[None], self._values], dim=2)

    @values.setter
    def values(self, values: torch.Tensor | None) -> None:
        if self.packed is not None:
            self._rewrite(self.keys, values)
        else:
            self._values = values

    def _rewrite(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Give a packed layer new keys and values [1, kv_heads, slots, head_dim] (a rotation of its keys): a
        packed key that changed is no longer on its group's grid, so it leaves the store as a full-precision row.
        Packed values are never rewritten (only a full cache's are copied, ``KVState.copy_cache``)."""
        self.absorb()
        n = self.packed.slots
        old_keys, old_values = self.packed.keys(self), self.packed.values(self)  # [kv_heads, slots, head_dim]
        if not torch.equal(values[0, :, :n][self.value_quantized[:, :n]], old_values[self.value_quantized[:, :n]]):
            raise ValueError("a packed value cannot be rewritten")
        moved = (keys[0, :, :n] != old_keys).any(-1) & (self.key_group[:, :n] >= 0)  # [kv_heads, slots]
        tables = self.packed.row_tables(self)
        self.key_group = self.key_group.masked_fill(moved, -1)
        full, _, v_full, _ = self.packed.masks(self, n)
        tables[0], tables[2] = slot_rows(full), slot_rows(v_full)  # the full rows are written anew
        rows = replace(self.packed, key_full=keys[0, :, :n].transpose(0, 1)[full.T],
                       value_full=values[0, :, :n].transpose(0, 1)[v_full.T])
        self.packed, self.key_group = rows.picked(tables, self)
        self._keys, self._values = keys[:, :, n:], values[:, :, n:]

    @property
    def head_dim(self) -> int:
        return self._keys.shape[-1]

    @property
    def real(self) -> torch.Tensor:
        """[kv_heads, slots] bool: False at a head's padding."""
        return self._real

    @real.setter
    def real(self, real: torch.Tensor) -> None:
        self._real, self._uneven = real, None

    def absorb(self, bits: int | None = None, group: int = 1) -> None:
        """Move the committed slots held as tensors into the packed store; an unpacked layer starts one at
        ``bits`` bits in groups of ``group`` (``bits`` None: it stays unpacked)."""
        if self.packed is None:
            if bits is None:
                return
            self.packed = PackedKV.empty(bits, group, self._keys)
        n = self.held - self.packed.slots
        if n == 0:
            return
        real = self.real[:, self.packed.slots : self.held]
        self.packed = self.packed.appended(self._keys[0, :, :n], self._values[0, :, :n], real)
        self._keys, self._values = self._keys[:, :, n:], self._values[:, :, n:]

    def packed_bytes(self) -> int:
        """Bytes of the tensors holding a packed layer's committed slots: its store, and any full-precision
        slots after it."""
        after = self.held - self.packed.slots
        return self.packed.nbytes + after * (self._keys[:, :, :1].nbytes + self._values[:, :, :1].nbytes)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append a forward's new keys and values [1, kv_heads, n, head_dim]; returns every key and value. An
        unpacked layer writes them into its room (a new one, with the held keys copied, where it has none or it is
        full); the page extremes carry over."""
        if self.packed is not None:
            self._keys = torch.cat([self._keys, key_states], dim=-2)
            self._values = torch.cat([self._values, value_states], dim=-2)
            return self.keys, self.values
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        old, old_values = self._keys, self._values
        end = (old.shape[-2] if old.ndim == 4 else 0) + key_states.shape[-2]
        room = self._room
        if room is None or not room.holds(old, old_values) or end > room.keys.shape[-2]:
            room = self._room = Room.around(old, old_values, key_states, end)
        room.keys[:, :, room.end : end], room.values[:, :, room.end : end] = key_states, value_states
        room.end = end
        self._keys, self._values = room.keys[:, :, :end], room.values[:, :, :end]
        if self.pages is not None and self.pages.describes(old):
            self.pages = self.pages.moved_to(self._keys)
        return self._keys, self._values

    def get_seq_length(self) -> int:
        """Slots held, packed ones included (without decoding them)."""
        if not self.is_initialized or self._keys is None:
            return 0
        return (self.packed.slots if self.packed is not None else 0) + self._keys.shape[-2]

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
        uneven = self._uneven  # every head gains the same real slots: padding stays as it was
        for name, f in SLOT_FIELDS.items():
            old = getattr(self, name)
            new = given.get(name)
            if new is None:
                new = torch.full((heads, n), f.fresh, dtype=f.dtype, device=old.device)
            setattr(self, name, torch.cat([old, new.to(f.dtype)], dim=-1))
        self._uneven = uneven

    def rescore(self, name: str, chosen: torch.Tensor, scores: torch.Tensor) -> None:
        """Set field ``name`` to ``scores`` [kv_heads, slots] at the ``chosen`` slots [kv_heads, slots] (bool),
        leaving the others; a new tensor, so snapshots keep the old scores."""
        old = getattr(self, name)
        setattr(self, name, torch.where(chosen, scores.to(old.dtype), old))

    def _cut(self, cut: Callable[[torch.Tensor, int], torch.Tensor]) -> None:
        """Apply one cut along the slot axis (axis 2 of keys and values, 1 of every field) to all of them.

        A packed layer cuts its store's rows with its slots; a cut key group keeps its min and max while
        one of its keys stays."""
        even = self._uneven is False  # a cut of real slots only keeps real slots only
        if self.packed is None:
            self.keys, self.values = cut(self.keys, 2), cut(self.values, 2)
        else:
            self.absorb()
            if self._keys.shape[-2]:
                raise ValueError("a packed layer is cut between forwards, with no uncommitted keys")
            tables = cut(self.packed.row_tables(self), 2)  # [4, kv_heads, kept]
        for name in SLOT_FIELDS:
            setattr(self, name, cut(getattr(self, name), 1))
        if self.packed is not None:
            self.packed, self.key_group = self.packed.picked(tables, self)
        if even:
            self._uneven = False

    def take(self, index: torch.Tensor) -> None:
        """Keep slots ``index`` [kv_heads, kept] (ascending per head), drop the rest."""
        self._cut(lambda t, dim: _gather(t, dim, index))

    def keep(self, keep: torch.Tensor) -> None:
        """Keep the real slots of ``keep`` [kv_heads, slots] (bool; any number per head), drop the rest.

        The layer narrows to its fullest head; a head keeping fewer is padded on its left.
        """
        keep = keep & self.real
        counts = keep.sum(-1).tolist()  # per KV head
        heads, slots, width = keep.shape[0], keep.shape[-1], max(counts)
        if min(counts) == width:  # as many in every head: no padding
            self.take(keep.nonzero()[:, 1].view(heads, width))
            self._uneven = False  # known from the counts: no read of the new mask
            return
        rank = keep.long() * slots + torch.arange(slots, device=keep.device)  # dropped slots first, each in slot order
        index = rank.argsort(dim=-1)[:, slots - width :]  # [kv_heads, width]: some dropped slots, then the kept
        self.take(index)
        self.pad(keep.gather(1, index))

    def pad(self, real: torch.Tensor) -> None:
        """Turn the slots outside ``real`` [kv_heads, slots] (some slot is outside) into padding: zero keys and values,
        ``pad`` fields."""
        tables = None
        if self.packed is None:
            hole = ~real[None, :, :, None]  # [1, kv_heads, slots, 1]
            self.keys, self.values = self.keys.masked_fill(hole, 0), self.values.masked_fill(hole, 0)
        else:  # a padding slot owns no row: the rows of those slots go
            self.absorb()
            tables = self.packed.row_tables(self)
        for name, f in SLOT_FIELDS.items():
            setattr(self, name, getattr(self, name).masked_fill(~real, f.pad))
        if tables is not None:
            self.packed, self.key_group = self.packed.picked(tables, self)
        self._uneven = True

    def head_lengths(self) -> torch.Tensor:
        """[kv_heads] keys each head really holds (padding not counted)."""
        return self.real.sum(-1)

    @property
    def uneven(self) -> bool:
        """Whether some head holds padding (fewer keys than another). Read once per ``real``: on a GPU each read
        of a tensor's value waits for every queued kernel, and a decoding step asks for every layer."""
        if self._uneven is None:
            self._uneven = not bool(self.real.all())
        return self._uneven

    def drop_before(self, start: int) -> None:
        """Drop the first ``start`` slots of every head."""
        self._cut(lambda t, dim: t.narrow(dim, start, t.shape[dim] - start))

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` slots: drops uncommitted keys, and committed ones past ``n``."""
        if self._keys is None:  # never written
            return
        if self.packed is not None:
            self.absorb()
            if n >= self.held:  # only uncommitted keys go
                self._keys, self._values = self._keys[:, :, : n - self.held], self._values[:, :, : n - self.held]
                return
            self._keys, self._values = self._keys[:, :, :0], self._values[:, :, :0]
        old = self.keys
        self._cut(lambda t, dim: t.narrow(dim, 0, min(n, t.shape[dim])))
        if self.pages is not None and self.pages.describes(old):  # the pages the cut keeps whole stay
            self.pages = self.pages.moved_to(self.keys)

    def state(self) -> dict:
        """Everything ``load`` needs; cheap, because tensors are replaced, never changed in place."""
        return {"keys": self._keys, "values": self._values,  # a packed layer's: the slots after its store
                **{name: getattr(self, name) for name in ("packed", "is_initialized", "pages", *SLOT_FIELDS)}}

    def load(self, state: dict) -> None:
        """Return to a ``state``."""
        for name, value in state.items():
            setattr(self, {"keys": "_keys", "values": "_values"}.get(name, name), value)


def slot_cache(lm: LoadedModel) -> DynamicCache:
    """An empty cache of ``SlotLayer``s, one per layer of ``lm``: a policy's cache."""
    cache = DynamicCache()
    cache.layers.extend(SlotLayer(lm.facts.n_kv_heads, lm.device) for _ in range(lm.facts.n_layers))
    return cache
