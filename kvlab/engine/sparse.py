"""Sparse reads (Quest): each decoding query reads only some of a layer's keys.

A sparse read chooses, per query head, which keys each query reads. A forward of several queries (a
fed reply) applies that choice as a mask over every key. A decoding step of one query per row
instead attends over the keys it reads only, as Quest's kernels read only the selected pages
(mit-han-lab/Quest ``quest/models/QuestAttention.py``, whose decode step attends over the pages
``quest/utils/controller.py`` selected): the read itself chooses and attends (``SparseReads.decode``), on a
CPU in float32 with a compiled kernel that reads the pages where they lie (``slot_reads.py``), elsewhere by
gathering them for ``attend`` (``attend_chosen``). Both agree to rounding with the mask over every key.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvlab.engine.attend import attend


class SparseReads(Protocol):
    """Which keys each query of one batch row reads, at one layer; ``real`` [k] marks the row's real slots
    in a padded batch (None: all real)."""

    def read_mask(
        self, query: torch.Tensor, key: torch.Tensor, layer: int, real: torch.Tensor | None
    ) -> torch.Tensor | None:
        """[1, heads, q, k] bool for query [1, heads, q, d] and key [1, kv_heads, k, d], or None for every key."""

    def decode(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, real: torch.Tensor | None,
        visible: torch.Tensor | None, scaling: float, softcap: float | None,
    ) -> torch.Tensor | None:
        """Attention of one decoding query [1, heads, 1, d] over the keys it reads of key and value [1, kv_heads,
        k, d] → [1, heads, 1, d], or None where it reads every key; ``visible`` [1 or kv_heads, k]: the keys a
        window or padding leaves it (None: all)."""

    def bind(self, layers: list) -> None:
        """The cache layers whose keys the next forwards read (where page metadata is kept)."""


def row_real(valid: torch.Tensor | None, row: int) -> torch.Tensor | None:
    """A row's own slots [k] from the forward's validity [batch, k] or [batch, kv_heads, k]: only other rows'
    heads hold padding."""
    if valid is None:
        return None
    return valid[row] if valid.ndim == 2 else valid[row].any(0)


def with_reads(
    mask: torch.Tensor | None, causal: bool, query: torch.Tensor, key: torch.Tensor, layer: int,
    valid: torch.Tensor | None, reads: tuple[SparseReads | None, ...],
) -> tuple[torch.Tensor | None, bool]:
    """``mask`` narrowed to the keys each row's sparse reads choose (the causal flag turned into a mask)."""
    rows = [(row, r.read_mask(query[row : row + 1], key[row : row + 1], layer, row_real(valid, row)))
            for row, r in enumerate(reads) if r is not None]
    rows = [(row, m) for row, m in rows if m is not None]
    if not rows:
        return mask, causal
    b, heads, q_len, _ = query.shape
    k_len = key.shape[-2]
    if mask is None:
        mask = torch.ones(1, 1, q_len, k_len, dtype=torch.bool, device=query.device)
        if causal or q_len > 1:
            mask = mask.tril(k_len - q_len)
    if mask.shape[1] not in (1, heads):  # per-KV-head windows: one row per query head
        mask = mask.repeat_interleave(heads // mask.shape[1], dim=1)
    mask = mask.expand(b, heads, q_len, k_len).clone()  # per query head: heads read different pages
    for row, read in rows:
        mask[row] &= read[0]
    return mask, False


def attend_decoding(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, causal: bool,
    scaling: float, softcap: float | None, layer: int, valid: torch.Tensor | None,
    reads: tuple[SparseReads | None, ...],
) -> torch.Tensor:
    """One decoding query per row [b, H, 1, d] → [b, H, 1, d]: a row whose sparse read chooses its keys attends
    over those only (``SparseReads.decode``); the other rows over every key, in runs of neighbours.

    ``mask`` [b or 1, 1 or KV, 1, k] is what the rows see before any sparse read (windows, padding).
    """
    b = query.shape[0]
    out, start = [], 0
    for row, r in enumerate(reads):
        if r is None:
            continue
        visible = None if mask is None else mask[row if mask.shape[0] > 1 else 0, :, 0]  # [1 or KV, k]
        rows = (query, key, value) if b == 1 else (query[row : row + 1], key[row : row + 1], value[row : row + 1])
        read = r.decode(*rows, layer, row_real(valid, row), visible, scaling, softcap)
        if read is None:
            continue
        if row > start:  # the rows before it read every key: one call over a view, no copy of their keys
            out.append(_attend_every_key(query, key, value, mask, causal, scaling, softcap, start, row))
        out.append(read)
        start = row + 1
    if start == 0:  # no row read sparsely (dense layers, short caches): one call over the rows as they are
        return attend(query, key, value, mask, causal, scaling, softcap)
    if start < b:
        out.append(_attend_every_key(query, key, value, mask, causal, scaling, softcap, start, b))
    return torch.cat(out) if len(out) > 1 else out[0]


def _attend_every_key(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, causal: bool,
    scaling: float, softcap: float | None, start: int, end: int,
) -> torch.Tensor:
    """Rows ``start``–``end`` − 1 over every key they see."""
    rows = mask if mask is None or mask.shape[0] == 1 else mask[start:end]
    return attend(query[start:end], key[start:end], value[start:end], rows, causal, scaling, softcap)


def attend_chosen(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, visible: torch.Tensor | None,
    scaling: float, softcap: float | None,
) -> torch.Tensor:
    """One query [1, H, 1, d] over the ``slots`` [H, n] of key and value [1, KV, k, d] its heads read (each query
    head from its own KV head, GQA), gathered, the slots outside ``visible`` [1 or KV, k] not read → [1, H, 1, d]."""
    heads, kv_heads = query.shape[1], key.shape[1]
    seen = None
    if visible is not None:  # the chosen slots a window or padding still hides
        seen = visible.expand(kv_heads, -1).repeat_interleave(heads // kv_heads, dim=0).gather(1, slots)
        seen = seen[None, :, None]  # [1, H, 1, n]
    keys, values = head_rows(key[0], slots), head_rows(value[0], slots)  # [1, H, n, d]
    return attend(query, keys, values, seen, False, scaling, softcap)


def head_rows(t: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Slots ``slots`` [H, n] of t [KV, k, d], each query head's from its own KV head (GQA) → [1, H, n, d].

    Whole rows by ``index_select``: on the CPU it copies rows many times faster than a gather or an advanced
    index. Where t's rows lie at one stride (a cache's or a slab's keys, each head's followed by free slots), the
    heads are read as one table of rows in one call, each head's slots offset by its first row; else one call per
    KV head. One call rather than three saves a third to a half of a layer's copy (about 20 µs against 30–40 at
    256 of 300–4,000 slots). Gathering per query head rather than once per KV head copies the keys several heads
    share more than once, but needs no union of their pages: at a few thousand keys the union's sort and scatter
    cost more than the copies they save.
    """
    kv_heads, k, d = t.shape
    heads = slots.shape[0]
    head_stride, row_stride, step = t.stride()
    if step == 1 and row_stride == d and head_stride % d == 0:
        per = head_stride // d  # rows from one head's first to the next's
        table = t.as_strided(((kv_heads - 1) * per + k, d), (d, 1))  # [rows, d]: every head's, free slots between
        first = torch.arange(heads, device=slots.device).div_(heads // kv_heads, rounding_mode="floor").mul_(per)
        return table.index_select(0, (slots + first[:, None]).flatten()).view(1, *slots.shape, d)
    out = t.new_empty(slots.numel(), d).view(kv_heads, -1, d)  # [KV, group · n, d]
    for head, index in enumerate(slots.reshape(kv_heads, -1)):
        torch.index_select(t[head], 0, index, out=out[head])
    return out.view(1, *slots.shape, d)
