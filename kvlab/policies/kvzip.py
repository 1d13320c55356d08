"""KVzip (Kim et al., 2025): keep the keys the model needs to reconstruct the context; query-agnostic.

Reference: snu-mllab/KVzip ``model/wrapper.py`` (``prefill``, ``self_task``, ``scoring``),
``attention/score.py`` (``KVScore._get_score``, ``_threshold``) and ``attention/kvcache.py``
(``EvictCache.prune``, level ``pair`` by default in ``args.py``); kvpress ``kvpress/presses/kvzip_press.py``.
After the new tokens are in the cache, the model is run on a prompt asking it to repeat them, followed by
the tokens themselves, chunk by chunk, over the cache (``kvlab.engine.reconstruction``; the repeat's own keys
are thrown away). A key's score is the most attention any repeating query gives it — the maximum over the
chunk's repeat queries and over the query heads of its KV head, each query's softmax over the sinks, the chunk
and the repeat, as ``_get_score`` computes it. Which question comes next plays no part.

Budget allocation follows the authors' default (``level="pair"``): one threshold over the scores of every
layer and every KV head together (``_threshold``: ``torch.sort`` of all scores, kept above the
``ratio``-th), so layers and heads keep different numbers of keys; kvlab keeps the top
``budget × layers × kv_heads`` (the model's whole token budget: the same bytes as any policy at that budget)
and really drops the rest. ``level="layer"`` is kvpress's ``layerwise=True`` (one top-k over the heads of
each layer); ``level="pair-uniform"`` is the authors' uniform head budgets (``_threshold_uniform``: each head
its own top-k). The first ``n_sink`` tokens always stay (kvpress's ``n_sink``, score 1) and take part in
every score's softmax.

In a conversation each append (the user message, then the reply) is reconstructed once, when it arrives,
and its scores stay with its slots across later evictions (``SlotLayer.reconstruction``), never recomputed;
old and new scores compete in one top-k. Where kvlab differs from the authors, and why:

- the authors keep the system prompt (their ``sink``: everything before the context) out of eviction and
  inside every score's softmax; kvlab has no separate system prompt to spare, so it keeps kvpress's
  ``n_sink`` first tokens instead;
- the authors' multi-turn path (``update_cache=True``) keeps each question and answer uncompressed; kvlab
  compresses them too (SCBench's multi-turn semantics, every policy alike), each scored by reconstructing
  it, as the issue asks;
- ``_threshold`` keeps the scores strictly above the ``ratio``-th one (one fewer than the ratio, and fewer
  on ties); kvlab keeps exactly the budget, ties to the lower layer, head, then the older slot;
- Gemma-3's sliding layers are left alone by the authors; in kvlab their keys compete for the budget too,
  so the bytes held stay within it.

The pass costs an extra prefill of about the new tokens again; the chat and arena records show its tokens
and seconds per turn (``extra_prefill_tokens``, ``extra_prefill_s``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.engine.reconstruction import CHUNK_SIZE, RepeatSpec
from kvlab.errors import KvlabError
from kvlab.policies.base import LayerView, Policy, force, param

LEVELS = ("pair", "layer", "pair-uniform")


@dataclass
class KVzip(Policy):
    name, label = "kvzip", "KVzip"
    summary = ("query-agnostic: the most attention a key gets while the model repeats the context; one top-k over "
               "every layer and head")
    needs_reconstruction = True
    n_sink: int = param(4, "first tokens always kept; every score's softmax includes them (kvpress's n_sink)", min=0)
    chunk_size: int = param(CHUNK_SIZE, "tokens repeated per reconstruction forward (the authors' chunk)", min=1)
    level: str = param("pair", "pair: one top-k over every head of every layer (the authors' default); layer: one "
                               "per layer over its heads (kvpress's layerwise); pair-uniform: each head its own top-k",
                       choices=LEVELS)

    @property
    def model_budget(self) -> bool:  # type: ignore[override]
        return self.level == "pair"

    @property
    def shared_budget(self) -> bool:  # type: ignore[override]
        return self.level == "layer"

    def min_budget(self) -> int:
        return self.n_sink + 1

    def repeat_spec(self) -> RepeatSpec:
        return RepeatSpec(n_sink=self.n_sink, chunk_size=self.chunk_size)

    def scores(self, view: LayerView) -> torch.Tensor:
        if view.reconstruction is None:
            raise KvlabError(f"{self.name}: this layer's slots have no reconstruction scores (the pass did not run)")
        sinks = (view.positions >= 0) & (view.positions < self.n_sink)  # a head's padding (-1) is no sink
        return force(view.reconstruction, sinks)
