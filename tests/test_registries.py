"""The registries (one shape: policies, RAG strategies, sharing scheme families, lessons), and the code-edit
page's one EditSession."""

from __future__ import annotations

import re

import pytest
import torch
from page_helpers import APP, open_page
from streamlit.testing.v1 import AppTest

from kvlab.cli import main
from kvlab.engine.facts import LoadedModel
from kvlab.errors import KvlabError
from kvlab.lessons import LESSONS
from kvlab.lessons.code import EDITS, EXACT_LOGITS, run_prefix
from kvlab.lessons.planted import label
from kvlab.paths import DATA_DIR
from kvlab.policies import POLICIES, make_policy, param_specs
from kvlab.policies.base import LayerView, Policy
from kvlab.policies.kivi import KiviPolicy
from kvlab.registry import Registry
from kvlab.sharing.forward import shared_forward
from kvlab.sharing.schemes import OFFERED_SCHEMES, SCHEME_FAMILIES, make_scheme, parse_schemes, scheme_label
from kvlab.workloads.chat.budgets import BUDGET_UNITS
from kvlab.workloads.chat.metrics import METRICS
from kvlab.workloads.chat.ruler import FAMILIES as RULER_FAMILIES
from kvlab.workloads.chat.ruler import TASKS as RULER_TASKS
from kvlab.workloads.chat.scbench import TASKS as SCBENCH_TASKS
from kvlab.workloads.code.edits import Edit, apply_edit, load_script, start_state, step
from kvlab.workloads.code.session import EditSession, edits_frame
from kvlab.workloads.rag.corpus import DEFAULT_CORPUS, load_corpus
from kvlab.workloads.rag.run import RagLab, RagSettings, results_table
from kvlab.workloads.rag.strategies import STRATEGIES

CORPUS = load_corpus(DEFAULT_CORPUS)
CODE = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(12))
# the columns of an edit's report that do not depend on the clock
EXACT = ["index", "label", "op", "line", "old_tokens", "new_tokens", "lcp", "reused", "suffix", "reuse_pct"]


# --- one registry shape ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("registry", [POLICIES, STRATEGIES, SCHEME_FAMILIES, LESSONS, METRICS, BUDGET_UNITS,
                                      SCBENCH_TASKS, RULER_FAMILIES, RULER_TASKS], ids=lambda r: r.kind)
def test_every_registry_has_one_shape(registry: Registry) -> None:
    assert isinstance(registry, Registry) and len(registry) >= 3
    for name, entry in registry.items():
        assert entry.name == name and entry.label and entry.summary
        assert registry[name] is entry and registry.label(name) == entry.label
    with pytest.raises(KvlabError, match=re.escape(f"unknown {registry.kind} 'nope'; choose from "
                                                   f"{', '.join(registry)}")):
        registry["nope"]
    assert "nope" not in registry and registry.get("nope") is None


def test_labels_live_on_the_policy_classes() -> None:
    built_in = dict(list(POLICIES.labels().items())[:10])
    assert built_in == {"full": "Full", "streamingllm": "StreamingLLM", "window": "Window", "h2o": "H2O",
                        "snapkv": "SnapKV", "pyramidkv": "PyramidKV", "tova": "TOVA", "knorm": "Knorm",
                        "quest": "Quest", "kivi": "KIVI"}
    assert label("quest") == "Quest" and label("kivi") == "KIVI" and label("someone-else") == "someone-else"
    assert POLICIES[" SnapKV "] is POLICIES["snapkv"]  # what a user types is normalised


def test_a_registry_refuses_a_taken_name_and_an_entry_without_a_label() -> None:
    class Entry:
        def __init__(self, name: str, label: str) -> None:
            self.name, self.label, self.summary = name, label, "does a thing"

    registry = Registry("widget", [Entry("a", "A")])
    with pytest.raises(KvlabError, match="the widget name 'a' is taken"):
        registry.add(Entry("a", "A again"))
    with pytest.raises(KvlabError, match="a widget needs a non-empty label"):
        registry.add(Entry("b", ""))
    assert list(registry) == ["a"]
    with pytest.raises(TypeError):
        registry["b"] = Entry("b", "B")  # only add() registers: it checks the entry
    registry.remove("a")
    assert list(registry) == []


def test_every_lookup_normalises_the_name_as_key_does() -> None:
    assert "  SnapKV " in POLICIES and POLICIES.get(" SnapKV") is POLICIES["snapkv"]
    assert POLICIES.get("nosuch") is None and "nosuch" not in POLICIES


def test_kivi_composes_with_every_registered_eviction_policy(register_policy) -> None:
    evict_with = next(s for s in param_specs("kivi") if s.name == "evict_with")
    # not quest (sparse reads), kivi itself, nor kvzip (its reconstruction pass and one budget over the model)
    assert evict_with.choices == tuple(n for n in POLICIES if n not in ("quest", "kivi", "kvzip"))

    class Newest(Policy):
        name, summary = "newest", "the newest tokens"

        def scores(self, view: LayerView) -> torch.Tensor:
            return view.positions.float()

    register_policy(Newest)
    assert "newest" in KiviPolicy.choices("evict_with")  # derived from the registry, not a list kept by hand
    assert isinstance(make_policy("kivi", evict_with="newest").wrapped(), Newest)
    with pytest.raises(KvlabError, match="kivi: evict_with must be one of"):
        make_policy("kivi", evict_with="quest")


# --- RAG strategies -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_has_a_label_and_runs(tiny: LoadedModel, name: str) -> None:
    strategy = STRATEGIES[name]
    assert strategy.name == name and strategy.label and strategy.summary
    result = RagLab(tiny, CORPUS).run(CORPUS.questions[0], RagSettings(k=2, strategies=(name,), answer_tokens=2))
    assert [r.strategy for r in result.results] == ["full", name]
    row = result.results[1]
    assert row.error is None, row.error
    assert row.ttft_s > 0 and row.kl >= -1e-9 and 0.0 <= row.top1 <= 1.0
    assert len(row.k_dev) == tiny.facts.n_layers
    assert list(results_table([result]).strategy) == ["Full prefill", strategy.label]


def test_unknown_strategy_is_refused_in_words(capsys: pytest.CaptureFixture,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(KvlabError, match=r"unknown strategy 'magic'; choose from naive, recompose, "
                                         r"cacheblend, fixed, promptcache"):
        RagSettings(strategies=("naive", "magic")).check(len(CORPUS.documents), 4)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["rag", "--strategies", "naive,magic", "--model", "/nonexistent/kvlab-model"]) == 2
    # refused before the model is looked for: the message is the strategy's, not the missing folder's
    assert "unknown strategy 'magic'" in capsys.readouterr().err


# --- sharing schemes ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["full", *OFFERED_SCHEMES])
def test_every_scheme_has_a_label_and_runs(tiny: LoadedModel, name: str) -> None:
    scheme = make_scheme(name, tiny.facts.n_layers)
    assert scheme.name == name and scheme.label == scheme_label(name) and scheme.label
    ids = tiny.encode(CODE)[:24]
    logits, kv = shared_forward(tiny, ids, scheme, last_n=3)
    assert logits.shape == (3, tiny.facts.vocab_size) and torch.isfinite(logits).all()
    assert sorted(kv) == sorted(set(scheme.producers))  # only producers store K/V


def test_every_family_is_offered_or_the_baseline_and_claK_stays_parametrised() -> None:
    assert {re.sub(r"\d+$", "", n) for n in ["full", *OFFERED_SCHEMES]} == set(SCHEME_FAMILIES)
    assert all(f.summary and f.names_hint for f in SCHEME_FAMILIES.values())
    cla7 = make_scheme("cla7", 30)
    assert (cla7.label, cla7.kv_layers, cla7.producers[6:8]) == ("CLA-7", 5, (0, 7))
    assert [scheme_label(n) for n in ("full", "cla2", "CLA-3", "yoco")] == ["Full", "CLA-2", "CLA-3", "YOCO"]


@pytest.mark.parametrize("bad", ["mla", "cla0", "cla", "full2", "yoco3", ""])
def test_unknown_scheme_is_refused_in_words(bad: str) -> None:
    with pytest.raises(KvlabError, match=re.escape(f"unknown sharing scheme {bad!r}; use full, cla1, cla2, … or yoco")):
        make_scheme(bad, 30)
    with pytest.raises(KvlabError, match="CLA-31 needs at least 31 layers"):
        parse_schemes("cla2,cla31", 30)


# --- EditSession --------------------------------------------------------------------------------------------

def test_edit_session_gives_the_old_loops_reports(tiny: LoadedModel) -> None:
    script = load_script(DATA_DIR / "edits" / "generic.json")
    state, old = start_state(tiny, CODE), []  # the loop the page, the CLI and the lessons used to repeat
    for i, edit in enumerate(script.edits, 1):
        state, result = step(tiny, state, edit, i)
        old.append(result)
    session = EditSession.start(tiny, CODE, "pasted")
    reports = [session.apply(edit) for edit in script.edits]
    assert reports == session.results and len(reports) == len(script.edits)
    ours, theirs = session.table(), edits_frame(old)
    assert ours[EXACT].equals(theirs[EXACT])
    assert (ours["max_logit_diff"] - theirs["max_logit_diff"]).abs().max() < 1e-4
    assert session.state.ids == state.ids and session.texts[-1] == state.text == session.state.text
    assert len(session.texts) == len(script.edits) + 1 and session.spans()[-1][0] == reports[-1].reused


def test_edit_session_manual_edit_bad_edit_and_measurement(tiny: LoadedModel) -> None:
    session = EditSession.start(tiny, CODE, "pasted")
    assert session.is_for(tiny, "pasted", CODE) and not session.is_for(tiny, "pasted", CODE + "\n")
    edited = apply_edit(CODE, Edit("insert", line=30, text="# note\n"))[0]
    report = session.apply_text(edited)
    assert (report.index, report.label, report.op, report.line) == (1, "manual edit", "edit", 30)
    session.measure([make_scheme("cla2", tiny.facts.n_layers)], positions=4)
    assert list(session.sharing[0]["scheme"]) == ["Full", "CLA-2"]

    def stop_midway(fraction: float, _: str) -> None:
        if fraction > 0:
            raise KeyboardInterrupt  # as the page's Stop ends a run: not an Exception

    with pytest.raises(KeyboardInterrupt):
        session.measure([make_scheme("cla3", tiny.facts.n_layers)], positions=4, progress=stop_midway)
    assert session.sharing is None  # a stopped measurement leaves none, not the last one's CLA-2 table
    session.measure([make_scheme("cla2", tiny.facts.n_layers)], positions=4)
    state = session.state
    with pytest.raises(KvlabError, match="outside"):
        session.apply(Edit("delete", line=999, label="too far"))
    assert session.state is state and len(session.results) == 1 and session.sharing is not None  # nothing changed
    session.apply(Edit("insert", line=1, text="# top\n"))
    assert session.sharing is None and [r.index for r in session.results] == [1, 2]  # a new edit drops it


# --- pages list exactly the registries' entries ---------------------------------------------------------------

@pytest.mark.model
def test_rag_page_offers_exactly_the_strategies() -> None:
    at = open_page("app_pages/rag.py")
    assert not at.exception
    chooser = at.multiselect(key="rag_strategies")
    assert chooser.options == [s.label for s in STRATEGIES.values()] and chooser.value == list(STRATEGIES)


@pytest.mark.model
def test_code_page_offers_exactly_the_schemes_and_holds_one_session() -> None:
    at = AppTest.from_file(APP, default_timeout=300)
    at.switch_page("app_pages/code_edits.py")
    at.session_state["ce_source_kind"] = "Paste"
    at.run()
    assert not at.exception
    chooser = at.multiselect(key="ce_schemes")
    assert chooser.options == [scheme_label(n) for n in OFFERED_SCHEMES] and chooser.value == list(OFFERED_SCHEMES)
    assert isinstance(at.session_state["ce_session"], EditSession)
    loose = {"ce_key", "ce_state", "ce_texts", "ce_results", "ce_sharing", "ce_version"}  # what it held before
    assert not loose & set(at.session_state.keys())


def test_code_lessons_replay_their_edits_with_an_edit_session(tiny: LoadedModel) -> None:
    result = run_prefix(tiny, lambda fraction, message: None)
    assert [e["label"] for e in result["edits"]] == [e.label for e in EDITS]
    assert [e["index"] for e in result["edits"]] == [1, 2, 3]
    reused = [e["reused"] for e in result["edits"]]
    assert reused == sorted(reused) and max(e["max_logit_diff"] for e in result["edits"]) < EXACT_LOGITS
