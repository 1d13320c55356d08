"""Fixed ordering as a prefix-cache workload: replay the question set as a stream of prompts.

Token level only (no model forward): every prompt is tokenised, looked up in a prefix cache
and inserted. Rank order puts the retrieved documents best first, so the same set in another
order shares only the system prefix; id order makes equal sets, and sets sharing their lowest
ids, share a longer prefix.
"""

from __future__ import annotations

import pandas as pd

from kvlab.engine.facts import LoadedModel
from kvlab.errors import KvlabError
from kvlab.workloads.rag.corpus import Corpus, Question
from kvlab.workloads.rag.prefix_cache import PrefixCache
from kvlab.workloads.rag.prompt import build_layout
from kvlab.workloads.rag.retrieval import Retriever

ORDERS = ("rank", "id")


def check_capacity(capacity: int | None) -> None:
    """Refuse a prefix cache that keeps fewer than no prompts (None or 0: it keeps every one)."""
    if capacity is not None and capacity < 0:
        raise KvlabError(f"the prefix cache keeps 0 (unbounded) or more prompts, not {capacity}")


def simulate(
    lm: LoadedModel, corpus: Corpus, questions: list[Question] | tuple[Question, ...],
    ks: range | list[int] | None = None, capacity: int | None = None,
) -> pd.DataFrame:
    """Hit rates per document order and k (default 1…5, fewer in a smaller corpus). ``capacity``: prompts the
    cache keeps (None: all).

    token hit rate = prompt tokens served from the cache / prompt tokens; query hit rate =
    share of queries that reuse at least their first whole document.
    """
    if not questions:
        raise KvlabError("the prefix-cache simulation needs at least one question")
    check_capacity(capacity)
    if ks is None:
        ks = range(1, min(5, len(corpus.documents)) + 1)
    retriever = Retriever(corpus)
    rows = []
    for k in ks:
        ranked = [[d for d, _ in retriever.top_k(q.question, k)] for q in questions]
        for order in ORDERS:
            cache = PrefixCache(capacity)
            total = reused = hits = 0
            for q, docs in zip(questions, ranked):
                layout = build_layout(lm, corpus, sorted(docs) if order == "id" else docs, q)
                ids = layout.ids
                matched, _ = cache.lookup(ids)
                cache.insert(ids)
                total += len(ids)
                reused += matched
                hits += matched >= len(layout.prefix) + len(layout.docs[0])
            rows.append({"order": order, "k": k, "queries": len(questions), "prompt tokens": total,
                         "tokens reused": reused, "token hit rate": reused / total,
                         "query hit rate": hits / len(questions)})
    return pd.DataFrame(rows)
