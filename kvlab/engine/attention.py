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
read (``sparse.py``); the product itself is ``attend.py``'s.

Statistics are never taken from full attention maps. A ``Probe`` set for one forward asks for
softmax rows of the last ``n`` queries only (SnapKV's observation window, sink mass), and for
column sums over all queries computed in chunks (H2O), so the extra memory stays small; a forward of one
row that asks for column sums takes its attention from those chunks' probabilities too, so its scores
are computed once. They use the same mask and soft-capping as the attention itself. A probe may also
ask for the mean and covariance of the forward's queries before RoPE (Expected Attention): the caller that knows the
queries' positions gives the un-rotation, since queries reach this function already rotated. And
it may ask, per key, for the most attention any query of the forward gives it (in chunks too), each
query's softmax taken over a subset of the keys (KVzip's reconstruction pass: the sinks, the chunk
being repeated and the forward's own keys).
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import torch

from kvlab.engine.attend import QUERY_CHUNK, attend, chunk_rows, mask_scores, scores
from kvlab.engine.sparse import SparseReads, attend_decoding, with_reads
from kvlab.engine.timing import clock

__all__ = ["ATTENTION_NAME", "ForwardContext", "Probe", "RowGroup", "SparseReads", "forward_context", "kvlab_attention",
           "register_attention"]

ATTENTION_NAME = "kvlab"  # no "sdpa" in the name: transformers refuses sdpa for soft-capped models

@dataclass
class Probe:
    """Attention statistics to collect during one forward pass, filled per layer.

    ``windows``: for each n, the mean softmax row of the last n queries, [heads, keys].
    ``colsum``: when set, the sum of softmax rows over every query, [heads, keys].
    ``queries_from``: for each original position p, the mean [heads, head_dim] and covariance
    [heads, head_dim, head_dim] of the forward's pre-RoPE queries at positions ≥ p (Expected
    Attention leaves its sinks' queries out). ``KVState.prepare_probe`` fills in ``unrotate`` (a
    layer's rotated queries [heads, q, head_dim] → pre-RoPE) and ``first_position`` (the original
    position of the forward's first query).
    ``colmax_over``: per layer, [kv_heads, cached slots] bool: the cached keys each query's softmax runs
    over, the forward's own keys joining it causally; ``colmaxes`` then holds, per key, the largest of
    those softmax rows over every query, [heads, keys] (0 for a key outside the subset).
    """

    windows: tuple[int, ...] = ()
    colsum: bool = False
    queries_from: tuple[int, ...] = ()
    colmax_over: list[torch.Tensor] | None = None
    unrotate: Callable[[int, torch.Tensor], torch.Tensor] | None = None
    first_position: int = 0
    window_means: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)  # n -> layer -> [heads, keys]
    colsums: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [heads, keys]
    query_means: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)  # p -> layer -> [heads, head_dim]
    query_covs: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)  # p -> layer -> [heads, d, d]
    colmaxes: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [heads, keys]

    @property
    def asks(self) -> bool:
        """Whether this probe collects anything."""
        return bool(self.windows or self.colsum or self.queries_from or self.colmax_over is not None)


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


@dataclass
class _Layout:
    """What the keys of one layer's forward look like to its queries."""

    q_len: int
    k_len: int
    window: int | None
    key_pos: torch.Tensor | None  # [batch, 1 or kv_heads, k] original positions (windows, scattered queries)
    query_pos: torch.Tensor | None = None  # [batch, q] for scattered queries; else each query's own slot
    real: torch.Tensor | None = None  # [batch, kv_heads, k] False at a head's padding (statistics only)

    def positions(self, q_start: int, q_end: int, visible: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions of queries [q_start, q_end) → [b, q] and of the first ``visible`` keys → [b, 1 or kv, visible]."""
        if self.key_pos is None:
            first = self.k_len - self.q_len
            return (torch.arange(first + q_start, first + q_end, device=device)[None],
                    torch.arange(visible, device=device)[None, None])
        own = self.query_pos if self.query_pos is not None else self.key_pos[:, 0, self.k_len - self.q_len :]
        return own[:, q_start:q_end].to(device), self.key_pos[:, :, :visible].to(device)

    def scattered(self, device: torch.device) -> torch.Tensor:
        """Causal rule by position, and the window, for scattered queries → [b, 1, q, k]."""
        query_pos, key_pos = self.positions(0, self.q_len, self.k_len, device)
        distance = query_pos[:, None, :, None] - key_pos[:, :, None, :]
        return (distance >= 0) & (distance < self.window if self.window is not None else True)

    def visible(self, q_start: int, q_end: int, visible: int, device: torch.device) -> torch.Tensor | None:
        """Window mask of queries [q_start, q_end) over the first ``visible`` keys → [b, 1 or kv, q, visible].

        None when the layer has no window (the causal rule alone applies).
        """
        if self.window is None:
            return None
        query_pos, key_pos = self.positions(q_start, q_end, visible, device)
        return (query_pos[:, None, :, None] - key_pos[:, :, None, :]) < self.window


def _softmax_rows(
    query: torch.Tensor, key: torch.Tensor, scaling: float, q_start: int, q_total: int,
    layout: _Layout, softcap: float | None, over: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax rows of new queries [q_start, q_start + q) out of q_total, over the keys they can see.

    query [1, H, q, d], key [1, KV, k, d] → [1, H, q, visible] float32, where ``visible`` keys end at
    the slice's last query: later keys are masked for every row, so they are never computed.
    ``over`` [1, KV, 1, k]: only these keys enter the softmax (the others get 0).
    """
    q = query.shape[-2]
    visible = key.shape[-2] - q_total + q_start + q
    logits = scores(query, key[:, :, :visible], scaling, softcap)
    later = torch.ones(q, q, dtype=torch.bool, device=query.device).triu(1)  # the slice's own keys, not yet seen
    logits[..., visible - q :].masked_fill_(later, float("-inf"))
    window = layout.visible(q_start, q_start + q, visible, logits.device)
    if window is not None:
        logits = mask_scores(logits, window)
    if layout.real is not None:
        logits = mask_scores(logits, layout.real[:, :, None, :visible])
    if over is not None:
        logits = mask_scores(logits, over[..., :visible])
    return torch.softmax(logits, dim=-1)


def _softmax_chunks(
    query: torch.Tensor, key: torch.Tensor, scaling: float, layout: _Layout, softcap: float | None,
    over: torch.Tensor | None = None,
) -> Iterator[torch.Tensor]:
    """``_softmax_rows`` of every query of one row [1, H, q, d], a chunk of queries at a time → [1, H, c, visible]
    each, so that no more than a chunk's rows are held."""
    q_total = query.shape[-2]
    rows = chunk_rows(query, key.shape[-2], QUERY_CHUNK)
    for start in range(0, q_total, rows):
        yield _softmax_rows(query[:, :, start : start + rows], key, scaling, start, q_total, layout, softcap, over)


def _record(
    probe: Probe, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float, layout: _Layout,
    softcap: float | None, colsum: bool = True,
) -> None:
    """Fill ``probe``'s statistics of one row at ``layer``; its column sums only with ``colsum`` (otherwise the
    attention itself gives them: ``_attend_summing``)."""
    q_total = query.shape[-2]
    if probe.windows:
        widest = min(max(probe.windows), q_total)
        rows = _softmax_rows(query[:, :, -widest:], key, scaling, q_total - widest, q_total, layout,
                             softcap)[0]  # [heads, widest, keys]
        for n in probe.windows:
            probe.window_means.setdefault(n, {})[layer] = rows[:, -min(n, q_total):].mean(dim=1)  # [heads, keys]
    if probe.colsum and colsum:
        total = torch.zeros(query.shape[1], key.shape[-2], device=query.device)
        for rows in _softmax_chunks(query, key, scaling, layout, softcap):  # [1, heads, q, visible]
            total[:, : rows.shape[-1]] += rows[0].sum(dim=1)
        probe.colsums[layer] = total
    if probe.colmax_over is not None:
        cached = probe.colmax_over[layer].to(query.device)  # [kv_heads, k - q_total]
        if cached.shape[-1] != key.shape[-2] - q_total:
            raise ValueError(f"layer {layer}: colmax_over covers {cached.shape[-1]} cached keys, the forward sees "
                             f"{key.shape[-2] - q_total}")
        over = torch.cat([cached, cached.new_ones(cached.shape[0], q_total)], dim=-1)[None, :, None]  # [1, KV, 1, k]
        best = torch.zeros(query.shape[1], key.shape[-2], device=query.device)
        for rows in _softmax_chunks(query, key, scaling, layout, softcap, over):  # [1, heads, q, visible]
            best[:, : rows.shape[-1]] = torch.maximum(best[:, : rows.shape[-1]], rows[0].amax(dim=1))
        probe.colmaxes[layer] = best
    if probe.queries_from:
        if probe.unrotate is None:
            raise ValueError("query statistics need the queries' un-rotation (KVState.prepare_probe sets it)")
        pre = probe.unrotate(layer, query[0].float())  # [heads, q, head_dim] before RoPE
        for start in probe.queries_from:
            kept = pre[:, max(0, start - probe.first_position) :]
            if kept.shape[1] == 0:  # every query of this forward lies before ``start``: nothing to say
                continue
            mean = kept.mean(dim=1)  # [heads, head_dim]
            centred = kept - mean[:, None]
            probe.query_means.setdefault(start, {})[layer] = mean
            probe.query_covs.setdefault(start, {})[layer] = centred.transpose(1, 2) @ centred / kept.shape[1]


def _attend_summing(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, layout: _Layout,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one row's queries [1, H, q, d] over its keys and values [1, KV, k, d] → [1, H, q, d], with
    the column sums of its softmax rows [H, k].

    Each chunk's probabilities serve both, as H2O's authors read the sums off the eager attention's weights:
    one score product and one softmax, where attention and statistics apart would take two. Probabilities are
    cast to the value dtype before the product, as the model's eager attention does.
    """
    heads, kv_heads = query.shape[1], key.shape[1]
    total = torch.zeros(heads, key.shape[-2], device=query.device)
    out = []
    for probs in _softmax_chunks(query, key, scaling, layout, softcap):  # [1, H, c, visible]
        chunk, visible = probs.shape[-2:]
        total[:, :visible] += probs[0].sum(dim=1)
        grouped = probs.to(value.dtype).view(1, kv_heads, -1, visible)  # [1, KV, group · c, visible] (GQA)
        out.append(torch.matmul(grouped, value[:, :, :visible]).view(1, heads, chunk, -1))
    return torch.cat(out, dim=2), total


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
    layout = _Layout(q_len, k_len, sliding_window, positions, scattered)
    # one row whose column sums are asked: its attention gives them (one softmax), unless a sparse read narrows it
    summing = query.shape[0] == 1 and scattered is None and not any(context.reads)
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
        row_layout = _Layout(q_len, row_keys.shape[-2], sliding_window, row_pos, real=row_real)
        summed = summing and probe.colsum
        _record(probe, layer, query[row : row + 1], row_keys, scale, row_layout, softcap, colsum=not summed)
        if summed:
            out, probe.colsums[layer] = _attend_summing(query, row_keys, row_values, scale, row_layout, softcap)
            return out.transpose(1, 2).contiguous()
    mask, causal = None, False
    if scattered is not None:
        mask = layout.scattered(query.device)
    elif q_len == k_len and valid is None and sliding_window is None and not softcap:
        causal = True
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
