"""KIVI's KV quantization (Liu et al., 2024), simulated as stored: quantize, then keep the dequantized values.

Reference: jy-yuan/KIVI ``models/llama_kivi.py`` (``LlamaAttention_KIVI.forward``) and its
``quant/new_pack.py`` packing. Keys are quantized per channel: each channel's values over a group
of ``group_size`` consecutive tokens share a scale and a zero point (min). Values are quantized per
token: each token's channels in groups of ``group_size`` share them. Asymmetric min/max rounding to
``bits`` bits. The newest tokens stay in full precision: keys until ``residual`` of them have
gathered, which are then quantized together; values beyond the newest ``residual`` are quantized
as they age. Attention then reads the dequantized values, so fidelity is what the stored cache
gives; bytes held count the packed integers and every scale and zero point.

kvlab quantizes at the end of each append (a prompt, a fed reply), as KIVI does after a prefill;
while a reply is being decoded its tokens stay in full precision until it is fed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlab.errors import KvlabError

FULL_PRECISION = 16  # bits that mean "not quantized"


def fake_quantize(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Round ``x`` to ``bits`` bits with one min and scale per slice along ``dim``, and dequantize (float32)."""
    x = x.float()
    low, high = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    levels = (1 << bits) - 1
    scale = (high - low) / levels
    q = ((x - low) / scale.clamp_min(torch.finfo(torch.float32).tiny)).round().clamp(0, levels)
    return torch.where(scale > 0, q * scale + low, x)


def quantize_keys(keys: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Keys [tokens, head_dim] (tokens a multiple of ``group``): per channel, groups of ``group`` tokens."""
    tokens, d = keys.shape
    return fake_quantize(keys.reshape(tokens // group, group, d), bits, dim=1).reshape(tokens, d)


def quantize_values(values: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Values [tokens, head_dim] (head_dim a multiple of ``group``): per token, groups of ``group`` channels."""
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

        Per KV head: of the keys still in full precision (the newest slots), whole chunks of
        ``residual`` are quantized, oldest first; of the values, all but the newest ``residual``.
        """
        keys, values = layer.keys[0], layer.values[0]  # [kv_heads, slots, head_dim]
        if keys.shape[-1] % self.group:
            raise KvlabError(f"kivi: the group size {self.group} does not divide the head dimension {keys.shape[-1]}")
        unit = self.residual or self.group  # keys are quantized in whole chunks of this many tokens
        new_keys, new_values = keys.clone(), values.clone()
        key_done, value_done = layer.key_quantized.clone(), layer.value_quantized.clone()  # [kv_heads, slots]
        for head in range(keys.shape[0]):
            k_first, k_open = int(key_done[head].sum()), int((~key_done[head]).sum())  # quantized slots come first
            chunk = (k_open // unit) * unit
            if chunk:
                span = slice(k_first, k_first + chunk)
                new_keys[head, span] = quantize_keys(keys[head, span], self.bits, self.group).to(keys.dtype)
                key_done[head, span] = True
            v_first, v_open = int(value_done[head].sum()), int((~value_done[head]).sum())
            if v_open > self.residual:
                span = slice(v_first, v_first + v_open - self.residual)
                new_values[head, span] = quantize_values(values[head, span], self.bits, self.group).to(values.dtype)
                value_done[head, span] = True
        changed = not (torch.equal(key_done, layer.key_quantized) and torch.equal(value_done, layer.value_quantized))
        if changed:  # new tensors, never the old ones changed: a snapshot holding them stays true
            layer.keys, layer.values = new_keys[None], new_values[None]
            layer.key_quantized, layer.value_quantized = key_done, value_done
        return changed

    def layer_bytes(self, layer, head_dim: int, bytes_per_element: int) -> int:
        """Bytes one layer holds: full-precision slots, packed quantized ones, and their scales and zero points."""
        k_q, v_q = int(layer.key_quantized.sum()), int(layer.value_quantized.sum())
        slots = layer.key_quantized.numel()
        full = (2 * slots - k_q - v_q) * head_dim * bytes_per_element
        packed = math.ceil((k_q + v_q) * head_dim * self.bits / 8)
        key_groups = (k_q // self.group) * head_dim  # one scale and one zero per channel per token group
        value_groups = v_q * (head_dim // self.group)  # one scale and one zero per channel group per token
        return full + packed + 2 * (key_groups + value_groups) * bytes_per_element
