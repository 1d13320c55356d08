"""KIVI's KV quantization (Liu et al., 2024), stored as KIVI stores it: packed integer codes, a min and
a max per group, and the newest tokens in full precision (``engine/packed.py``), dequantized when read.

Reference: jy-yuan/KIVI ``models/llama_kivi.py`` (``LlamaAttention_KIVI.forward``) and its
``quant/new_pack.py`` packing. Keys are quantized per channel: each channel's values over a group
of ``group_size`` consecutive tokens share a scale and a zero point (min). Values are quantized per
token: each token's channels in groups of ``group_size`` share them. Asymmetric min/max rounding to
``bits`` bits. The newest tokens stay in full precision: keys until ``residual`` of them have
gathered, which are then quantized together; values beyond the newest ``residual`` are quantized
as they age. Attention reads the values decoded from the store, so fidelity is what the stored
cache gives, and the bytes held are the bytes of the store's tensors (``layer_bytes`` is their formula).

kvlab quantizes at the end of each append (a prompt, a fed reply), as KIVI does after a prefill;
while a reply is being decoded its tokens stay in full precision until it is fed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.engine.packed import PackedKV, dequantize, pack_codes, pick, slot_rows
from kvlab.errors import KvlabError

FULL_PRECISION = 16  # bits that mean "not quantized"


def encode(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round ``x`` to ``bits`` bits with one min and max per slice along ``dim`` → (codes, min, max), float32,
    the min and max kept along ``dim`` (size 1)."""
    x = x.float()
    low, high = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    levels = (1 << bits) - 1
    scale = (high - low) / levels
    return ((x - low) / scale.clamp_min(torch.finfo(torch.float32).tiny)).round().clamp(0, levels), low, high


def fake_quantize(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """``x`` quantized as ``encode`` does and dequantized (float32): what the packed store decodes to."""
    return dequantize(*encode(x, bits, dim), bits)


def quantize_keys(keys: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Keys [tokens, head_dim] (tokens a multiple of ``group``): per channel, groups of ``group`` tokens. KIVI's key
    rule in float, the reference the tests hold the packed store to."""
    tokens, d = keys.shape
    return fake_quantize(keys.reshape(tokens // group, group, d), bits, dim=1).reshape(tokens, d)


def quantize_values(values: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Values [tokens, head_dim] (head_dim a multiple of ``group``): per token, groups of ``group`` channels. KIVI's
    value rule in float, the reference the tests hold the packed store to."""
    tokens, d = values.shape
    return fake_quantize(values.reshape(tokens, d // group, group), bits, dim=2).reshape(tokens, d)


@dataclass(frozen=True)
class Kivi:
    """KIVI's settings: ``bits`` (16: off), ``group`` size and ``residual`` tokens kept in full precision."""

    bits: int = 2
    group: int = 32
    residual: int = 128

    @property
    def active(self) -> bool:
        return self.bits < FULL_PRECISION

    def quantize(self, layer) -> bool:
        """Quantize what KIVI would have quantized by now in a ``SlotLayer``; True if anything changed.

        Per KV head: of the keys still in full precision (the newest real slots), whole chunks of
        ``residual`` are quantized, oldest first; of the values, all but the newest ``residual``. The
        layer then holds them packed (``layer.packed``), and every committed slot in its store.
        """
        if layer.head_dim % self.group:
            raise KvlabError(f"kivi: the group size {self.group} does not divide the head dimension {layer.head_dim}")
        key_span, value_span = self._spans(layer)  # [kv_heads, slots] bool: what to quantize now
        if not (key_span.any() or value_span.any()):
            layer.absorb()  # a packed layer holds its new slots in its store, in full precision
            return False
        layer.absorb(self.bits, self.group)
        keys, values = layer.packed.keys(layer), layer.packed.values(layer)  # [kv_heads, slots, head_dim]
        store, tables = layer.packed, layer.packed.row_tables(layer)
        heads, slots, d = keys.shape
        codes = keys.new_zeros(2, heads, slots, store.key_codes.shape[-1], dtype=torch.uint8)  # keys', values'
        value_low, value_high = keys.new_zeros(2, heads, slots, d // self.group)
        key_group, key_low, key_high = layer.key_group.clone(), [store.key_low], [store.key_high]
        groups = len(store.key_low)
        for head in range(heads):
            span = key_span[head]
            if (n := int(span.sum())):
                q, low, high = encode(keys[head, span].reshape(n // self.group, self.group, d), self.bits, dim=1)
                codes[0, head, span] = pack_codes(q.reshape(n, d), self.bits)
                key_low.append(low[:, 0].to(keys.dtype))
                key_high.append(high[:, 0].to(keys.dtype))
                new_groups = torch.arange(groups, groups + n // self.group, device=keys.device)
                key_group[head, span] = new_groups.repeat_interleave(self.group)
                groups += n // self.group
            span = value_span[head]
            if (n := int(span.sum())):
                q, low, high = encode(values[head, span].reshape(n, d // self.group, self.group), self.bits, dim=2)
                codes[1, head, span] = pack_codes(q.reshape(n, d), self.bits)
                value_low[head, span] = low[..., 0].to(values.dtype)
                value_high[head, span] = high[..., 0].to(values.dtype)
        # new tensors, never the old ones changed: a snapshot holding them stays true
        layer.key_quantized, layer.value_quantized = layer.key_quantized | key_span, layer.value_quantized | value_span
        layer.key_group = key_group
        full, key_packed, value_full, value_packed = store.masks(layer, slots)

        def merged(old: torch.Tensor, table: torch.Tensor, fresh: torch.Tensor, span: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:  # the old rows and the span's new ones, slot-major
            both = torch.cat([old, fresh.transpose(0, 1)[span.T]])
            return pick(both, torch.where(span, slot_rows(span) + len(old), table), mask)

        layer.packed = PackedKV(
            self.bits, self.group, slots, pick(store.key_full, tables[0], full),
            merged(store.key_codes, tables[1], codes[0], key_span, key_packed),
            torch.cat(key_low), torch.cat(key_high), pick(store.value_full, tables[2], value_full),
            merged(store.value_codes, tables[3], codes[1], value_span, value_packed),
            merged(store.value_low, tables[3], value_low, value_span, value_packed),
            merged(store.value_high, tables[3], value_high, value_span, value_packed))
        return True

    def _spans(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and the values [kv_heads, slots] (bool) to quantize now: each head's open (full-precision)
        slots are its newest real ones, after its padding and its quantized slots."""
        unit = self.residual or self.group  # keys are quantized in whole chunks of this many tokens
        spans = []
        for done, keep in ((layer.key_quantized, lambda n: (n // unit) * unit),
                           (layer.value_quantized, lambda n: max(n - self.residual, 0))):
            open_ = layer.real & ~done  # [kv_heads, slots]
            first = open_.long().argmax(-1, keepdim=True)  # each head's oldest open slot
            rank = torch.arange(open_.shape[-1], device=open_.device) - first  # [kv_heads, slots]
            take = torch.tensor([keep(int(n)) for n in open_.sum(-1)], device=open_.device)[:, None]
            spans.append(open_ & (rank < take))
        return spans[0], spans[1]

    @staticmethod
    def held_bytes(full: int, packed: int, key_groups: int, value_rows: int, head_dim: int, group: int,
                   bits: int, bytes_per_element: int) -> int:
        """The byte formula: ``full`` full-precision keys and values, ``packed`` packed ones at
        ``⌈head_dim · bits / 8⌉`` bytes each (whole bytes per slot), and a min and a max per key group
        (``head_dim`` channels) and per packed value (``head_dim / group`` channel groups)."""
        code_bytes = -(-head_dim * bits // 8)
        scales = key_groups * head_dim + value_rows * (head_dim // group)
        return (full * head_dim + 2 * scales) * bytes_per_element + packed * code_bytes

    def layer_bytes(self, layer, head_dim: int, bytes_per_element: int) -> int:
        """Bytes one layer holds by ``held_bytes``: equal to its store's tensors (``PackedKV.nbytes``) and the
        full-precision slots after it. A layer given by its flags alone (the byte bound's cases) has no
        padding, and its quantized keys fill whole groups."""
        k_q, v_q = int(layer.key_quantized.sum()), int(layer.value_quantized.sum())
        real = getattr(layer, "real", None)
        slots = layer.key_quantized.numel() if real is None else int(real.sum())
        key_group = getattr(layer, "key_group", None)
        if key_group is None:
            key_groups = k_q // self.group
        else:  # a rotated key leaves its group: held in full precision, still counted as quantized
            k_q, key_groups = int((key_group >= 0).sum()), len(key_group[key_group >= 0].unique())
        return self.held_bytes(2 * slots - k_q - v_q, k_q + v_q, key_groups, v_q, head_dim, self.group, self.bits,
                               bytes_per_element)
