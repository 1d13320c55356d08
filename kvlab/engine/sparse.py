"""Sparse reads (Quest): each decoding query reads only some of a layer's keys.

A sparse read chooses, per query head, which keys each query reads. A forward of several queries (a
fed reply) applies that choice as a mask over every key. A decoding step of one query per row
instead gathers the keys it reads into a compact tensor and attends over those only, as Quest's
kernels read only the selected pages (mit-han-lab/Quest ``quest/models/QuestAttention.py``, whose decode
step attends over the pages ``quest/utils/controller.py`` selected); both go through ``attend``, so the
two agree to rounding.
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

    def read_slots(
        self, query: torch.Tensor, key: torch.Tensor, layer: int, real: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The slots of ``key`` each query head of one query [1, heads, 1, d] reads → [heads, n], or None for all."""

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


def attend_gathered(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, causal: bool,
    scaling: float, softcap: float | None, layer: int, valid: torch.Tensor | None,
    reads: tuple[SparseReads | None, ...],
) -> torch.Tensor:
    """One decoding query per row [b, H, 1, d] → [b, H, 1, d]: a row whose sparse read chooses slots attends
    over those keys only, gathered once per KV head (the union of its query heads' pages, each head masking
    the pages it did not choose); the other rows over every key, in runs of neighbours.

    ``mask`` [b or 1, 1 or KV, 1, k] is what the rows see before any sparse read (windows, padding).
    """
    b, heads = query.shape[:2]
    chosen = {row: r.read_slots(query[row : row + 1], key[row : row + 1], layer, row_real(valid, row))
              for row, r in enumerate(reads) if r is not None}
    chosen = {row: slots for row, slots in chosen.items() if slots is not None}
    if not chosen:
        return attend(query, key, value, mask, causal, scaling, softcap)
    kv_heads = key.shape[1]
    out, start = [], 0
    for row in [*sorted(chosen), b]:
        if row > start:  # the rows before it read every key: one call over a view, no copy of their keys
            rows = mask if mask is None or mask.shape[0] == 1 else mask[start:row]
            out.append(attend(query[start:row], key[start:row], value[start:row], rows, causal, scaling, softcap))
        if row == b:
            break
        index, reads = _union(chosen[row], kv_heads, key.shape[-2])  # [KV, u], [H, u]
        if mask is not None:
            m = mask[row if mask.shape[0] > 1 else 0, :, 0]  # [1 or KV, k]
            reads &= m.expand(kv_heads, -1).gather(1, index).repeat_interleave(heads // kv_heads, dim=0)
        keys, values = _gathered(key[row], index), _gathered(value[row], index)  # [1, KV, u, d]
        out.append(attend(query[row : row + 1], keys, values, reads[None, :, None], False, scaling, softcap))
        start = row + 1
    return torch.cat(out)


def _union(slots: torch.Tensor, kv_heads: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots any query head of a KV head reads, once per KV head, and which of them each query head reads.

    slots [H, n] → index [KV, u] (u: the largest union; a smaller union is padded with slots no head reads,
    in slot order) and reads [H, u] bool. The query heads of one KV head share its keys (GQA), so their pages
    are gathered once and each head masks out the pages it did not choose.
    """
    heads = slots.shape[0]
    member = torch.zeros(heads, k, dtype=torch.bool, device=slots.device).scatter_(1, slots, True)  # [H, k]
    grouped = member.view(kv_heads, heads // kv_heads, k)
    union = grouped.any(1)  # [KV, k]
    u = int(union.sum(1).max())
    index = torch.sort((~union).to(torch.int8), dim=1, stable=True).indices[:, :u]  # [KV, u]: union slots first
    reads = grouped.gather(2, index[:, None].expand(-1, grouped.shape[1], -1)).view(heads, u)  # padding reads none
    return index, reads


def _gathered(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Slots ``index`` [KV, u] of t [KV, k, d] → [1, KV, u, d].

    One ``index_select`` per KV head: on the CPU it copies rows many times faster than a gather or an
    advanced index, and it reads a slab's strided rows without copying the slab.
    """
    out = t.new_empty(*index.shape, t.shape[-1])  # [KV, u, d]
    for head in range(t.shape[0]):
        torch.index_select(t[head], 0, index[head], out=out[head])
    return out[None]
