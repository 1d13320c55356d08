"""One RAG question through full prefill and every selected strategy, measured against it."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from functools import partial

import pandas as pd
import torch

from kvlab.engine.chatformat import chat_format
from kvlab.engine.facts import LoadedModel
from kvlab.engine.fidelity import fidelity
from kvlab.engine.progress import Progress
from kvlab.engine.timing import SINGLE_RUN_NOTE, Timing, paired_ratios, time_rounds
from kvlab.errors import KvlabError
from kvlab.workloads.rag import strategies as S
from kvlab.workloads.rag.corpus import Corpus, Question
from kvlab.workloads.rag.fidelity import greedy_answer, teacher_forced
from kvlab.workloads.rag.kv import SpanKV, cache_of, forward, relative_deviation
from kvlab.workloads.rag.prompt import Layout, build_layout, doc_text
from kvlab.workloads.rag.retrieval import Retriever


@dataclass(frozen=True)
class RagSettings:
    k: int = 3
    strategies: tuple[str, ...] = tuple(S.STRATEGIES)
    recompute: float = 0.15  # CacheBlend's share of document tokens recomputed
    select_layer: int = 1  # CacheBlend picks its tokens by the K/V deviation at this layer
    answer_tokens: int = 8
    runs: int = 1  # timed runs per TTFT; the median counts, fastest and slowest give the spread

    def check(self, n_docs: int, n_layers: int) -> None:
        if not 1 <= self.k <= n_docs:
            raise KvlabError(f"k must be between 1 and {n_docs} (the number of documents), not {self.k}")
        S.strategy_names(self.strategies)
        if not 0.0 < self.recompute <= 1.0:
            raise KvlabError(f"the recompute share must be in (0, 1], not {self.recompute:g}")
        if not 0 <= self.select_layer < n_layers:
            raise KvlabError(f"the selection layer must be in 0…{n_layers - 1}, not {self.select_layer}")
        if not 1 <= self.answer_tokens <= 64:
            raise KvlabError(f"answer tokens must be between 1 and 64, not {self.answer_tokens}")
        if not 1 <= self.runs <= 9:
            raise KvlabError(f"timed runs must be between 1 and 9, not {self.runs}")


@dataclass
class StrategyResult:
    """One strategy's answer to one question: its TTFT against full prefill's, the tokens it reused and computed,
    and its fidelity. A strategy that failed has ``error`` set and no measure (NaN, or None for a count)."""

    strategy: str
    ttft_s: float = float("nan")
    speedup: float = float("nan")  # full prefill's TTFT / this TTFT
    tokens_recomputed: int | None = None  # computed at request time: documents recomputed and the question
    compute_share: float = float("nan")
    tokens_reused: int | None = None
    kl: float = float("nan")
    top1: float = float("nan")
    answer: str = ""
    correct: bool | None = None
    k_dev: list[float] = field(default_factory=list)  # per layer, document tokens
    v_dev: list[float] = field(default_factory=list)
    error: str | None = None
    ttft_low_s: float = float("nan")  # fastest of the timed runs
    ttft_high_s: float = float("nan")  # slowest
    runs: int | None = None
    # tokens_recomputed split: document tokens computed at request time, and the question's tokens (every
    # strategy prefills the question); None in files saved before the split
    doc_tokens_recomputed: int | None = None
    question_tokens: int | None = None
    # each timed run, round by round (``time_rounds``): run i of every strategy was timed in the same round as full
    # prefill's run i, so speed-ups pair run with run; empty in a file saved before
    ttft_runs_s: list[float] = field(default_factory=list)
    speedup_low: float = float("nan")  # the lowest round's speed-up (NaN in a file saved before)
    speedup_high: float = float("nan")


@dataclass
class QuestionResult:
    """One question through full prefill and every strategy: what was retrieved, the prompt and each result."""

    question: Question
    retrieved: list[tuple[str, float]]
    prompt_tokens: int
    reference_answer: str
    results: list[StrategyResult]  # full prefill first
    settings: RagSettings | None = None  # what it ran with (None in a file saved before they were kept)

    def as_dict(self) -> dict:
        return {"question": asdict(self.question), "retrieved": self.retrieved, "prompt_tokens": self.prompt_tokens,
                "reference_answer": self.reference_answer, "results": [asdict(r) for r in self.results],
                "settings": None if self.settings is None else asdict(self.settings)}


@dataclass
class Reference:
    """Full prefill of one prompt with its greedy answer: what every strategy is measured against."""

    kv: SpanKV
    tokens: list[int]  # full prefill's greedy answer
    logits: torch.Tensor  # [answer tokens, vocab]: the logits that chose them


def id_ordered(layout: Layout, lm: LoadedModel, corpus: Corpus, question: Question) -> Layout:
    """The same prompt with its documents sorted by id (fixed ordering's prompt)."""
    return build_layout(lm, corpus, sorted(layout.doc_ids), question)


class RagLab:
    """Corpus, retriever and stores for one model; runs questions through the strategies."""

    def __init__(self, lm: LoadedModel, corpus: Corpus, stores: S.Stores | None = None) -> None:
        if not lm.facts.has_rope:
            raise KvlabError(f"{lm.facts.name} has no rotary position embedding: RoPE drift and re-rotation "
                             "do not apply, so the RAG strategies are off for it")
        self.lm, self.corpus = lm, corpus
        self.retriever = Retriever(corpus)
        self.stores = stores or S.Stores()
        # Prompt Cache's reserved range per document: the longest document
        self.slot = max(len(lm.encode(doc_text(corpus, d.id))) for d in corpus.documents)
        self.stop_ids = chat_format(lm.tokenizer, None).stop_ids  # the chat's rule: an answer ends where a reply would

    def layout(self, question: Question, k: int) -> tuple[Layout, list[tuple[str, float]]]:
        retrieved = self.retriever.top_k(question.question, k)
        return build_layout(self.lm, self.corpus, [d for d, _ in retrieved], question), retrieved

    def promptcache_note(self, result: QuestionResult) -> str:
        """Why Prompt Cache scores as it does on ``result``, in words, with that prompt's positions."""
        layout = build_layout(self.lm, self.corpus, [d for d, _ in result.retrieved], result.question)
        return S.promptcache_note(self.corpus, layout, self.slot)

    def _checked_layout(self, question: Question, settings: RagSettings) -> tuple[Layout, list[tuple[str, float]]]:
        """The question's prompt, with the settings and its length checked."""
        settings.check(len(self.corpus.documents), self.lm.facts.n_layers)
        if not question.question.strip():
            raise KvlabError("the question is empty")
        layout, retrieved = self.layout(question, settings.k)
        if len(layout) + settings.answer_tokens > self.lm.facts.context_length:
            raise KvlabError(f"the prompt ({len(layout)} tokens) does not fit the model's context")
        return layout, retrieved

    def _reference(self, layout: Layout, settings: RagSettings, prefill: tuple) -> Reference:
        """Full prefill's greedy answer, from its prefill's (logits, cache)."""
        logits, cache = prefill
        kv = SpanKV.of_cache(cache)
        tokens, ref_logits = greedy_answer(self.lm, logits[-1], kv, len(layout), settings.answer_tokens,
                                           self.stop_ids)
        return Reference(kv, tokens, ref_logits[: max(1, len(tokens))])  # the logits that chose the answer's tokens

    def run(self, question: Question, settings: RagSettings, progress: Progress | None = None) -> QuestionResult:
        """Full prefill and each strategy, timed in rounds (``time_rounds``), each strategy scored against full
        prefill as soon as its last round is done; one strategy failing is recorded, not raised, full prefill
        failing is raised at once."""
        lm = self.lm
        layout, retrieved = self._checked_layout(question, settings)
        fixed_layout = id_ordered(layout, lm, self.corpus, question)
        env = S.Env(lm, self.stores, self.corpus, self.slot, settings.recompute, settings.select_layer)
        chosen = [S.STRATEGIES[name] for name in S.strategy_names(settings.strategies)]
        lays = {s.name: fixed_layout if s.id_ordered else layout for s in chosen}
        for strategy in chosen:
            strategy.prepare(env, lays[strategy.name])
        steps = len(chosen) * settings.runs + settings.runs
        done = 0
        ref: Reference | None = None
        fixed_ref: SpanKV | None = None
        # what strategies keep for later prompts (Fixed ordering's prefix), kept only once the question has finished
        remember: list[partial] = []

        def settle(name: str, result: tuple, last_round: bool) -> StrategyResult | None:
            """Full prefill's first run becomes the reference; each strategy's last run is scored, then dropped."""
            nonlocal ref, fixed_ref, done
            done += 1
            if progress:
                progress(done / steps, f"{S.LABELS[name]} timed ({done} of {steps} timed runs)")
            if name == "full":
                if ref is None:
                    ref = self._reference(layout, settings, result)
                    if fixed_layout.doc_ids == layout.doc_ids:
                        fixed_ref = ref.kv
                return None
            if not last_round:
                return None
            strategy, (asm, (logits, cache)) = S.STRATEGIES[name], result
            lay = lays[name]
            kv = SpanKV.of_cache(cache)
            if strategy.id_ordered and fixed_ref is None:
                _, ref_cache = forward(lm, lay.ids, torch.arange(len(lay)), last_only=True)
                fixed_ref = SpanKV.of_cache(ref_cache)
            against = fixed_ref if strategy.id_ordered else ref.kv
            k_dev, v_dev = relative_deviation(kv.slice(*lay.doc_span), against.slice(*lay.doc_span))
            next_pos = int(asm.positions[-1]) + 1
            scores = fidelity(ref.logits, teacher_forced(lm, logits[-1], kv, next_pos, ref.tokens))
            # a greedy path that agrees with full prefill at every step is full prefill's answer
            tokens = ref.tokens if scores.top1 == 1.0 else greedy_answer(lm, logits[-1], kv, next_pos,
                                                                         settings.answer_tokens, self.stop_ids)[0]
            answer = lm.decode(tokens)
            remember.append(partial(strategy.remember, env, lay, kv))
            return StrategyResult(name, tokens_recomputed=asm.recomputed, compute_share=asm.compute_share,
                                  tokens_reused=asm.reused, kl=scores.kl, top1=scores.top1, answer=answer,
                                  correct=question.is_right(answer), k_dev=k_dev, v_dev=v_dev,
                                  doc_tokens_recomputed=asm.recomputed - len(lay.question),
                                  question_tokens=len(lay.question))

        if progress:
            progress(0.0, f"Full prefill and {_plural(len(chosen), 'strategy')}, timed in "
                          f"{_plural(settings.runs, 'round')}")
        sides = {"full": partial(forward, lm, layout.ids, torch.arange(len(layout)), last_only=True)}
        sides |= {s.name: partial(_assemble_and_run, env, s, lays[s.name]) for s in chosen}
        timed = time_rounds(sides, settings.runs, required={"full"}, settle=settle)
        for keep in remember:
            keep()
        full_runs = timed["full"].seconds
        full = Timing.of(full_runs)
        ref_answer = lm.decode(ref.tokens)
        # full prefill against itself: 1, its range its own runs' spread (the summary's rule, ``_speedups``)
        rows = [StrategyResult("full", full.median, 1.0, len(layout), 1.0, 0, 0.0, 1.0, ref_answer,
                               question.is_right(ref_answer), [0.0] * lm.facts.n_layers, [0.0] * lm.facts.n_layers,
                               None, full.low, full.high, full.runs, layout.doc_span[1] - layout.doc_span[0],
                               len(layout.question), full_runs, full.low / full.high, full.high / full.low)]
        for strategy in chosen:
            side = timed[strategy.name]
            if side.error is not None:
                exc = side.error
                rows.append(StrategyResult(strategy.name, error=f"{type(exc).__name__}: {exc}"))
                continue
            timing = Timing.of(side.seconds)
            ratios = paired_ratios(full_runs, side.seconds)  # both ran every round: one ratio a round
            rows.append(replace(side.result, ttft_s=timing.median, speedup=statistics.median(ratios),
                                ttft_low_s=timing.low, ttft_high_s=timing.high, runs=timing.runs,
                                ttft_runs_s=list(side.seconds), speedup_low=min(ratios), speedup_high=max(ratios)))
        if progress:
            progress(1.0, "Done")
        return QuestionResult(question, retrieved, len(layout), ref_answer, rows, settings)

    def replay(self, saved: list[QuestionResult], progress: Progress | None = None) -> list[QuestionResult]:
        """Each of ``saved``'s questions run again with the settings it ran with, in order."""
        again = []
        for i, result in enumerate(saved):
            if progress:
                progress(i / len(saved), f"question {i + 1} of {len(saved)}: {result.question.id}")
            again.append(self.run(result.question, result.settings))
        if progress:
            progress(1.0, f"{len(saved)} replayed")
        return again


def _plural(n: int, noun: str) -> str:
    """``n`` and ``noun``, in the plural unless ``n`` is 1 ("1 strategy", "3 rounds")."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun[:-1] + 'ies' if noun.endswith('y') else noun + 's'}"


def _assemble_and_run(env: S.Env, strategy: S.Strategy, layout: Layout) -> tuple[S.Assembly, tuple]:
    """The timed step of one strategy: its assembly, then the prefill of what it left (TTFT)."""
    asm = strategy.assemble(env, layout)
    return asm, forward(env.lm, asm.rest, asm.positions, cache_of(env.lm, asm.kv), last_only=True)


def _count(n: int | None) -> float:
    """A count as a table cell: NaN where there is none (a strategy that failed, a file saved before it was kept)."""
    return float("nan") if n is None else float(n)


def results_table(results: list[QuestionResult]) -> pd.DataFrame:
    """One row per question and strategy.

    Tokens computed at request time are split: document tokens (full prefill: every one) and the
    question's tokens, which every strategy prefills.
    """
    rows = []
    for qr in results:
        for r in qr.results:
            rows.append({
                "question": qr.question.id, "strategy": S.LABELS[r.strategy], "key": r.strategy,
                "docs": " ".join(d for d, _ in qr.retrieved), "prompt tokens": qr.prompt_tokens,
                "TTFT ms": r.ttft_s * 1000, "TTFT min ms": r.ttft_low_s * 1000, "TTFT max ms": r.ttft_high_s * 1000,
                "timed runs": _count(r.runs), "speed-up": r.speedup, "speed-up low": r.speedup_low,
                "speed-up high": r.speedup_high, "doc tokens recomputed": _count(r.doc_tokens_recomputed),
                "question tokens": _count(r.question_tokens),
                "compute share": r.compute_share, "tokens reused": _count(r.tokens_reused), "KL": r.kl, "top-1": r.top1,
                "mean K dev": sum(r.k_dev) / len(r.k_dev) if r.k_dev else float("nan"),
                "mean V dev": sum(r.v_dev) / len(r.v_dev) if r.v_dev else float("nan"),
                "answer": r.answer, "expected": qr.question.answer, "correct": r.correct, "error": r.error,
            })
    counts = ["prompt tokens", "timed runs", "doc tokens recomputed", "question tokens", "tokens reused"]
    return pd.DataFrame(rows).astype(dict.fromkeys(counts, "Int64"))  # whole, and empty where there is none


def rounds_of(rows: Iterable[StrategyResult]) -> int:
    """The number of rounds every one of ``rows`` was timed in (``time_rounds``), or 0 where they were not all timed
    so alike (a file saved before rounds, or questions run with different numbers of runs): speed-ups over them
    are then ratios of medians, not medians of the rounds' ratios."""
    counts = {len(r.ttft_runs_s) for r in rows}
    return counts.pop() if len(counts) == 1 else 0


def _speedups(results: list[QuestionResult], key: str) -> dict[str, float]:
    """``key``'s speed-up over full prefill, summed over the questions it answered, each against its own run's full
    prefill (a question asked twice is two runs), with its low and high.

    Every question timed in the same number of rounds: the median, lowest and highest of the rounds' ratios of
    full prefill's total TTFT to ``key``'s. Otherwise (a file saved before; full prefill against itself): total
    median over total median, low and high pairing the slowest runs of one side with the fastest of the other.
    """
    pairs = [(qr.results[0], r) for qr in results for r in qr.results if r.strategy == key and not r.error]
    if not pairs:
        return {"speed-up": float("nan"), "speed-up low": float("nan"), "speed-up high": float("nan")}
    n = rounds_of(r for qr in results for r in qr.results if not r.error)  # one rule for every row and the note
    if key != "full" and n:
        rounds = [sum(f.ttft_runs_s[i] for f, _ in pairs) / sum(r.ttft_runs_s[i] for _, r in pairs)
                  for i in range(n)]
        return {"speed-up": statistics.median(rounds), "speed-up low": min(rounds), "speed-up high": max(rounds)}

    def total(side: int, what: str) -> float:
        return sum(getattr(pair[side], what) for pair in pairs)

    return {"speed-up": total(0, "ttft_s") / total(1, "ttft_s"),
            "speed-up low": total(0, "ttft_low_s") / total(1, "ttft_high_s"),
            "speed-up high": total(0, "ttft_high_s") / total(1, "ttft_low_s")}


def timing_note(results: list[QuestionResult]) -> str:
    """How far the TTFT figures of ``results`` can be trusted, in words (the page and the CLI)."""
    timed = [r for q in results for r in q.results if r.error is None]
    counts = sorted({r.runs for r in timed}) or [1]
    if counts == [1]:
        return SINGLE_RUN_NOTE
    if counts[0] == 1:
        return ("Some questions here were timed once, others in several rounds: a single run is not a speed "
                "measurement, so the summary's speed-ups are ratios of total times, not medians of rounds; ask "
                "every question for several runs to see the median and the spread.")
    rounds = ("each run is a round that times full prefill and every strategy once, back to back, the order turned "
              "each round, so a load that comes and goes moves both sides of a ratio")
    if rounds_of(timed):
        how = (f"{rounds}; the speed-up is the median of the rounds' ratios, its low and high the lowest and highest "
               "round")
    elif all(r.ttft_runs_s for r in timed):
        how = (f"{rounds}. These questions were run with different numbers of rounds, so the summary's speed-up is a "
               "ratio of total medians, its low and high pairing the slowest runs of one side with the fastest of "
               "the other; each question's own row is still the median of its rounds")
    else:  # a saved run from before rounds
        how = "the speed-up's low and high pair the slowest runs of one side with the fastest of the other"
    runs = str(counts[0]) if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"
    return (f"TTFT is the median of {runs} runs (min and max ms beside it); {how}. Full prefill's own range "
            "is its slowest run over its fastest. Where a range spans 1×, this machine does not tell the strategy "
            "from full prefill.")


def summary_table(results: list[QuestionResult]) -> pd.DataFrame:
    """Per strategy over all questions: accuracy, mean KL, top-1, tokens computed at request time, TTFT speed-up.

    The speed-up is total full-prefill TTFT over the strategy's total TTFT (``_speedups``); a range that spans 1
    does not tell the two apart on this machine.
    """
    df = results_table(results)
    out = []
    for key, group in df.groupby("key", sort=False):
        ok = group[group.error.isna()]
        graded = ok.correct.dropna()
        out.append({
            "strategy": S.LABELS[key], "questions": len(group), "failed": int(group.error.notna().sum()),
            "accuracy": float(graded.astype(float).mean()) if len(graded) else float("nan"),
            "mean KL": ok.KL.mean(), "top-1": ok["top-1"].mean(),
            "doc tokens recomputed": ok["doc tokens recomputed"].mean(),
            "question tokens": ok["question tokens"].mean(),
            "compute share": ok["compute share"].mean(), "TTFT ms": ok["TTFT ms"].mean(),
            **_speedups(results, key),
            "mean K dev": ok["mean K dev"].mean(), "mean V dev": ok["mean V dev"].mean(),
        })
    return pd.DataFrame(out)


def deviation_table(results: list[QuestionResult]) -> pd.DataFrame:
    """Mean per-layer K and V deviation per strategy (long format: strategy, layer, K, V)."""
    rows = []
    for qr in results:
        for r in qr.results:
            for layer, (k, v) in enumerate(zip(r.k_dev, r.v_dev)):
                rows.append({"strategy": S.LABELS[r.strategy], "layer": layer, "K": k, "V": v})
    if not rows:
        return pd.DataFrame(columns=["strategy", "layer", "K", "V"])
    return pd.DataFrame(rows).groupby(["strategy", "layer"], sort=False, as_index=False).mean()
