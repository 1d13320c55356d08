"""kvlab's attention function: sdpa, with its own causal mask and optional attention statistics.

It is registered with transformers' ``AttentionInterface`` under ``ATTENTION_NAME``. Because no
mask function is registered under that name, transformers builds no mask and this function
builds a bottom-right causal mask from each layer's own key length: layers may hold different
numbers of cached tokens (PyramidKV) without a size mismatch.

Statistics are never taken from full attention maps. A ``Probe`` set for one forward asks for
softmax rows of the last ``n`` queries only (SnapKV's observation window, sink mass), and for
column sums over all queries computed in chunks (H2O), so the extra memory stays small.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn.functional as F

ATTENTION_NAME = "kvlab_sdpa"
_QUERY_CHUNK = 256

_probe: contextvars.ContextVar["tuple[Probe | None, ...]"] = contextvars.ContextVar("kvlab_probe", default=())
_key_valid: contextvars.ContextVar["list[torch.Tensor] | None"] = contextvars.ContextVar(
    "kvlab_key_valid", default=None)


@dataclass
class Probe:
    """Attention statistics to collect during one forward pass, filled per layer.

    ``windows``: for each n, the mean softmax row of the last n queries, [heads, keys].
    ``colsum``: when set, the sum of softmax rows over every query, [heads, keys].
    """

    windows: tuple[int, ...] = ()
    colsum: bool = False
    window_means: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)  # n -> layer -> [heads, keys]
    colsums: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [heads, keys]


@contextmanager
def probing(probe: "Probe | list[Probe | None] | None") -> Iterator[None]:
    """Collect statistics for forwards run inside this block: one probe for batch row 0, or one per row."""
    token = _probe.set(tuple(probe) if isinstance(probe, list) else (probe,))
    try:
        yield
    finally:
        _probe.reset(token)


@contextmanager
def key_padding(valid: list[torch.Tensor] | None) -> Iterator[None]:
    """Mark padded cache slots: ``valid[layer]`` is [batch, slots], True for each row's real keys.

    Rows of a batch may hold different numbers of real slots per layer (several policies decoded
    together); padded slots are masked out. It must cover every key a forward in the block sees,
    including the slots new keys will fill (True).
    """
    token = _key_valid.set(valid)
    try:
        yield
    finally:
        _key_valid.reset(token)


def _softmax_rows(
    query: torch.Tensor, key: torch.Tensor, scaling: float, q_start: int, q_total: int
) -> torch.Tensor:
    """Causal softmax rows of new queries [q_start, q_start + q) out of q_total, over the keys they can see.

    query [b, H, q, d], key [b, KV, k, d] → [b, H, q, visible] float32, where ``visible`` keys end at
    the slice's last query: later keys are masked for every row, so they are never computed.
    """
    b, n_heads, q, d = query.shape
    n_kv, k_len = key.shape[1], key.shape[-2]
    visible = k_len - q_total + q_start + q
    grouped = (query.float() * scaling).reshape(b, n_kv, (n_heads // n_kv) * q, d)  # query heads by KV head (GQA)
    scores = torch.matmul(grouped, key[:, :, :visible].float().transpose(-1, -2)).view(b, n_heads, q, visible)
    later = torch.ones(q, q, dtype=torch.bool, device=query.device).triu(1)  # the slice's own keys, not yet seen
    scores[..., visible - q :].masked_fill_(later, float("-inf"))
    return torch.softmax(scores, dim=-1)


def _record(probe: Probe, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
    q_total = query.shape[-2]
    if probe.windows:
        widest = min(max(probe.windows), q_total)
        rows = _softmax_rows(query[:, :, -widest:], key, scaling, q_total - widest, q_total)[0]  # [heads, widest, keys]
        for n in probe.windows:
            probe.window_means.setdefault(n, {})[layer] = rows[:, -min(n, q_total):].mean(dim=1)  # [heads, keys]
    if probe.colsum:
        total = torch.zeros(query.shape[1], key.shape[-2], device=query.device)
        for start in range(0, q_total, _QUERY_CHUNK):
            rows = _softmax_rows(query[:, :, start : start + _QUERY_CHUNK], key, scaling, start, q_total)[0]
            total[:, : rows.shape[-1]] += rows.sum(dim=1)
        probe.colsums[layer] = total


def kvlab_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [batch, heads, q, head_dim]
    key: torch.Tensor,  # [batch, kv_heads, k, head_dim]
    value: torch.Tensor,  # [batch, kv_heads, k, head_dim]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal sdpa over this layer's own keys (every cached key lies before the new queries)."""
    q_len, k_len = query.shape[-2], key.shape[-2]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    padding = _key_valid.get()
    valid = None if padding is None else padding[module.layer_idx][:, :k_len]  # [batch, k]
    for row, probe in enumerate(_probe.get()):
        if probe is not None and (probe.windows or probe.colsum):  # over this row's real keys, as in its own cache
            row_keys = key[row : row + 1] if valid is None else key[row : row + 1, :, valid[row]]
            _record(probe, module.layer_idx, query[row : row + 1], row_keys, scale)
    mask, causal = None, False
    if q_len == k_len and valid is None:
        causal = True
    elif q_len > 1:  # one query sees every key; more see the keys up to their own
        q_idx = torch.arange(q_len, device=query.device) + (k_len - q_len)
        mask = torch.arange(k_len, device=query.device)[None, :] <= q_idx[:, None]  # [q, k]
    if valid is not None:
        padded = valid[:, None, None, :]  # [batch, 1, 1, k]
        mask = padded if mask is None else mask[None, None] & padded
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=causal, scale=scale,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """Make ``attn_implementation=ATTENTION_NAME`` available to transformers models."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, kvlab_attention)
