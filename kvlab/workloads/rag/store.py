"""The chunk store: each document's KV prefilled alone, kept in memory under a byte budget (LRU)."""

from __future__ import annotations

from collections import OrderedDict

from kvlab.engine.facts import LoadedModel
from kvlab.workloads.rag.kv import SpanKV, prefill


class ChunkStore:
    """KV of text chunks prefilled alone, keyed by (model name, token ids, start position).

    Offset 0 is the usual case; Prompt Cache stores a chunk at its reserved start position.
    The least recently used chunks are dropped once ``max_bytes`` is exceeded.
    """

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[tuple, SpanKV] = OrderedDict()

    @property
    def nbytes(self) -> int:
        return sum(kv.nbytes for kv in self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    def get(self, lm: LoadedModel, ids: tuple[int, ...], offset: int = 0) -> SpanKV:
        """The chunk's KV, prefilled now on a miss."""
        key = (lm.facts.name, tuple(ids), offset)
        kv = self._items.get(key)
        if kv is not None:
            self._items.move_to_end(key)
            return kv
        kv = prefill(lm, ids, offset)
        self._items[key] = kv
        while len(self._items) > 1 and self.nbytes > self.max_bytes:
            self._items.popitem(last=False)
        return kv
