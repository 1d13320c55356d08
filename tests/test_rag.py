"""RAG chunk reuse: corpus and retrieval, exactness of recomposition / CacheBlend / fixed ordering,
deviation order, prefix-cache bookkeeping and the end-to-end run."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest
import torch
from tiny_models import eager_forward

from kvlab.engine.attention import ATTENTION_NAME
from kvlab.engine.cache import common_prefix
from kvlab.engine.facts import LoadedModel
from kvlab.errors import KvlabError
from kvlab.experiments.rag_report import rag_report
from kvlab.workloads.rag import strategies as S
from kvlab.workloads.rag.corpus import Question, load_corpus
from kvlab.workloads.rag.kv import SpanKV, cache_of, forward, prefill, relative_deviation
from kvlab.workloads.rag.prefix_cache import PrefixCache
from kvlab.workloads.rag.prompt import Layout, build_layout
from kvlab.workloads.rag.retrieval import Retriever
from kvlab.workloads.rag.run import RagLab, RagSettings, deviation_table, id_ordered, results_table, summary_table
from kvlab.workloads.rag.simulate import simulate
from kvlab.workloads.rag.store import ChunkStore
from kvlab.workloads.rag.upload import corpus_from_files

CORPUS = load_corpus()


def _full_kv(lm: LoadedModel, layout) -> tuple[SpanKV, torch.Tensor]:
    """A full prefill of the prompt by the model's own eager attention: its K/V and logits [tokens, vocab]."""
    logits, keys, values = eager_forward(lm, layout.ids)
    return SpanKV(tuple(keys), tuple(values)), logits


@pytest.mark.model
def test_corpus_shape_and_answers_in_their_documents(model: LoadedModel) -> None:
    assert len(CORPUS.documents) >= 12 and len(CORPUS.questions) >= 30
    for doc in CORPUS.documents:
        assert 150 <= len(model.encode(doc.text)) <= 500, doc.id
    for q in CORPUS.questions:
        assert q.docs and q.answer and q.answer_prefix
        assert any(q.answer in CORPUS.doc(d).text for d in q.docs), q.id
    codes = [m for d in CORPUS.documents for m in re.findall(r"\b\d{3,5}\b", d.text)]
    assert len(codes) == len(set(codes)), "every number in the corpus must be unique"


def test_retrieval_finds_the_pass_key_document() -> None:
    retriever = Retriever(CORPUS)
    assert retriever.top_k("What is the lamp room door code at the Karsk Point lighthouse?", 3)[0][0] == "d01"
    for q in CORPUS.questions:
        assert q.docs[0] in [d for d, _ in retriever.top_k(q.question, 3)], q.id
    with pytest.raises(KvlabError):
        retriever.top_k("lighthouse", 0)
    with pytest.raises(KvlabError):
        retriever.top_k("lighthouse", len(CORPUS.documents) + 1)
    with pytest.raises(KvlabError):
        retriever.top_k("  ?! ", 2)


@pytest.mark.model
def test_layout_segments_and_offsets(model: LoadedModel) -> None:
    q = CORPUS.questions[0]
    layout = build_layout(model, CORPUS, ["d03", "d01"], q)
    assert layout.ids == list(layout.prefix) + list(layout.docs[0]) + list(layout.docs[1]) + list(layout.question)
    assert layout.doc_offsets == [len(layout.prefix), len(layout.prefix) + len(layout.docs[0])]
    assert layout.doc_span == (len(layout.prefix), len(layout) - len(layout.question))
    assert model.decode(list(layout.question)).endswith(q.answer_prefix)
    assert id_ordered(layout, model, CORPUS, q).doc_ids == ("d01", "d03")


@pytest.mark.model
def test_recomposed_layer0_keys_equal_full_prefill_naive_do_not(model: LoadedModel) -> None:
    layout = build_layout(model, CORPUS, ["d05", "d02"], CORPUS.questions[4])
    full, _ = _full_kv(model, layout)
    stores = S.Stores()
    start, end = layout.doc_span
    recomposed = S.recompose(model, stores, layout).kv
    naive = S.naive(model, stores, layout).kv
    assert torch.allclose(recomposed.keys[0][:, start:end], full.keys[0][:, start:end], atol=1e-4, rtol=0)
    assert not torch.allclose(naive.keys[0][:, start:end], full.keys[0][:, start:end], atol=1e-2)
    # the prefix is the same computation in every strategy, and values carry no rotation
    assert torch.allclose(naive.keys[5][:, :start], full.keys[5][:, :start], atol=1e-4, rtol=0)
    assert torch.equal(naive.values[0], recomposed.values[0])


@pytest.mark.model
def test_mean_deviation_orders_naive_recompose_cacheblend(model: LoadedModel) -> None:
    stores, totals = S.Stores(), {"naive": 0.0, "recompose": 0.0, "cacheblend": 0.0}
    retriever = Retriever(CORPUS)
    for q in CORPUS.questions[:3]:
        layout = build_layout(model, CORPUS, [d for d, _ in retriever.top_k(q.question, 2)], q)
        full, _ = _full_kv(model, layout)
        span = layout.doc_span
        for name in totals:
            asm = (S.cacheblend(model, stores, layout, 0.15, 1) if name == "cacheblend"
                   else getattr(S, name)(model, stores, layout))
            k_dev, v_dev = relative_deviation(asm.kv.slice(*span), full.slice(*span))
            totals[name] += sum(k_dev) + sum(v_dev)
    assert totals["naive"] > totals["recompose"] > totals["cacheblend"] > 0


@pytest.mark.slow
def test_cacheblend_recomputing_everything_equals_full_prefill(tiny: LoadedModel) -> None:
    layout = build_layout(tiny, CORPUS, ["d07", "d11"], CORPUS.questions[6])
    full, _ = _full_kv(tiny, layout)
    asm = S.cacheblend(tiny, S.Stores(), layout, ratio=1.0, select_layer=1)
    n_doc = layout.doc_span[1] - layout.doc_span[0]
    assert asm.recomputed == n_doc + len(layout.question)
    for k, kf, v, vf in zip(asm.kv.keys, full.keys, asm.kv.values, full.values):
        assert torch.allclose(k, kf[:, : layout.context_len], atol=1e-4, rtol=0)
        assert torch.allclose(v, vf[:, : layout.context_len], atol=1e-4, rtol=0)
    # the attention switch used for scattered queries is restored
    assert tiny.model.config._attn_implementation == ATTENTION_NAME


def test_cacheblend_recomputes_the_requested_share(tiny: LoadedModel) -> None:
    layout = build_layout(tiny, CORPUS, ["d01", "d02"], CORPUS.questions[0])
    n_doc = layout.doc_span[1] - layout.doc_span[0]
    asm = S.cacheblend(tiny, S.Stores(), layout, ratio=0.2, select_layer=1)
    assert asm.recomputed - len(layout.question) == -(-n_doc * 2 // 10)  # ceil(0.2 · n_doc)


@pytest.mark.model
def test_fixed_ordering_reused_prefix_is_exact(model: LoadedModel) -> None:
    q = CORPUS.questions[7]
    layout = build_layout(model, CORPUS, ["d08", "d03"], q)
    stores = S.Stores()
    first = S.fixed(model, stores, layout)
    assert first.reused == len(layout.prefix)
    logits, cache = forward(model, first.rest, first.positions, cache_of(model, first.kv))
    stores.prefixes.insert(layout.ids[: layout.context_len], SpanKV.of_cache(cache, 0, layout.context_len))
    second = S.fixed(model, stores, layout)
    assert second.reused == layout.context_len and second.rest == layout.question
    logits2, _ = forward(model, second.rest, second.positions, cache_of(model, second.kv))
    _, full_logits = _full_kv(model, layout)
    q_len = len(layout.question)
    assert torch.allclose(logits2, full_logits[-q_len:], atol=1e-3, rtol=0)
    assert torch.allclose(logits[-q_len:], full_logits[-q_len:], atol=1e-3, rtol=0)


def test_promptcache_positions_are_reserved(tiny: LoadedModel) -> None:
    lab = RagLab(tiny, CORPUS)
    layout = build_layout(tiny, CORPUS, ["d04", "d02"], CORPUS.questions[3])
    starts = S.reserved_starts(CORPUS, layout, lab.slot)
    assert starts == [len(layout.prefix) + 3 * lab.slot, len(layout.prefix) + 1 * lab.slot]
    asm = S.promptcache(tiny, lab.stores, CORPUS, layout, lab.slot)
    assert int(asm.positions[0]) == starts[0] + lab.slot
    alone = prefill(tiny, layout.docs[0], starts[0])
    start = len(layout.prefix)
    assert torch.equal(asm.kv.keys[2][:, start : start + len(layout.docs[0])], alone.keys[2])


def test_chunk_store_hits_and_byte_bound(tiny: LoadedModel) -> None:
    a, b = tuple(tiny.encode("first chunk of text")), tuple(tiny.encode("a second, different chunk"))
    store = ChunkStore()
    kv = store.get(tiny, a)
    assert store.get(tiny, a) is kv and len(store) == 1  # a hit: the same KV, not prefilled again
    store.max_bytes = kv.nbytes  # room for one chunk
    kept_b = store.get(tiny, b)
    assert len(store) == 1 and store.get(tiny, b) is kept_b
    again = store.get(tiny, a)  # a was dropped for b: prefilled again, equal to the first
    assert again is not kv and torch.equal(again.keys[0], kv.keys[0]) and len(store) == 1


def test_prefix_cache_by_hand() -> None:
    import numpy as np

    assert common_prefix(np.array([1, 2, 3]), np.array([1, 2, 4, 5])) == 2
    assert common_prefix(np.array([1, 2]), np.array([1, 2, 3])) == 2
    cache = PrefixCache(capacity=2)
    cache.insert([1, 2, 3, 4])
    cache.insert([1, 2, 9])
    assert cache.lookup([1, 2, 3, 7])[0] == 3
    cache.insert([5, 6])  # evicts [1, 2, 9], the least recently used
    assert cache.lookup([1, 2, 9])[0] == 2 and len(cache) == 2


@pytest.mark.model
def test_fixed_order_stream_reuses_at_least_rank_order(model: LoadedModel) -> None:
    sim = simulate(model, CORPUS, CORPUS.questions, ks=[1, 3])
    rank = sim[sim.order == "rank"].set_index("k")
    ids = sim[sim.order == "id"].set_index("k")
    assert rank.loc[1, "tokens reused"] == ids.loc[1, "tokens reused"]  # one document: order is moot
    assert ids.loc[3, "tokens reused"] >= rank.loc[3, "tokens reused"]
    assert ((sim["token hit rate"] > 0) & (sim["token hit rate"] < 1)).all()


def test_every_side_is_timed_each_round_and_one_failing_late_is_recorded(tiny: LoadedModel,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Full prefill and every strategy run once a round; a strategy failing in round 2 is a failure (no times,
    no numbers), and the others keep one paired run per round."""
    calls: list[int] = []
    real = S.Recompose.assemble

    def breaks_in_round_two(self: S.Recompose, env: S.Env, layout: Layout) -> S.Assembly:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("broke in round 2")
        return real(self, env, layout)

    monkeypatch.setattr(S.Recompose, "assemble", breaks_in_round_two)
    settings = RagSettings(k=2, strategies=("naive", "recompose"), answer_tokens=2, runs=3)
    result = RagLab(tiny, CORPUS).run(CORPUS.questions[0], settings)
    full, naive, recompose = result.results
    assert len(full.ttft_runs_s) == len(naive.ttft_runs_s) == 3 and len(calls) == 2
    # full prefill's range is its runs' spread, as the summary says it (a walk read 1–1 there against 0.92–1.08)
    summary = summary_table([result]).set_index("strategy").iloc[0]
    assert (full.speedup_low, full.speedup_high) == (summary["speed-up low"], summary["speed-up high"])
    assert full.speedup_low < 1 < full.speedup_high
    assert naive.speedup_low <= naive.speedup <= naive.speedup_high
    assert recompose.error == "RuntimeError: broke in round 2" and not recompose.ttft_runs_s
    assert math.isnan(recompose.ttft_s) and math.isnan(recompose.speedup)
    # its counts are empty, not 0 tokens reused in 0 timed runs; the others' stay whole
    row = results_table([result]).set_index("key")
    counts = ["timed runs", "tokens reused", "doc tokens recomputed", "question tokens"]
    assert row.loc["recompose", counts].isna().all() and (row.loc["naive", "timed runs"] == 3)
    assert all(str(row[c].dtype) == "Int64" for c in counts)


def test_full_prefill_failing_stops_the_question_at_once(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every strategy is scored against full prefill: without it there is nothing to measure, so its error is raised
    at once, and Fixed ordering's prefix store is left as it was, even where Fixed was scored earlier."""
    import kvlab.workloads.rag.run as run_module

    lab, question = RagLab(tiny, CORPUS), CORPUS.questions[0]
    full_ids = lab.layout(question, 2)[0].ids
    real, assembled = run_module.forward, []

    def fails_in_round(n: int):
        def forward(lm: LoadedModel, ids, *args, **kwargs):
            if len(args) == 1 and list(ids) == list(full_ids):  # full prefill's own call: no cache to start from
                full_calls.append(1)
                if len(full_calls) == n:
                    raise RuntimeError("out of memory")
            else:
                assembled.append(1)
            return real(lm, ids, *args, **kwargs)
        return forward

    settings = RagSettings(k=2, strategies=("naive", "fixed"), answer_tokens=2, runs=3)
    for n, strategies_ran in ((1, False), (3, True)):  # round 3 runs fixed, full, naive: fixed is scored first
        full_calls: list[int] = []
        assembled.clear()
        monkeypatch.setattr(run_module, "forward", fails_in_round(n))
        with pytest.raises(RuntimeError, match="out of memory"):
            lab.run(question, settings)
        assert bool(assembled) == strategies_ran and len(lab.stores.prefixes) == 0


def test_a_strategy_failing_to_be_scored_is_its_own_failure(tiny: LoadedModel,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import kvlab.workloads.rag.run as run_module

    real = run_module.relative_deviation

    def fails_the_second(kv: SpanKV, ref: SpanKV) -> tuple:
        scored.append(1)
        if len(scored) == 2:  # round 2 runs naive, recompose, fixed, full: recompose is scored second
            raise ValueError("no score")
        return real(kv, ref)

    scored: list[int] = []
    monkeypatch.setattr(run_module, "relative_deviation", fails_the_second)
    settings = RagSettings(k=2, strategies=("naive", "recompose", "fixed"), answer_tokens=2, runs=2)
    full, naive, recompose, fixed = RagLab(tiny, CORPUS).run(CORPUS.questions[0], settings).results
    assert recompose.error == "ValueError: no score" and math.isnan(recompose.ttft_s) and not recompose.ttft_runs_s
    assert naive.error is None and fixed.error is None and len(naive.ttft_runs_s) == len(full.ttft_runs_s) == 2


def test_fixed_orderings_prefix_is_stored_once_a_question_and_hit_when_asked_again(tiny: LoadedModel) -> None:
    lab = RagLab(tiny, CORPUS)
    settings = RagSettings(k=2, strategies=("fixed",), answer_tokens=2, runs=3)
    first = lab.run(CORPUS.questions[0], settings).results[1]
    assert len(lab.stores.prefixes) == 1  # stored after the question, not between its rounds
    again = lab.run(CORPUS.questions[0], settings).results[1]
    assert first.doc_tokens_recomputed > 0 and again.doc_tokens_recomputed == 0 and len(lab.stores.prefixes) == 1
    assert again.kl < 1e-4


@pytest.mark.slow
def test_run_end_to_end_on_tiny(tiny: LoadedModel) -> None:
    lab = RagLab(tiny, CORPUS)
    settings = RagSettings(k=2, answer_tokens=3)
    result = lab.run(CORPUS.questions[0], settings)
    rows = {r.strategy: r for r in result.results}
    assert list(rows) == ["full", *S.STRATEGIES]
    assert all(r.error is None for r in rows.values()), [r.error for r in rows.values()]
    assert rows["full"].kl == 0.0 and rows["full"].top1 == 1.0
    assert all(r.kl >= -1e-9 and 0.0 <= r.top1 <= 1.0 for r in rows.values())
    assert rows["naive"].tokens_recomputed == rows["recompose"].tokens_recomputed < rows["cacheblend"].tokens_recomputed
    assert max(rows["fixed"].k_dev) < 1e-3 and max(rows["fixed"].v_dev) < 1e-3
    # request-time tokens split into the documents' and the question's: naive reuse recomputes no document token
    question = rows["full"].question_tokens
    assert question > 0 and all(r.question_tokens == question for r in rows.values())
    assert rows["naive"].doc_tokens_recomputed == 0 == rows["promptcache"].doc_tokens_recomputed
    assert rows["cacheblend"].doc_tokens_recomputed == rows["cacheblend"].tokens_recomputed - question > 0
    lay, _ = lab.layout(CORPUS.questions[0], 2)
    assert rows["full"].doc_tokens_recomputed == lay.doc_span[1] - lay.doc_span[0]
    table = results_table([result]).set_index("key")
    assert table.loc["naive", "doc tokens recomputed"] == 0 and table.loc["naive", "question tokens"] == question
    # Prompt Cache's question starts after the last reserved range, and the page says where and how far past
    layout = build_layout(tiny, CORPUS, [d for d, _ in result.retrieved], result.question)
    start = max(S.reserved_starts(CORPUS, layout, lab.slot)) + lab.slot
    assert start >= result.prompt_tokens - question
    assert f"position {start:,}, {start - layout.context_len:,} past where" in lab.promptcache_note(result)
    again = {r.strategy: r for r in lab.run(CORPUS.questions[0], settings).results}
    assert again["fixed"].tokens_reused == result.prompt_tokens - again["fixed"].tokens_recomputed
    assert again["fixed"].tokens_recomputed < rows["fixed"].tokens_recomputed
    summary = summary_table([result])
    assert list(summary.strategy)[0] == "Full prefill" and summary["speed-up"].iloc[0] == 1.0
    # the CLI's HTML report: its drift figures at the layer and head asked for, a refusal for one the model lacks
    sim = simulate(tiny, CORPUS, CORPUS.questions[:2])
    page = rag_report(tiny, CORPUS, summary, deviation_table([result]), sim, layer=1, head=3)
    assert "layer 1 head 3" in page and page.count("plotly.js v") == 1 and page.count('class="plotly-graph-div"') == 5
    gap = summary.assign(**{"speed-up": [float("nan"), *summary["speed-up"].iloc[1:]]})  # a strategy that failed
    table = rag_report(tiny, CORPUS, gap, deviation_table([result]), sim, layer=1, head=3).split("<div")[0]
    assert "NaN" not in table and "<td>—</td>" in table  # an empty cell is "—", as on the page
    with pytest.raises(KvlabError, match="needs at least one question"):
        simulate(tiny, CORPUS, [])
    with pytest.raises(KvlabError, match="drift head 4 is out of range"):
        rag_report(tiny, CORPUS, summary, deviation_table([result]), sim, layer=1, head=4)


def test_bad_settings_and_models_are_refused(tiny: LoadedModel) -> None:
    lab = RagLab(tiny, CORPUS)
    with pytest.raises(KvlabError, match="k must be"):
        lab.run(CORPUS.questions[0], RagSettings(k=0))
    with pytest.raises(KvlabError, match="unknown strategy .magic."):
        lab.run(CORPUS.questions[0], RagSettings(strategies=("naive", "magic")))
    with pytest.raises(KvlabError, match="empty"):
        lab.run(Question(id="x", question="   "), RagSettings())
    with pytest.raises(KvlabError, match="rotary"):
        RagLab(replace(tiny, facts=replace(tiny.facts, rope_theta=None)), CORPUS)


def test_prompt_cache_on_a_prompt_without_gaps_says_so_and_equals_recomposition(tiny: LoadedModel) -> None:
    """A walk's one-document corpus: Prompt Cache's reserved range is the prompt's own positions, but the note said
    the question started "although the prompt holds 63 tokens" and sat "hundreds to thousands of positions past"."""
    corpus = corpus_from_files([("vault.txt", b"The vault code is 4127. Only the keeper may open it.")])
    lab = RagLab(tiny, corpus)
    result = lab.run(Question(id="q", question="What is the vault code?"),
                     RagSettings(k=1, strategies=("recompose", "promptcache"), answer_tokens=2))
    rows = {r.strategy: r for r in result.results}
    assert rows["promptcache"].kl == pytest.approx(rows["recompose"].kl, abs=1e-6)
    note = lab.promptcache_note(result)
    assert "no gap" in note and "1 document in" in note and "past where" not in note


def test_prompt_cache_on_documents_retrieved_out_of_id_order_says_there_is_no_gap(tiny: LoadedModel) -> None:
    """Two documents of one length retrieved in reverse: they swap places, the question sits where it would, and the
    note said "0 past where it would sit" and "past gaps"."""
    corpus = corpus_from_files([("a.txt", b"The vault code is 4127."), ("b.txt", b"The gate code is 5521."),
                                ("c.txt", b"The shed code is 9911.")])
    assert len({len(tiny.encode(d.text)) for d in corpus.documents}) == 1
    lab = RagLab(tiny, corpus)
    result = lab.run(Question(id="q", question="What is the gate code?"),
                     RagSettings(k=2, strategies=("promptcache",), answer_tokens=2))
    assert [d for d, _ in result.retrieved] == ["d02", "d01"]
    note = lab.promptcache_note(result)
    assert "retrieved in another order, fill its positions without a gap" in note and "past gaps" not in note
