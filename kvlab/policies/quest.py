"""Quest (Tang et al., 2024): keep every key; each query reads only the pages that may matter to it.

Reference: mit-han-lab/Quest ``quest/models/QuestAttention.py`` and ``quest/utils/controller.py``
(the kernel path; ``evaluation/quest_attention.py`` is its simulation). The cache is split into
pages of ``page_size`` slots; each page keeps the element-wise min and max of its keys. A query
``q`` bounds its score on a page by ``Σ_d max(q_d·min_d, q_d·max_d)`` and reads the
``page_budget − 1`` pages with the highest bound plus the page its own token is in; attention runs
over the keys of those pages only. As in the authors' code the first ``dense_layers`` layers read
everything, the prompt's prefill is dense (only decoding queries read sparsely: in kvlab, the
reply's tokens, decoded or fed), and a query with no more pages than the budget reads all of them.
kvlab's session budget is the token budget: ``page_budget = budget // page_size``. The authors force no
sink page; ``sink_pages`` (a kvlab variant, default 0) makes the first pages part of every read, as
StreamingLLM keeps its first tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvlab.engine.facts import ModelFacts
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
    # layer -> [kv_heads, pages] the pages the newest sparse query read (any query head of the KV head's group)
    last_read: dict[int, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

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
            self.last_read[layer] = torch.ones(key.shape[1], n_pages, dtype=torch.bool)
            return None
        bounds = page_bounds(query, key, page, n_pages)  # [1, heads, q, pages]
        read = pages_read(bounds, own, self.page_budget, self.quest.sink_pages)  # [1, heads, q, pages]
        self.last_read[layer] = read[0, :, -1].view(key.shape[1], -1, n_pages).any(1).cpu()
        mask = read.gather(-1, page.clamp(min=0).expand(*read.shape[:-1], k_len)) & (page >= 0)
        self.keys_read += int((mask & causal).sum())
        return mask

    def metadata_bytes(self, slots: int, facts: ModelFacts) -> int:
        return self.quest.metadata_bytes(slots, facts)

    def pages_read_last(self) -> list[list[list[int]]]:
        """[layer][kv_head] the pages the newest sparse query read, then forgotten (the next turn's are its own)."""
        pages = [[torch.nonzero(row).flatten().tolist() for row in self.last_read[layer]]
                 for layer in sorted(self.last_read)]
        self.last_read = {}
        return pages

    @property
    def read_share(self) -> float | None:
        """Share of the keys sparse queries could read that they did read (None before any)."""
        return self.keys_read / self.keys_held if self.keys_held else None


def page_bounds(query: torch.Tensor, key: torch.Tensor, page: torch.Tensor, n_pages: int) -> torch.Tensor:
    """Upper bound of q·k over each page's keys: Σ_d max(q_d·min_d, q_d·max_d) → [1, heads, q, pages] float32.

    ``page`` [k] is each slot's page (−1: a padded slot, in no page).
    """
    _, kv_heads, k_len, d = key.shape
    heads = query.shape[1]
    keys = key[0].float()  # [kv_heads, k, d]
    index = page.clamp(min=0)[None, :, None].expand(kv_heads, k_len, d)
    real = (page >= 0)[None, :, None]
    low = torch.full((kv_heads, n_pages, d), math.inf, device=key.device)
    high = torch.full((kv_heads, n_pages, d), -math.inf, device=key.device)
    low = low.scatter_reduce(1, index, keys.masked_fill(~real, math.inf), "amin")
    high = high.scatter_reduce(1, index, keys.masked_fill(~real, -math.inf), "amax")
    q = query[0].float().view(kv_heads, heads // kv_heads, -1, d)  # query heads by KV head (GQA)
    bound = q.clamp(min=0) @ high[:, None].transpose(-1, -2) + q.clamp(max=0) @ low[:, None].transpose(-1, -2)
    return bound.reshape(1, heads, -1, n_pages)


def pages_read(bounds: torch.Tensor, own: torch.Tensor, page_budget: int, sink_pages: int = 0) -> torch.Tensor:
    """Each query's own page and the ``page_budget − 1`` earlier pages with the highest bound → [1, heads, q, pages].

    The first ``sink_pages`` pages rank above every bound (they count within the budget). Ties go to the
    earlier page. A query with fewer earlier pages reads them all.
    """
    n_pages = bounds.shape[-1]
    pages = torch.arange(n_pages, device=bounds.device)
    earlier = pages[None, :] < own[:, None]  # [q, pages]
    ranked = bounds.masked_fill(earlier & (pages[None, :] < sink_pages), math.inf).masked_fill(~earlier, -math.inf)
    # stable: among equal bounds the earlier page ranks first
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., : page_budget - 1]
    read = torch.zeros_like(bounds, dtype=torch.bool).scatter(-1, order, True) & earlier
    return read | (pages[None, :] == own[:, None])
