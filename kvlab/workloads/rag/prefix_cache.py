"""A token-level prefix cache: the longest stored prefix of a new prompt, optionally with its KV.

Entries are whole token sequences (LRU when ``capacity`` is set). A lookup compares the new
prompt with every entry and returns the longest common prefix: those tokens' KV is exactly what a
full prefill would compute, because causal attention never looks past them.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from kvlab.engine.cache import common_prefix
from kvlab.workloads.rag.kv import SpanKV


class PrefixCache:
    """Stored token sequences (with optional KV for them), LRU-bounded by entry count."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self._items: OrderedDict[tuple[int, ...], SpanKV | None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def lookup(self, ids: list[int] | tuple[int, ...]) -> tuple[int, SpanKV | None]:
        """Longest common prefix with any entry → (tokens matched, that entry's KV sliced to them)."""
        query = np.asarray(ids)
        best, best_key = 0, None
        for key in self._items:
            n = common_prefix(query, np.asarray(key))
            if n > best:
                best, best_key = n, key
        if best_key is None:
            return 0, None
        self._items.move_to_end(best_key)
        kv = self._items[best_key]
        return best, (kv.slice(0, best) if kv is not None else None)

    def insert(self, ids: list[int] | tuple[int, ...], kv: SpanKV | None = None) -> None:
        key = tuple(ids)
        self._items[key] = kv
        self._items.move_to_end(key)
        while self.capacity is not None and len(self._items) > self.capacity:
            self._items.popitem(last=False)
