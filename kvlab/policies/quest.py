"""Quest (Tang et al., 2024): keep every key; each query reads only the pages that may matter to it.

Reference: mit-han-lab/Quest ``quest/models/QuestAttention.py`` and ``quest/utils/controller.py``
(the kernel path; ``evaluation/quest_attention.py`` is its simulation). The cache is split into
pages of ``page_size`` slots; each page keeps the element-wise min and max of its keys. A query
``q`` bounds its score on a page by ``Σ_d max(q_d·min_d, q_d·max_d)`` and reads the
``page_budget − 1`` pages with the highest bound plus the page its own token is in; attention runs
over the keys of those pages only: a decoding step chooses the pages and reads only those keys, on a
CPU in one compiled call that reads them where they lie (``engine/slot_reads.py``), elsewhere gathered for
``attend`` (``engine/sparse.py``), as the authors' kernels read only the selected pages; a forward of
several queries masks the keys it does not read. Each layer keeps the min and max of its complete
pages (``PageExtremes`` on the cache layer) and adds a page's once it is complete, rather than taking
them from every key in every forward. As in the authors' code the first ``dense_layers`` layers read
everything, the prompt's prefill is dense (only decoding queries read sparsely: in kvlab, the
reply's tokens, decoded or fed), and a query with no more pages than the budget reads all of them.
kvlab's session budget is the token budget: ``page_budget = budget // page_size``. The authors force no
sink page; ``sink_pages`` (a kvlab variant, default 0) makes the first pages part of every read, as
StreamingLLM keeps its first tokens.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvlab.engine.cache import PageExtremes
from kvlab.engine.facts import ModelFacts
from kvlab.engine.slot_reads import page_attention, reads_in_place
from kvlab.engine.sparse import attend_chosen
from kvlab.policies.base import UNBOUNDED, LayerView, Policy, param


@dataclass
class Quest(Policy):
    name = "quest"
    summary = "keeps every key; each decoding query reads the top pages by a q·k upper bound"
    evicts = False
    page_size: int = param(16, "slots per page: each page keeps the min and max of its keys", min=1)
    dense_layers: int = param(2, "the first layers read every page (Quest skips the first two)", min=0)
    sink_pages: int = param(0, "the first pages every query reads, within its page budget (kvlab's variant; "
                               "the authors force none)", min=0)

    def min_budget(self) -> int:
        return (2 + self.sink_pages) * self.page_size  # the sink pages, the query's own page and one other

    def layer_budgets(self, budget: int, n_layers: int) -> list[int]:
        return [UNBOUNDED] * n_layers  # the budget is what a query reads; the cache keeps everything

    def scores(self, view: LayerView) -> torch.Tensor:
        raise NotImplementedError("Quest never evicts")

    def reads(self, budget: int) -> "PageReads":
        """The sparse reads of a session at token budget ``budget``."""
        return PageReads(self, max(2, budget // self.page_size))

    def metadata_bytes(self, slots: int, facts: ModelFacts) -> int:
        """Bytes of one layer's page metadata: a min and a max key vector per page and KV head."""
        # two head_dim vectors per page and head: the size of one token's key and value
        return facts.kv_bytes(math.ceil(slots / self.page_size), layers=1)


@dataclass
class PageReads:
    """Quest's reads at one page budget (pages a query reads, its own included), and what they read."""

    quest: Quest
    page_budget: int
    keys_read: int = 0  # keys read by sparse queries, summed over layers and query heads
    keys_held: int = 0  # keys those queries could have read
    # layer -> (the earlier pages each query head of the newest sparse query read [heads, r], None: every page;
    # the pages it could read, its own the last; KV heads)
    last_read: dict[int, tuple[torch.Tensor | None, int, int]] = field(default_factory=dict, compare=False,
                                                                        repr=False)
    layers: list | None = field(default=None, compare=False, repr=False)  # the reading state's cache layers

    def bind(self, layers: list) -> None:
        """Read the page extremes of ``layers`` (the state whose forward comes next) and keep them there."""
        self.layers = layers

    def read_mask(
        self, query: torch.Tensor, key: torch.Tensor, layer: int, real: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Which keys each query reads → [1, heads, q, k] bool, or None where it reads every page.

        query [1, heads, q, d] and key [1, kv_heads, k, d] of one row, the new queries' keys last;
        ``real`` [k] marks the row's real slots in a padded batch (None: all real).
        """
        k_len, q_len = key.shape[-2], query.shape[-2]
        slot = torch.arange(k_len, device=key.device) if real is None else real.long().cumsum(0) - 1
        page = torch.div(slot, self.quest.page_size, rounding_mode="floor")  # [k]
        if real is not None:
            page = page.masked_fill(~real, -1)
        n_pages = int(page.max()) + 1
        own = page[k_len - q_len :]  # [q] the page each query's own token is in
        causal = torch.arange(k_len, device=key.device)[None, :] <= torch.arange(k_len - q_len, k_len,
                                                                                  device=key.device)[:, None]
        held = int((causal & (page >= 0)).sum()) * query.shape[1]  # keys the queries could read, per head
        self.keys_held += held
        if layer < self.quest.dense_layers or int(own.max()) + 1 <= self.page_budget:  # reads every page
            self.keys_read += held
            self.last_read[layer] = (None, n_pages, key.shape[1])
            return None
        earlier = n_pages - 1  # the last page is no one's earlier page
        low, high = self._extremes(key, layer, earlier, None if real is None else real.nonzero()[:, 0])
        bounds = F.pad(bounds_of(query, low[:, :earlier], high[:, :earlier]), (0, 1))  # [1, heads, q, pages]
        read = pages_read(bounds, own, self.page_budget, self.quest.sink_pages)  # [1, heads, q, pages]
        last = torch.nonzero(read[0, :, -1, :-1])[:, 1].view(query.shape[1], -1)  # the same count for every head
        self.last_read[layer] = (last, n_pages, key.shape[1])
        mask = read.gather(-1, page.clamp(min=0).expand(*read.shape[:-1], k_len)) & (page >= 0)
        self.keys_read += int((mask & causal).sum())
        return mask

    def decode(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, real: torch.Tensor | None,
        visible: torch.Tensor | None, scaling: float, softcap: float | None,
    ) -> torch.Tensor | None:
        """Attention of one decoding query over the pages it reads → [1, heads, 1, d], or None where it reads every
        page.

        query [1, heads, 1, d] and key, value [1, kv_heads, k, d] of one row, the query's own key last; ``real`` [k]
        as in ``read_mask``; ``visible`` [1 or kv_heads, k] the keys a window or padding leaves it (None: all).
        The same pages as ``read_mask``'s: the ``page_budget − 1`` best earlier pages of each head, whole, then
        the own page's keys up to the query's; every head reads as many.
        """
        size, heads, kv_heads = self.quest.page_size, query.shape[1], key.shape[1]
        slot_of = None if real is None else real.nonzero()[:, 0]  # [n] the row's real slots, in order
        n = key.shape[-2] if slot_of is None else slot_of.numel()
        own = (n - 1) // size  # the query's page; every earlier page is complete
        self.keys_held += n * heads
        if layer < self.quest.dense_layers or own + 1 <= self.page_budget:
            self.keys_read += n * heads
            self.last_read[layer] = (None, own + 1, kv_heads)
            return None
        low, high = self._extremes(key, layer, own, slot_of)  # [kv_heads, ≥ own, d]
        count, sinks = self.page_budget - 1, self.quest.sink_pages
        if reads_in_place(query, key):  # one compiled call that chooses and reads where the keys lie
            out, pages = page_attention(query, key, value, low, high, own, count, sinks, size, n, slot_of, visible,
                                        scaling, softcap)
        else:
            pages = top_pages(bounds_of(query, low[:, :own], high[:, :own])[0, :, 0], count, sinks)  # [heads, count]
            whole = (pages[..., None] * size + torch.arange(size, device=key.device)).flatten(1)  # [heads, count·size]
            slots = torch.cat([whole, torch.arange(own * size, n, device=key.device).expand(heads, -1)], dim=1)
            out = attend_chosen(query, key, value, slots if slot_of is None else slot_of[slots], visible, scaling,
                                softcap)
        self.last_read[layer] = (pages, own + 1, kv_heads)
        self.keys_read += heads * (count * size + n - own * size)
        return out

    def _extremes(
        self, key: torch.Tensor, layer: int, pages: int, slot_of: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Min and max key of the row's first ``pages`` pages → two [kv_heads, ≥ pages, head_dim] float32: the
        kept extremes as they are where they cover them (a decoding step reads only its pages of them).

        The bound layer's kept extremes cover its own complete pages; pages past them (keys a batched
        decoding step holds only in its slab) are taken from ``key`` here. ``slot_of`` [n]: the slot of the
        row's n-th real key (None: slot n).
        """
        kept = self._layer_extremes(layer)
        have = 0 if kept is None else kept.low.shape[1]
        if have >= pages:
            return kept.low, kept.high
        start, end = have * self.quest.page_size, pages * self.quest.page_size
        rest = key[0, :, start:end] if slot_of is None else key[0][:, slot_of[start:end]]
        low, high = complete_page_extremes(rest, self.quest.page_size)
        if have:
            low, high = torch.cat([kept.low, low], dim=1), torch.cat([kept.high, high], dim=1)
        return low, high

    def _layer_extremes(self, layer: int) -> PageExtremes | None:
        """The bound layer's page extremes over its complete pages, brought up to date (a Quest layer holds no
        padding: it evicts nothing). Pages a change of the keys left undescribed are taken again."""
        lay = self.layers[layer] if self.layers is not None else None
        keys = None if lay is None else lay.keys
        if keys is None:
            return None
        size = self.quest.page_size
        kept = lay.pages if lay.pages is not None and lay.pages.page_size == size and lay.pages.describes(keys) \
            else None
        have, complete = 0 if kept is None else kept.low.shape[1], keys.shape[-2] // size
        if complete > have:  # pages completed since: only their keys are read
            low, high = complete_page_extremes(keys[0, :, have * size : complete * size], size)
            if kept is not None:
                low, high = torch.cat([kept.low, low], dim=1), torch.cat([kept.high, high], dim=1)
            kept = lay.pages = PageExtremes(weakref.ref(keys), size, low, high)
        return kept

    def metadata_bytes(self, slots: int, facts: ModelFacts) -> int:
        return self.quest.metadata_bytes(slots, facts)

    def pages_read_last(self) -> list[list[list[int]]]:
        """[layer][kv_head] the pages the newest sparse query read (any query head of the KV head's group), then
        forgotten (the next turn's are its own)."""
        out = []
        for layer in sorted(self.last_read):
            earlier, n_pages, kv_heads = self.last_read[layer]
            if earlier is None:
                out.append([list(range(n_pages))] * kv_heads)
                continue
            read = torch.zeros(earlier.shape[0], n_pages, dtype=torch.bool, device=earlier.device)
            read = read.scatter(1, earlier, True)
            read[:, -1] = True  # the own page
            per_kv = read.view(kv_heads, -1, n_pages).any(1).cpu()
            out.append([torch.nonzero(row).flatten().tolist() for row in per_kv])
        self.last_read = {}
        return out

    @property
    def read_share(self) -> float | None:
        """Share of the keys sparse queries could read that they did read (None before any)."""
        return self.keys_read / self.keys_held if self.keys_held else None


def complete_page_extremes(keys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of keys [kv_heads, pages · page_size, d], page by page → two [kv_heads, pages, d] float32."""
    heads, slots, d = keys.shape
    pages = keys.float().view(heads, slots // page_size, page_size, d)
    return pages.amin(2), pages.amax(2)


def page_extremes(key: torch.Tensor, page: torch.Tensor, n_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max key of each page, from every key at once → two [kv_heads, pages, d] float32.

    key [1, kv_heads, k, d]; ``page`` [k] is each slot's page (−1: a padded slot, in no page); pages may be
    partial. What the kept extremes must equal.
    """
    _, kv_heads, k_len, d = key.shape
    keys = key[0].float()  # [kv_heads, k, d]
    index = page.clamp(min=0)[None, :, None].expand(kv_heads, k_len, d)
    real = (page >= 0)[None, :, None]
    low = torch.full((kv_heads, n_pages, d), math.inf, device=key.device)
    high = torch.full((kv_heads, n_pages, d), -math.inf, device=key.device)
    low = low.scatter_reduce(1, index, keys.masked_fill(~real, math.inf), "amin")
    high = high.scatter_reduce(1, index, keys.masked_fill(~real, -math.inf), "amax")
    return low, high


def bounds_of(query: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Upper bound of q·k over each page's keys: Σ_d max(q_d·min_d, q_d·max_d) → [1, heads, q, pages] float32.

    query [1, heads, q, d]; ``low``/``high`` [kv_heads, pages, d] the pages' min and max keys.
    """
    kv_heads, n_pages, d = low.shape
    heads = query.shape[1]
    q = query[0].float().reshape(kv_heads, -1, d)  # [kv_heads, group · q, d]: query heads by KV head (GQA)
    # two batched products per KV head: a broadcast matmul over the group runs several times slower on the CPU
    bound = torch.bmm(q.clamp(min=0), high.transpose(1, 2)) + torch.bmm(q.clamp(max=0), low.transpose(1, 2))
    return bound.view(1, heads, -1, n_pages)


def page_bounds(query: torch.Tensor, key: torch.Tensor, page: torch.Tensor, n_pages: int) -> torch.Tensor:
    """The bounds of ``bounds_of`` from every key at once (``page_extremes``) → [1, heads, q, pages] float32: the
    reference the tests hold the kept extremes' bounds to."""
    return bounds_of(query, *page_extremes(key, page, n_pages))


def top_pages(bounds: torch.Tensor, count: int, sink_pages: int = 0,
              earlier: torch.Tensor | None = None) -> torch.Tensor:
    """The ``count`` pages with the highest bound → [..., count] indices into the last axis of ``bounds``.

    The first ``sink_pages`` pages rank above every bound; ties go to the earlier page. ``earlier``
    [q, pages]: the pages each query may read, the others ranked last (None: all of them).
    """
    first = torch.arange(bounds.shape[-1], device=bounds.device) < sink_pages
    ranked = bounds
    if sink_pages:
        ranked = ranked.masked_fill(first if earlier is None else first & earlier, math.inf)
    if earlier is not None:
        ranked = ranked.masked_fill(~earlier, -math.inf)
    return torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :count]  # stable: ties keep order


def pages_read(bounds: torch.Tensor, own: torch.Tensor, page_budget: int, sink_pages: int = 0) -> torch.Tensor:
    """Each query's own page and the ``page_budget − 1`` earlier pages with the highest bound → [1, heads, q, pages].

    The first ``sink_pages`` pages rank above every bound (they count within the budget). Ties go to the
    earlier page. A query with fewer earlier pages reads them all.
    """
    pages = torch.arange(bounds.shape[-1], device=bounds.device)
    earlier = pages[None, :] < own[:, None]  # [q, pages]
    order = top_pages(bounds, page_budget - 1, sink_pages, earlier)
    read = torch.zeros_like(bounds, dtype=torch.bool).scatter(-1, order, True) & earlier
    return read | (pages[None, :] == own[:, None])
