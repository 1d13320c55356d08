"""Top-k retrieval over the corpus with BM25 (rank-bm25's Okapi variant)."""

from __future__ import annotations

import re

from rank_bm25 import BM25Okapi

from kvlab.errors import KvlabError
from kvlab.workloads.rag.corpus import Corpus

_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class Retriever:
    """BM25 over each document's title and text."""

    def __init__(self, corpus: Corpus) -> None:
        self.ids = [d.id for d in corpus.documents]
        self._bm25 = BM25Okapi([words(f"{d.title} {d.text}") for d in corpus.documents])

    def top_k(self, question: str, k: int) -> list[tuple[str, float]]:
        """The k best documents, best first, as (id, score)."""
        if not 1 <= k <= len(self.ids):
            raise KvlabError(f"k must be between 1 and {len(self.ids)} (the number of documents)")
        if not words(question):
            raise KvlabError("the question is empty")
        scores = self._bm25.get_scores(words(question))
        order = sorted(range(len(self.ids)), key=lambda i: (-scores[i], i))[:k]
        return [(self.ids[i], float(scores[i])) for i in order]
