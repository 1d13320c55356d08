"""KIVI's cache as held: integer codes packed into bytes, a min and a max per group, and full-precision rows.

Reference for the packing: jy-yuan/KIVI ``quant/new_pack.py`` (``pack_tensor``), which puts code ``i``
of a word at bit ``bits · i``, the lowest bits first; KIVI packs into int32 words, keys along tokens
and values along channels. kvlab packs every slot's codes along its channels into uint8 bytes, keys
and values alike, so a cut along the slot axis (an eviction) moves whole rows: ``⌈head_dim · bits / 8⌉``
bytes a slot, the same count as KIVI's whenever ``head_dim · bits`` is a multiple of 32.

Each group stores its min (KIVI's zero point) and its max in the cache's dtype, both exact values of
the tensor; the scale ``(max − min) / (2^bits − 1)`` is recomputed in float32 when read, so decoding
gives bit for bit what quantizing then dequantizing in float32 gives (``quantization.fake_quantize``),
at the two numbers per group that KIVI stores (its scale and zero point).

Rows are kept in slot-major order (every head's row of slot 0, then slot 1 …), so slots appended to
the layer append rows. Which slot owns a row follows from the ``SlotLayer``'s per-slot fields:
``key_group`` ≥ 0 marks a packed key (its group's min and max row), ``value_quantized`` a packed value
(its own row of mins and maxes, one per channel group); other real slots hold a full-precision row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

STORES = ("key_full", "key_codes", "value_full", "value_codes")  # the row tensors, in ``row_tables`` order


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [rows, channels] (integers below 2^bits) → [rows, ⌈channels · bits / 8⌉] uint8, lowest bits first."""
    per = 8 // bits
    rows, channels = q.shape
    q = torch.nn.functional.pad(q.to(torch.uint8), (0, -channels % per)).view(rows, -(-channels // per), per)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=q.device)  # [per]
    return (q << shifts).sum(-1, dtype=torch.uint8)  # disjoint bits: the sum is the bitwise or


def unpack_codes(packed: torch.Tensor, bits: int, channels: int) -> torch.Tensor:
    """``pack_codes`` undone → codes [rows, channels] (float32, as the dequantization multiplies them)."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    q = (packed[..., None] >> shifts) & ((1 << bits) - 1)  # [rows, bytes, per]
    return q.reshape(packed.shape[0], packed.shape[1] * (8 // bits))[:, :channels].float()


def dequantize(q: torch.Tensor, low: torch.Tensor, high: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes with their slice's min and max (broadcast alike) → values in float32, as ``fake_quantize``."""
    low, high = low.float(), high.float()
    scale = (high - low) / ((1 << bits) - 1)
    return torch.where(scale > 0, q * scale + low, low)  # scale 0: the slice holds one value, its min


def slot_rows(mask: torch.Tensor) -> torch.Tensor:
    """[kv_heads, slots] bool → [kv_heads, slots] long: each masked slot's row in slot-major order, −1 elsewhere."""
    rows = (mask.T.reshape(-1).cumsum(0) - 1).view(mask.shape[1], mask.shape[0]).T
    return rows.masked_fill(~mask, -1)


def pick(rows: torch.Tensor, table: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The ``rows`` that ``mask``'s slots (slot-major) name in ``table`` [kv_heads, slots]."""
    return rows[table.T[mask.T]]


def scatter(rows: torch.Tensor, mask: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` [kv_heads, slots, d] with ``rows`` (slot-major) written at ``mask``'s slots."""
    out.transpose(0, 1)[mask.T] = rows.to(out.dtype)
    return out


@dataclass(frozen=True)
class PackedKV:
    """One layer's first ``slots`` slots of keys and values as KIVI holds them (rows described above).

    Frozen and replaced whole, never changed in place: a snapshot holding one stays true.
    """

    bits: int
    group: int
    slots: int
    key_full: torch.Tensor  # [rows, head_dim] cache dtype: real keys not packed
    key_codes: torch.Tensor  # [rows, ⌈head_dim · bits / 8⌉] uint8
    key_low: torch.Tensor  # [key groups, head_dim] cache dtype: per channel over ``group`` tokens
    key_high: torch.Tensor  # [key groups, head_dim]
    value_full: torch.Tensor  # [rows, head_dim]
    value_codes: torch.Tensor  # [rows, ⌈head_dim · bits / 8⌉] uint8
    value_low: torch.Tensor  # [rows of value_codes, head_dim / group]: per token over ``group`` channels
    value_high: torch.Tensor  # [rows of value_codes, head_dim / group]

    @classmethod
    def empty(cls, bits: int, group: int, like: torch.Tensor) -> "PackedKV":
        """A store of no slots for keys like ``like`` [..., head_dim] (its dtype and device)."""
        d, code_bytes = like.shape[-1], -(-like.shape[-1] * bits // 8)
        full, codes = like.new_zeros(0, d), like.new_zeros(0, code_bytes, dtype=torch.uint8)
        per_value = like.new_zeros(0, d // group)
        return cls(bits, group, 0, full, codes, full, full, full, codes, per_value, per_value)

    @staticmethod
    def masks(layer, slots: int) -> tuple[torch.Tensor, ...]:
        """Which of the first ``slots`` slots of ``layer`` own a row of each of ``STORES`` → 4 × [kv_heads, slots]."""
        real, key_packed = layer.real[:, :slots], layer.key_group[:, :slots] >= 0
        value_packed = layer.value_quantized[:, :slots]
        return real & ~key_packed, key_packed, real & ~value_packed, value_packed

    def row_tables(self, layer) -> torch.Tensor:
        """[4, kv_heads, slots] long: each slot's row in each of ``STORES`` (−1: none), to cut with the slots."""
        return torch.stack([slot_rows(m) for m in self.masks(layer, self.slots)])

    def picked(self, tables: torch.Tensor, layer) -> tuple["PackedKV", torch.Tensor]:
        """The store of ``layer`` after a cut or padding: the rows ``tables`` (cut like the slots) name for the
        slots that still own one, and the key groups still used → (store, ``key_group`` renumbered)."""
        slots = tables.shape[-1]
        masks = self.masks(layer, slots)
        rows = {name: pick(getattr(self, name), table, mask) for name, table, mask in zip(STORES, tables, masks)}
        v_table, v_mask = tables[3], masks[3]
        group = layer.key_group
        used = group[group >= 0].unique()  # sorted: the groups keep their order
        renumbered = torch.where(group >= 0, torch.searchsorted(used, group.clamp(min=0)), group)
        return replace(self, slots=slots, **rows, key_low=self.key_low[used], key_high=self.key_high[used],
                       value_low=pick(self.value_low, v_table, v_mask),
                       value_high=pick(self.value_high, v_table, v_mask)), renumbered

    def appended(self, keys: torch.Tensor, values: torch.Tensor, real: torch.Tensor) -> "PackedKV":
        """The store grown by full-precision slots keys, values [kv_heads, n, head_dim] with ``real`` [kv_heads, n]."""
        grown = {"key_full": torch.cat([self.key_full, keys.transpose(0, 1)[real.T]]),
                 "value_full": torch.cat([self.value_full, values.transpose(0, 1)[real.T]])}
        return replace(self, slots=self.slots + keys.shape[1], **grown)

    def keys(self, layer) -> torch.Tensor:
        """The keys of the store's slots, decoded → [kv_heads, slots, head_dim] (built now, held by no one)."""
        full, packed, _, _ = self.masks(layer, self.slots)
        out = self.key_full.new_zeros(full.shape[0], self.slots, self.key_full.shape[-1])
        scatter(self.key_full, full, out)
        group = layer.key_group[:, : self.slots].T[packed.T]  # [rows]: each packed key's group
        q = unpack_codes(self.key_codes, self.bits, out.shape[-1])
        return scatter(dequantize(q, self.key_low[group], self.key_high[group], self.bits), packed, out)

    def values(self, layer) -> torch.Tensor:
        """The values of the store's slots, decoded → [kv_heads, slots, head_dim]."""
        _, _, full, packed = self.masks(layer, self.slots)
        out = self.value_full.new_zeros(full.shape[0], self.slots, self.value_full.shape[-1])
        scatter(self.value_full, full, out)
        q = unpack_codes(self.value_codes, self.bits, out.shape[-1])
        spread = {"repeats": self.group, "dim": -1}  # one min and max per ``group`` channels
        deq = dequantize(q, self.value_low.repeat_interleave(**spread), self.value_high.repeat_interleave(**spread),
                         self.bits)
        return scatter(deq, packed, out)

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the store holds."""
        return sum(t.nbytes for t in (self.key_full, self.key_codes, self.key_low, self.key_high, self.value_full,
                                      self.value_codes, self.value_low, self.value_high))
