"""Page 2: RAG prompts from cached document chunks — RoPE drift and what each fix buys back."""

from __future__ import annotations

import copy

import pandas as pd
import streamlit as st

from kvlab.engine.facts import LoadedModel
from kvlab.errors import KvlabError
from kvlab.export import table_csv, to_json
from kvlab.files import MB
from kvlab.saved import ReplayCheck, now, read_json
from kvlab.viz import rag as viz
from kvlab.workloads.rag.corpus import DEFAULT_CORPUS, Corpus, Question, load_corpus
from kvlab.workloads.rag.drift import check_drift, drift_angles, measure_drift
from kvlab.workloads.rag.record import made_on, rag_differences, rag_from_json, rag_record, replay_refusal
from kvlab.workloads.rag.run import RagLab, RagSettings, deviation_table, results_table, summary_table, timing_note
from kvlab.workloads.rag.simulate import check_capacity, simulate
from kvlab.workloads.rag.strategies import STRATEGIES, Stores
from kvlab.workloads.rag.upload import MAX_CORPUS_FILE_BYTES, corpus_from_files
from ui.common import (
    as_written,
    marked_while_running,
    new_files,
    new_upload,
    page_bar,
    page_start,
    said_refusal,
    say_cut_short,
    say_replay,
)
from ui.figures import download_all_figures
from ui.tables import compact_table, transposed

# fixed ordering's count of prompt tokens served from its prefix cache, named for what it counts: every other
# strategy reuses documents' K/V and reads 0 here; the downloads keep the column names
SHOWN_AS = {"tokens reused": "prefix-cache tokens"}

lm = page_start(
    "RAG & RoPE drift",
    "Documents are prefilled once, alone at offset 0, and their KV is reused when a prompt places them after "
    "the system text and other documents. Each strategy is measured against a full prefill of the same prompt. "
    "The documents are the built-in corpus's or your own.",
)
if not lm.facts.has_rope:
    st.warning(f"This page is off for {lm.facts.name}: the model has no rotary position embedding, so there is "
               "no RoPE drift to show and no keys to re-rotate. Pick a RoPE model (Llama, Qwen, Mistral…).")
    st.stop()


@st.cache_resource(show_spinner=False)
def _corpus() -> Corpus:
    return load_corpus(DEFAULT_CORPUS)


@st.cache_resource(show_spinner=False, max_entries=2)
def _lab(name: str, _lm: LoadedModel) -> RagLab:
    """One lab per model on the built-in corpus (its documents encoded once), shared by sessions; each session
    runs it on caches of its own (``session_lab``)."""
    return RagLab(_lm, _corpus())


def own_lab(corpus: Corpus) -> RagLab:
    """This session's lab on its own corpus: built once per model and corpus (its documents encoded once)."""
    key = (lm.facts.name, id(corpus))
    if state.get("rag_own_lab", (None, None))[0] != key:
        state.rag_own_lab = (key, RagLab(lm, corpus))
    return state.rag_own_lab[1]


def session_lab(base: RagLab) -> RagLab:
    """``base`` (its documents encoded once) with this session's caches: every list of results starts on fresh
    ones, so that a saved list replays exactly (the fixed-ordering prefix cache's hits depend on what ran before)."""
    lab = copy.copy(base)
    lab.stores = state.setdefault("rag_stores", Stores())
    return lab


def new_list(opened: tuple | None = None, data: dict | None = None) -> None:
    """Start a new list of results, on fresh caches: empty, or ``opened`` from a file (results, stamp) with its
    JSON ``data`` kept for a replay."""
    state.rag_results, state.rag_opened = opened or ([], None)
    state.rag_opened_data, state.rag_stores, state.rag_replay_check = data, Stores(), None


state = st.session_state
state.setdefault("rag_results", [])
BUILT_IN, OWN = "built-in", "own"
c1, c2 = st.columns([2, 3])
CORPUS_HELP = ('JSON: {"name", "system", "documents": [{"id", "title", "text"}], "questions": [{"question", '
               '"answer", "answer_prefix", "docs"}]}, only "documents" required (the README has the details). Text '
               "files have no question set: you type the questions, with no answer check.")
with c2:
    files = new_files(f"Your corpus: one JSON file in the built-in corpus's format, or .txt / .md files, one "
                      f"document each, titled by its file name (at most {MAX_CORPUS_FILE_BYTES // MB} MB a file)",
                      "rag_corpus_upload", ["json", "txt", "md"], help=CORPUS_HELP,
                      max_mb=MAX_CORPUS_FILE_BYTES // MB)
if files is not None:
    try:
        loaded = corpus_from_files(files)
        if loaded != state.get("rag_own_corpus"):  # the same documents again (a refused file removed) keep results
            state.rag_own_corpus = loaded
        state.rag_corpus_source = OWN  # drawn below: the new corpus is the one in use
    except KvlabError as exc:
        others = " Take that file away to load the others." if len(files) > 1 else ""
        c2.error(f"{exc}. The corpus in use stays.{others}")
own = state.get("rag_own_corpus")
which = c1.radio("Corpus", [BUILT_IN, OWN], horizontal=True, persist_state="session", key="rag_corpus_source",
                 format_func={BUILT_IN: f"built-in ({len(_corpus().documents)} documents)",
                              OWN: f"{own.name} ({len(own.documents)} document{'s' * (len(own.documents) > 1)})"
                              if own else "your own"}.get,
                 help="Switching corpus starts a new list of results: they are about the documents retrieved.")
if which == OWN and own is None:
    c1.info("No corpus of your own yet: upload one. The built-in corpus is in use until then.")
corpus = own if which == OWN and own is not None else _corpus()
if state.get("rag_corpus_in_use") not in (None, id(corpus)):  # results, stream and drift are the old corpus's
    new_list()
    state.pop("rag_sim", None)
    state.pop("rag_drift", None)
state.rag_corpus_in_use = id(corpus)
lab = session_lab(own_lab(corpus) if corpus is own else _lab(lm.facts.name, lm))
if lab.slot > lm.facts.context_length:  # lab.slot: the longest document's tokens
    st.warning(f"The longest document of {corpus.name} is {lab.slot:,} tokens, beyond {lm.facts.name}'s trained "
               f"context of {lm.facts.context_length:,}: its prompts run past the positions the model knows.")

tab_run, tab_drift, tab_stream = st.tabs(["Strategies", "RoPE drift", "Fixed-ordering stream"])

with tab_run:
    if corpus.questions:
        source = st.radio("Question", ["From the question set", "Free text"], horizontal=True,
                          persist_state="session", key="rag_source")
    else:
        source = "Free text"
        st.caption(f"This corpus ({corpus.name}) has no question set: type your questions (no answer check). A "
                   "JSON corpus may carry its own, with answers, in a 'questions' list.")
    if source == "From the question set":
        question = st.selectbox("Question", corpus.questions, persist_state="session", key="rag_pick",
                                format_func=lambda q: f"{q.id} — {q.question} (answer: {q.answer or 'not checked'})")
    else:
        text = st.text_input("Your question (no answer check)", persist_state="session", key="rag_text")
        question = Question(id="free", question=text)
    chosen = st.multiselect("Strategies", list(STRATEGIES), default=list(STRATEGIES),
                            persist_state="session", key="rag_strategies",
                            format_func=lambda s: STRATEGIES[s].label,
                            help=" · ".join(f"{s.label}: {s.summary}" for s in STRATEGIES.values()))
    c1, c2, c3, c4, c5 = st.columns(5)
    # unbounded: a value out of range is refused in words at Run (a bounded field would keep an older one)
    k = c1.number_input("k (documents)", value=min(RagSettings.k, len(corpus.documents)), step=1,
                        persist_state="session", key="rag_k")
    answer_tokens = c2.number_input("Answer tokens", value=RagSettings.answer_tokens, step=1, persist_state="session",
                                    key="rag_answer_tokens",
                                    help="Tokens each greedy answer may take (1–64). The answer check looks for the "
                                         "answer in them: a question with no answer prefix is answered in a sentence "
                                         "that must reach the answer within them.")
    recompute = c3.slider("CacheBlend recompute %", 1, 100, 15, persist_state="session", key="rag_recompute")
    select_layer = c4.number_input("Selection layer", value=1, step=1, persist_state="session", key="rag_select_layer")
    runs = c5.number_input("Timed runs per TTFT (median)", value=3, step=1, persist_state="session", key="rag_runs",
                           help="Each strategy's time to first token is measured this many times, in rounds that "
                                "time full prefill and every strategy once each; the table shows the median, the "
                                "fastest and the slowest run.")
    b1, b2, b3 = st.columns([1, 2, 4])
    run = b1.button("Run", type="primary", key="rag_run")
    if b2.button("Clear results", key="rag_clear"):
        new_list()
    with b3.popover("Open a saved run"):
        raw = new_upload("A downloaded RAG run (JSON): drawn from the file at once, no model run; it replaces the "
                         "results below", "rag_open")
        if raw is not None:
            try:
                data = read_json(raw, "RAG run")
                new_list(rag_from_json(data), data)
                st.rerun()
            except KvlabError as exc:
                st.error(str(exc))

    if run:
        settings = RagSettings(k=int(k), strategies=tuple(chosen), recompute=recompute / 100,
                               select_layer=int(select_layer), answer_tokens=int(answer_tokens), runs=int(runs))
        try:
            if not question.question.strip():
                raise KvlabError("the question is empty: type a question or pick one from the set")
            if not chosen:
                raise KvlabError("pick at least one strategy")
            settings.check(len(corpus.documents), lm.facts.n_layers)
            # a live run after a file, or on another model than the list's, starts a list of its own on fresh caches
            if state.get("rag_opened") is not None or state.get("rag_model", lm.facts.name) != lm.facts.name:
                new_list()
                lab = session_lab(lab)
            with (marked_while_running("rag_running", question.question),
                  st.status("Running full prefill and the strategies…", expanded=True) as status):
                result = lab.run(question, settings, progress=page_bar())
                status.update(label="Done", state="complete", expanded=False)
            state.rag_results, state.rag_model = state.rag_results + [result], lm.facts.name
        except KvlabError as exc:
            st.error(str(exc))
    elif cut := state.pop("rag_running", None):
        say_cut_short(f"The run of “{cut}”", False, "it is not in the results", "Run it again.")

    results = state.rag_results
    if results and (opened := state.get("rag_opened")) is not None:
        st.info(f"**Opened from a file, no model run**: every table and chart below is the file's record "
                f"({opened.label()}). **Run** measures afresh on the model in the sidebar, in a list of its own.")
        if refusal := replay_refusal(state.rag_opened_data, results, corpus):
            st.caption(f"No replay: {refusal}.")
        elif st.button(f"Replay: run these {len(results)} question(s) again on {lm.facts.name} and check them",
                       key="rag_replay_button"):
            saved = results
            new_list()
            fresh = session_lab(lab)
            with st.status("Replaying the file's questions…", expanded=True) as status:
                again = fresh.replay(saved, page_bar())
                status.update(label="Replayed", state="complete", expanded=False)
            state.rag_results, state.rag_model = again, lm.facts.name
            state.rag_replay_check = ReplayCheck(rag_differences(saved, again), "every question", opened,
                                                 lm.facts.name)
            st.rerun()
    elif results and (ran_on := state.get("rag_model", lm.facts.name)) != lm.facts.name:
        st.info(f"**These results ran on {ran_on}**; the sidebar now has {lm.facts.name}. Their downloads say "
                f"{ran_on}; **Run** measures on {lm.facts.name} in a list of its own.")
    if (check := state.get("rag_replay_check")) is not None:
        say_replay(check)
    if results:
        last = results[-1]
        titles = {d.id: d.title for d in corpus.documents}  # a file from another corpus may name other ids
        asked = last.question.question
        st.subheader(f"Last question: {as_written(asked[:300])}{'…' if len(asked) > 300 else ''}")
        st.markdown("Retrieved (BM25, rank order): "
                    + ", ".join(f"**{as_written(d)}** ({as_written(titles.get(d, 'not in this corpus'))}, {s:.2f})"
                                for d, s in last.retrieved)
                    + f" · prompt {last.prompt_tokens} tokens · full prefill's answer: "
                      f"“{as_written(last.reference_answer.strip())}”")
        if all(score <= 0 for _, score in last.retrieved):
            st.caption("Every document retrieved scored 0 or below: no word of the question singles one out (BM25 "
                       "weighs a word found in most of the corpus's documents below zero), so the ranking says "
                       "little; equal scores go in id order.")
        table = results_table([last])
        failed = table[table.error.notna()]
        for _, row in failed.iterrows():
            st.error(f"{row.strategy} failed: {row.error}")
        data, config = compact_table(table.drop(columns=["key", "docs", "question"]).rename(columns=SHOWN_AS),
                                     pinned="strategy", quiet=("error",))
        st.dataframe(data, hide_index=True, width="stretch",  # the strategy stays in view as the table scrolls
                     column_config=config, placeholder="—")
        st.caption("Fixed ordering puts the documents in id order: its K/V deviation is measured against a full "
                   "prefill of that id-ordered prompt (it is exact), its fidelity against the rank-order reference. "
                   "Prompt Cache's keys sit at reserved positions, so its K deviation includes the position change. "
                   "Tokens computed at request time are split: the documents' (full prefill: every one; it also "
                   "computes the system text) and the question's, which every strategy prefills.")
        if "promptcache" in set(table.key) and set(d for d, _ in last.retrieved) <= set(titles):
            st.info(lab.promptcache_note(last))
        st.caption(timing_note(results))
        st.plotly_chart(viz.deviation_figure(deviation_table([last]), f"the last question ({last.question.id})"),
                        width="stretch", key="rag_dev_last")

        st.subheader(f"All questions run in this session ({len(results)})")
        summary = summary_table(results)
        st.dataframe(transposed(summary, "strategy"), width="stretch",  # one column per strategy: it fits
                     height="content", placeholder="—")  # every measure in view: ten rows would cut the last ones
        over = f"mean over {len(results)} questions" if len(results) > 1 else "one question"
        st.plotly_chart(viz.tradeoff_figure(summary[summary.failed < summary.questions], over), width="stretch",
                        key="rag_tradeoff")
        if len(results) > 1:  # with one question it is the figure above
            st.plotly_chart(viz.deviation_figure(deviation_table(results), over), width="stretch",
                            key="rag_dev_all")
        d1, d2 = st.columns(2)
        # a file opened and saved again keeps its stamp and corpus; a live list names the model it ran on
        made = opened or now(state.get("rag_model", lm.facts.name))
        data = state.get("rag_opened_data")
        where = (data.get("corpus") if isinstance(data, dict) else None) if opened else made_on(corpus)
        d1.download_button("Download results (JSON)", to_json(rag_record(results, made, where)),
                           file_name="kvlab_rag.json", mime="application/json", key="rag_dl_json", on_click="ignore")
        d2.download_button("Download table (CSV)", table_csv(results_table(results)),
                           file_name="kvlab_rag.csv", mime="text/csv", key="rag_dl_csv", on_click="ignore")

with tab_drift:
    st.markdown("A key cached at offset 0 and reused at offset Δp is off by a rotation of Δp·θᵢ in every frequency "
                "pair i: fast pairs wrap around within a few positions, slow pairs drift for thousands.")
    max_delta = st.slider("Largest Δp", 64, 8192, 2048, step=64, persist_state="session", key="rag_max_delta")
    deltas = list(range(0, max_delta + 1, max(1, max_delta // 128)))
    e1, e2, e3 = st.columns(3)
    layer = int(e1.number_input("Layer", value=2, step=1, persist_state="session", key="rag_drift_layer"))
    head = int(e2.number_input("Query head", value=0, step=1, persist_state="session", key="rag_drift_head"))
    doc = e3.selectbox("Document", [d.id for d in corpus.documents], persist_state="session", key="rag_drift_doc")
    if (refused := said_refusal(lambda: check_drift(lm, layer, head))) is None:
        st.plotly_chart(viz.rotation_heatmap(drift_angles(lm, layer, deltas), deltas, layer), width="stretch",
                        key="rag_angles")
    if st.button("Measure q·k drift", key="rag_drift_run", disabled=refused is not None):
        try:
            with st.spinner("Prefilling the document and re-scoring its queries at shifted positions…"):
                drift = measure_drift(lm, corpus.doc(doc).text, layer, head, deltas)
                state.rag_drift = (drift, (layer, head, doc, lm.facts.name))
        except KvlabError as exc:
            st.error(str(exc))
    if "rag_drift" in state:
        drift, (d_layer, d_head, d_doc, d_model) = state.rag_drift
        if (d_layer, d_head, d_doc, d_model) == (layer, head, doc, lm.facts.name):
            st.plotly_chart(viz.qk_drift_figure(drift, d_layer, d_head), width="stretch", key="rag_qk")
        else:  # a curve under another layer's heatmap, or another model's, would read as theirs
            st.caption(f"The last q·k measurement was of layer {d_layer}, head {d_head}, document {d_doc} on "
                       f"{d_model}: **Measure q·k drift** for the settings above.")

with tab_stream:
    st.markdown("The question set replayed as a stream of prompts through a token-level prefix cache. Rank order "
                "shares only the system text unless the same documents come back in the same order; id order "
                "turns equal document sets, and sets that share their lowest ids, into prefix hits.")
    capacity = int(st.number_input("Prompts kept in the prefix cache (0 = unbounded)", value=0, step=1,
                                   persist_state="session", key="rag_capacity"))
    bad_capacity = said_refusal(lambda: check_capacity(capacity))
    if not corpus.questions:
        st.info(f"This corpus ({corpus.name}) has no question set to replay: a JSON corpus may carry one in a "
                "'questions' list.")
    elif st.button("Simulate", key="rag_sim_run", disabled=bad_capacity is not None):
        try:
            state.rag_sim = (simulate(lm, corpus, corpus.questions, capacity=capacity or None), capacity)
        except KvlabError as exc:
            st.error(str(exc))
    if "rag_sim" in state and (kept := state.rag_sim[1]) != capacity:  # another capacity's chart reads as this one's
        said = "every prompt" if not kept else f"{kept} prompt{'s' * (kept != 1)}"
        st.caption(f"The last simulation's cache kept {said}: **Simulate** for this capacity.")
    elif "rag_sim" in state:
        sim: pd.DataFrame = state.rag_sim[0]
        st.plotly_chart(viz.prefix_reuse_figure(sim), width="stretch", key="rag_sim_fig")
        data, config = compact_table(sim)
        st.dataframe(data, hide_index=True, width="stretch", placeholder="—", column_config=config)
        st.download_button("Download simulation (CSV)", table_csv(sim), file_name="kvlab_prefix_sim.csv",
                           mime="text/csv", key="rag_sim_dl", on_click="ignore")

download_all_figures("rag")
