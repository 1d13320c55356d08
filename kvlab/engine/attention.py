"""kvlab's attention function: the model's own attention rule, with optional attention statistics.

It is registered with transformers' ``AttentionInterface`` under ``ATTENTION_NAME``. Because no
mask function is registered under that name, transformers builds no mask and this function
builds it from each layer's own keys: layers may hold different numbers of cached tokens
(PyramidKV, sliding layers) without a size mismatch. What the model passes per layer is honoured:
``sliding_window`` (a query sees keys less than ``window`` positions back, as transformers'
``sliding_window_overlay``) and ``softcap`` (Gemma 2: ``tanh(scores / cap) · cap`` before the
softmax, as its eager attention). Windows are measured in original token positions when a
``forward_context`` block says where each cached key came from (a cache with evicted slots), and
in cache slots otherwise, as transformers does. Sparse reads (Quest) narrow what decoding queries
read (``sparse.py``); the product itself is ``attend.py``'s; the statistics a ``Probe`` asks for,
``probe.py``'s.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Iterator

import torch

from kvlab.engine.attend import attend, attend_last
from kvlab.engine.probe import KeyLayout, Probe, attend_recording, record
from kvlab.engine.sparse import SparseReads, attend_decoding, with_reads
from kvlab.engine.timing import clock

__all__ = ["ATTENTION_NAME", "ForwardContext", "Probe", "RowGroup", "SparseReads", "forward_context", "kvlab_attention",
           "register_attention"]

ATTENTION_NAME = "kvlab"  # no "sdpa" in the name: transformers refuses sdpa for soft-capped models


@dataclass(frozen=True)
class RowGroup:
    """Consecutive rows of a forward that attend over keys of their own (``ForwardContext.groups``).

    Caches of very different lengths share one forward, so the model's weights are read once for all of
    them, while each group's queries read only its own keys: a short cache is never padded to a long one.
    ``layers[layer]`` holds the group's keys and values [rows, kv_heads, slots, head_dim] (the forward's cache
    writes the group's new keys into it before its attention runs); the other fields are ``ForwardContext``'s,
    for these rows only. With ``tokens`` the group is one row whose queries are that many of batch row 0's,
    after the previous groups' (rows fed different numbers of tokens lie one after another, none padded).
    """

    rows: int
    layers: list  # per layer, a cache layer: its ``keys`` and ``values`` are the group's
    probes: tuple[Probe | None, ...] = ()
    valid: list[torch.Tensor | None] | None = None
    key_pos: list[torch.Tensor] | None = None
    reads: tuple[SparseReads | None, ...] = ()
    tokens: int = 0


@dataclass(frozen=True)
class ForwardContext:
    """What kvlab's attention reads for the forwards run inside one ``forward_context`` block.

    ``probes``: statistics to collect, one probe for batch row 0 or one per row. ``valid[layer]``
    [batch, slots] or [batch, kv_heads, slots]: True for each row's real keys (None: every slot is real); rows
    of a batch may hold different numbers of real slots per layer (several policies decoded together), and heads
    of one row different numbers of keys (AdaKV); padded slots are masked out; it covers every key a forward
    sees, the slots new keys will fill included. ``key_pos``: which original token each key slot holds, per layer
    [batch, 1 or kv_heads, slots] or one tensor for all layers; it covers every slot, the new tokens' too (a
    query's own position is the one of the slot its key is written to), so sliding windows are measured in
    original positions and a cache with evicted slots keeps the model's own window.
    ``query_pos`` [1, q]: queries that sit anywhere among the keys (CacheBlend's recompute): a key is seen
    when its position ≤ the query's. ``reads``: per batch row, which keys its queries read (None: every key).
    ``attention_seconds``: where set, each call of the attention function appends the seconds it took (the
    bench's attention time, read on kvlab's clock). ``groups``: the batch's rows in ``RowGroup``s, each
    attending over its own keys with its own fields (the ones above then describe no row).
    """

    probes: tuple[Probe | None, ...] = ()
    valid: list[torch.Tensor | None] | None = None
    key_pos: list[torch.Tensor] | torch.Tensor | None = None
    query_pos: torch.Tensor | None = None
    reads: tuple[SparseReads | None, ...] = ()
    attention_seconds: list[float] | None = None
    groups: tuple[RowGroup, ...] = ()


_context: contextvars.ContextVar[ForwardContext] = contextvars.ContextVar("kvlab_forward", default=ForwardContext())


@contextmanager
def forward_context(**fields: Any) -> Iterator[ForwardContext]:
    """Set what the forwards inside this block read: ``fields`` are ``ForwardContext``'s (``probes`` may be one
    probe or a list, ``reads`` a list or None); those not given stay as the enclosing block set them, and
    every one is as before when the block ends."""
    if "probes" in fields:
        probes = fields["probes"]
        fields["probes"] = tuple(probes) if isinstance(probes, list) else (probes,)
    if "reads" in fields:
        fields["reads"] = tuple(fields["reads"] or ())
    if "groups" in fields:
        fields["groups"] = tuple(fields["groups"] or ())
    context = replace(_context.get(), **fields)
    token = _context.set(context)
    try:
        yield context
    finally:
        _context.reset(token)


def kvlab_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [batch, heads, q, head_dim]
    key: torch.Tensor,  # [batch, kv_heads, k, head_dim]
    value: torch.Tensor,  # [batch, kv_heads, k, head_dim]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention over this layer's own keys (every cached key lies before the new queries)."""
    context = _context.get()
    started = clock() if context.attention_seconds is not None else None
    if context.groups:
        out = _attend_groups(module, query, context.groups, scaling=scaling, sliding_window=sliding_window,
                             softcap=softcap, **kwargs)
    else:
        out = _attend_rows(module, query, key, value, context, scaling, sliding_window, softcap)
    if started is not None:
        context.attention_seconds.append(clock() - started)
    return out, None


def _attend_groups(module: torch.nn.Module, query: torch.Tensor, groups: tuple[RowGroup, ...], **kwargs
                   ) -> torch.Tensor:
    """Each group's rows of ``query`` [batch, heads, q, head_dim] (or its tokens of row 0) over the group's own
    keys → [batch, q, heads, head_dim]: a group attends exactly as a forward of its rows alone would."""
    out, start = [], 0
    for group in groups:
        own = group.layers[module.layer_idx]
        size = group.tokens or group.rows
        with forward_context(groups=(), attention_seconds=None, probes=list(group.probes), valid=group.valid,
                             key_pos=group.key_pos, reads=group.reads):
            rows = query[:, :, start : start + size] if group.tokens else query[start : start + size]
            out.append(kvlab_attention(module, rows, own.keys, own.values, None, **kwargs)[0])
        start += size
    return torch.cat(out, dim=1 if groups[0].tokens else 0)


def _attend_rows(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, context: ForwardContext,
    scaling: float | None, sliding_window: int | None, softcap: float | None,
) -> torch.Tensor:
    """Every row of query [batch, heads, q, head_dim] over its keys [batch, kv_heads, k, head_dim] as ``context``
    says (padding, windows, sparse reads), its probes filled → [batch, q, heads, head_dim]."""
    q_len, k_len = query.shape[-2], key.shape[-2]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer = module.layer_idx
    padding, positions, scattered = context.valid, context.key_pos, context.query_pos
    valid = None if padding is None or padding[layer] is None else padding[layer][..., :k_len]  # [batch, (kv,) k]
    if isinstance(positions, list):
        positions = positions[layer]
    if positions is not None and (sliding_window is not None or scattered is not None):
        positions = positions[..., :k_len]
    else:
        positions = None
    layout = KeyLayout(q_len, k_len, sliding_window, positions, scattered)
    # one row whose column sums are asked, or whose windows cover every query: its attention gives its statistics
    # (one softmax), unless a sparse read narrows it
    eager = query.shape[0] == 1 and scattered is None and not any(context.reads)
    for row, probe in enumerate(context.probes):
        if probe is None or not probe.asks:
            continue
        row_keys, row_values = key[row : row + 1], value[row : row + 1]  # over this row's real keys, as alone
        row_pos = None if layout.key_pos is None else layout.key_pos[row : row + 1]
        row_real = None
        if valid is not None:
            mine = valid[row] if valid.ndim == 2 else valid[row].any(0)  # [k]: the row's own slots
            row_keys, row_values = row_keys[:, :, mine], row_values[:, :, mine]
            row_pos = None if row_pos is None else row_pos[:, :, mine]
            row_real = None if valid.ndim == 2 else valid[row : row + 1, :, mine]  # its heads' padding
        row_layout = KeyLayout(q_len, row_keys.shape[-2], sliding_window, row_pos, real=row_real)
        one_pass = eager and (probe.colsum or max(probe.windows, default=0) >= q_len)
        record(probe, layer, query[row : row + 1], row_keys, scale, row_layout, softcap, softmax=not one_pass)
        if one_pass:
            out = attend_recording(probe, layer, query, row_keys, row_values, scale, row_layout, softcap)
            return out.transpose(1, 2).contiguous()
    mask, causal = None, False
    plain = valid is None and sliding_window is None and not softcap  # the causal rule is all a query's view needs
    if scattered is not None:
        mask = layout.scattered(query.device)
    elif q_len == k_len and plain:
        causal = True
    elif plain and not any(context.reads) and 1 < q_len < k_len <= 1.5 * q_len:  # fewer pad rows than half the queries
        return attend_last(query, key, value, scale).transpose(1, 2).contiguous()
    elif q_len > 1 or sliding_window is not None or softcap:  # one query sees every key; more, the keys up to their own
        q_idx = torch.arange(q_len, device=query.device) + (k_len - q_len)
        mask = (torch.arange(k_len, device=query.device)[None, :] <= q_idx[:, None])[None, None]  # [1, 1, q, k]
        window = layout.visible(0, q_len, k_len, query.device)
        if window is not None:
            mask = mask & window
    if valid is not None:
        padded = valid[:, None, None, :] if valid.ndim == 2 else valid[:, :, None, :]  # [batch, 1 or kv, 1, k]
        mask = padded if mask is None else mask & padded
    if q_len == 1 and scattered is None and context.reads:  # a decoding step: sparse rows read only their keys
        out = attend_decoding(query, key, value, mask, causal, scale, softcap, layer, valid, context.reads)
    else:
        mask, causal = with_reads(mask, causal, query, key, layer, valid, context.reads)
        out = attend(query, key, value, mask, causal, scale, softcap)
    return out.transpose(1, 2).contiguous()


def register_attention() -> None:
    """Make ``attn_implementation=ATTENTION_NAME`` available to transformers models."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, kvlab_attention)
