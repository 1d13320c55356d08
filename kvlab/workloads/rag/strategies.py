"""How each strategy obtains the KV of [prefix][docs] before the question is prefilled.

Every strategy returns an ``Assembly``: the KV it starts from, the tokens it still has to
prefill (the question, or more for fixed ordering) and their position ids. ``prepare`` fills the
stores beforehand, so the timed part (TTFT) is assembly plus that one prefill.

- naive: chunks prefilled alone at offset 0, concatenated as they are (keys keep the rotation
  of offset 0); the question gets its true positions.
- recompose: as naive, but each chunk's keys are re-rotated by its offset Δp.
- cacheblend: recompose, then selective recompute of r% of the document tokens.
- fixed: documents in id order; the longest prefix shared with an earlier prompt is reused
  exactly from the prefix cache, the rest is prefilled.
- promptcache: each document owns the position range that starts at
  prefix_len + index_in_corpus × max_doc_len and is prefilled alone there; the question starts
  after the last reserved range among the prompt's documents (positions have gaps).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvlab.engine.facts import LoadedModel
from kvlab.engine.rope import rotate
from kvlab.registry import Registry
from kvlab.workloads.rag.blend import selective_recompute
from kvlab.workloads.rag.corpus import Corpus
from kvlab.workloads.rag.kv import SpanKV
from kvlab.workloads.rag.prefix_cache import PrefixCache
from kvlab.workloads.rag.prompt import Layout
from kvlab.workloads.rag.store import ChunkStore

FULL_LABEL = "Full prefill"  # the reference every strategy is measured against


@dataclass
class Stores:
    """What strategies reuse across prompts: chunk KV and the fixed-ordering prefix cache."""

    chunks: ChunkStore = field(default_factory=ChunkStore)
    prefixes: PrefixCache = field(default_factory=lambda: PrefixCache(capacity=8))


@dataclass(frozen=True)
class Assembly:
    kv: SpanKV  # the KV the strategy starts from
    rest: tuple[int, ...]  # tokens still to prefill
    positions: torch.Tensor  # their position ids [len(rest)]
    recomputed: int  # tokens whose KV is computed at request time
    compute_share: float  # token-layers computed at request time / full prefill's
    reused: int = 0  # fixed ordering: prompt tokens taken from the prefix cache


def reserved_starts(corpus: Corpus, layout: Layout, slot: int) -> list[int]:
    """Prompt Cache start position of each of the layout's documents."""
    return [len(layout.prefix) + corpus.index(d) * slot for d in layout.doc_ids]


def _question_positions(layout: Layout, start: int) -> torch.Tensor:
    return torch.arange(start, start + len(layout.question))


def naive(lm: LoadedModel, stores: Stores, layout: Layout) -> Assembly:
    parts = [stores.chunks.get(lm, layout.prefix)] + [stores.chunks.get(lm, d) for d in layout.docs]
    q = len(layout.question)
    return Assembly(SpanKV.cat(parts), layout.question, _question_positions(layout, layout.context_len), q,
                    q / len(layout))


def recompose(lm: LoadedModel, stores: Stores, layout: Layout) -> Assembly:
    parts = [stores.chunks.get(lm, layout.prefix)]
    for doc, offset in zip(layout.docs, layout.doc_offsets):
        kv = stores.chunks.get(lm, doc)
        parts.append(SpanKV(tuple(rotate(lm, k, offset, i) for i, k in enumerate(kv.keys)), kv.values))
    q = len(layout.question)
    return Assembly(SpanKV.cat(parts), layout.question, _question_positions(layout, layout.context_len), q,
                    q / len(layout))


def cacheblend(lm: LoadedModel, stores: Stores, layout: Layout, ratio: float, select_layer: int) -> Assembly:
    base = recompose(lm, stores, layout)
    start, end = layout.doc_span
    doc_ids = [t for d in layout.docs for t in d]
    blend = selective_recompute(lm, base.kv, doc_ids, start, ratio, select_layer)
    n_layers, n_doc, n_sel = len(base.kv.keys), end - start, len(blend.selected)
    first = min(select_layer, n_layers - 1) + 1  # layers every document token runs through
    work = (n_doc * first + n_sel * (n_layers - first)) / n_layers + len(layout.question)
    return Assembly(blend.kv, layout.question, base.positions, n_sel + len(layout.question), work / len(layout))


def fixed(lm: LoadedModel, stores: Stores, layout: Layout) -> Assembly:
    """``layout`` must already be in id order (see ``run.id_ordered``)."""
    context = layout.ids[: layout.context_len]
    matched, kv = stores.prefixes.lookup(context)
    if matched < len(layout.prefix):
        matched, kv = len(layout.prefix), stores.chunks.get(lm, layout.prefix)
    rest = tuple(layout.ids[matched:])
    return Assembly(kv, rest, torch.arange(matched, len(layout)), len(rest), len(rest) / len(layout),
                    reused=matched)


def promptcache_note(corpus: Corpus, layout: Layout, slot: int) -> str:
    """Why Prompt Cache scores as it does on the prompt ``layout``, in words, with its positions."""
    starts = reserved_starts(corpus, layout, slot)
    question, n = max(starts) + slot, len(corpus.documents)
    rule = (f"Prompt Cache follows the paper's rule: each prompt module (here a document) is encoded alone at the "
            f"position range its schema reserves, and the model is trusted to read positions with gaps. The schema "
            f"here reserves {slot:,} positions (the longest document) for each of the corpus's {n} "
            f"document{'s' * (n != 1)} in id order, ")
    if question == layout.context_len and starts != layout.doc_offsets:  # equal lengths, another order
        return rule + (f"so this prompt's documents, retrieved in another order, fill its positions without a gap, "
                       f"each where another would sit in one prompt (the question at position {question:,}, where it "
                       "would). "
                       "Like naive reuse, no document attends to the system text or to the other documents (each "
                       "one's first token becomes a sink of its own).")
    if starts == layout.doc_offsets and question == layout.context_len:
        return rule + (f"and this prompt's documents fill their ranges in order, so every token sits where it would "
                       f"in one prompt (the question at position {question:,}): no gap, and Prompt Cache equals RoPE "
                       "recomposition here. Like naive reuse, no document attends to the system text or to the "
                       "other documents (each one's first token becomes a sink of its own).")
    return rule + (f"so the question starts at position {question:,}, {question - layout.context_len:,} past where it "
                   f"would sit in one prompt of these documents ({layout.context_len:,}). Like naive reuse, no "
                   "document attends to the system text or to the other documents (each one's first token becomes a "
                   "sink of its own); unlike naive reuse, the text sits past gaps in its positions, which a small "
                   "model never met in training. The paper reports accuracy near the baseline for 7B-parameter "
                   "models; where Prompt Cache scores below naive reuse here, those gaps cost this model more than "
                   "naive reuse's drift.")


def promptcache(lm: LoadedModel, stores: Stores, corpus: Corpus, layout: Layout, slot: int) -> Assembly:
    starts = reserved_starts(corpus, layout, slot)
    parts = [stores.chunks.get(lm, layout.prefix)]
    parts += [stores.chunks.get(lm, doc, s) for doc, s in zip(layout.docs, starts)]
    q = len(layout.question)
    return Assembly(SpanKV.cat(parts), layout.question, _question_positions(layout, max(starts) + slot), q,
                    q / len(layout))


@dataclass(frozen=True)
class Env:
    """What a strategy works with for one question: the model, the stores, the corpus and the settings."""

    lm: LoadedModel
    stores: Stores
    corpus: Corpus
    slot: int  # Prompt Cache's reserved position range per document (the longest document)
    recompute: float = 0.15  # CacheBlend's share of document tokens recomputed
    select_layer: int = 1  # CacheBlend picks its tokens by the K/V deviation at this layer


class Strategy:
    """A way to obtain the KV of [prefix][docs] from stored pieces. Subclasses set the facts and ``assemble``."""

    name: ClassVar[str] = ""
    label: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    id_ordered: ClassVar[bool] = False  # runs on the prompt with its documents sorted by id

    def prepare(self, env: Env, layout: Layout) -> None:
        """Precompute what this strategy reuses (not part of TTFT): the system prefix's KV."""
        env.stores.chunks.get(env.lm, layout.prefix)

    def assemble(self, env: Env, layout: Layout) -> Assembly:
        """The timed step: the KV to start from and what is left to prefill."""
        raise NotImplementedError

    def remember(self, env: Env, layout: Layout, kv: SpanKV) -> None:
        """Keep what later prompts may reuse from this prompt's KV (after the timed part); nothing by default."""


class _ChunkReuse(Strategy):
    """Strategies that reuse each document's KV prefilled alone at offset 0."""

    def prepare(self, env: Env, layout: Layout) -> None:
        super().prepare(env, layout)
        for doc in layout.docs:
            env.stores.chunks.get(env.lm, doc)


class Naive(_ChunkReuse):
    name, label = "naive", "Naive reuse"
    summary = "chunks prefilled alone at offset 0, concatenated as they are"

    def assemble(self, env: Env, layout: Layout) -> Assembly:
        return naive(env.lm, env.stores, layout)


class Recompose(_ChunkReuse):
    name, label = "recompose", "RoPE recomposition"
    summary = "as naive, with each chunk's keys re-rotated by its offset"

    def assemble(self, env: Env, layout: Layout) -> Assembly:
        return recompose(env.lm, env.stores, layout)


class CacheBlend(_ChunkReuse):
    name, label = "cacheblend", "CacheBlend"
    summary = "RoPE recomposition, then selective recompute of a share of the document tokens"

    def assemble(self, env: Env, layout: Layout) -> Assembly:
        return cacheblend(env.lm, env.stores, layout, env.recompute, env.select_layer)


class Fixed(Strategy):
    name, label = "fixed", "Fixed ordering"
    summary = "documents in id order; the longest prefix shared with an earlier prompt is reused exactly"
    id_ordered = True

    def assemble(self, env: Env, layout: Layout) -> Assembly:
        return fixed(env.lm, env.stores, layout)

    def remember(self, env: Env, layout: Layout, kv: SpanKV) -> None:
        env.stores.prefixes.insert(layout.ids[: layout.context_len], kv.slice(0, layout.context_len))


class PromptCache(Strategy):
    name, label = "promptcache", "Prompt Cache"
    summary = "each document prefilled alone at its own reserved position range"

    def prepare(self, env: Env, layout: Layout) -> None:
        super().prepare(env, layout)
        for doc, start in zip(layout.docs, reserved_starts(env.corpus, layout, env.slot)):
            env.stores.chunks.get(env.lm, doc, start)

    def assemble(self, env: Env, layout: Layout) -> Assembly:
        return promptcache(env.lm, env.stores, env.corpus, layout, env.slot)


STRATEGIES: Registry[Strategy] = Registry("strategy", (Naive(), Recompose(), CacheBlend(), Fixed(), PromptCache()))
LABELS: dict[str, str] = {"full": FULL_LABEL} | STRATEGIES.labels()


def strategy_names(names: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """``names`` checked against the registry, each once, in the order given; an unknown name is a user error."""
    return tuple(dict.fromkeys(STRATEGIES.key(n) for n in names))
