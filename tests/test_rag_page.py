"""The RAG page under Streamlit's AppTest: a small run on the embedded model, and bad input."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from page_helpers import open_page
from streamlit.testing.v1 import AppTest
from test_saved_runs import rag_results

from kvlab.engine.facts import LoadedModel
from kvlab.export import to_json
from kvlab.saved import now, stamp, stamp_of
from kvlab.workloads.rag.corpus import load_corpus
from kvlab.workloads.rag.record import made_on, rag_record
from kvlab.workloads.rag.run import RagLab, RagSettings

pytestmark = pytest.mark.model  # the app loads the embedded model


def rag_app() -> AppTest:
    at = open_page("app_pages/rag.py")
    assert not at.exception
    return at


def test_small_run_draws_tables_and_charts() -> None:
    at = rag_app()
    assert len(at.get("plotly_chart")) == 1  # the rotation-angle heatmap needs no run
    at.number_input(key="rag_k").set_value(1)
    at.number_input(key="rag_answer_tokens").set_value(12)  # a question with no answer prefix needs room to answer
    at.multiselect(key="rag_strategies").set_value(["naive", "recompose", "cacheblend"])
    at.button(key="rag_run").click().run()
    assert not at.exception and not at.error
    assert at.session_state["rag_results"][-1].settings.answer_tokens == 12
    table, summary = (d.value for d in at.main.dataframe)  # last question's table, session summary
    assert list(table.strategy) == ["Full prefill", "Naive reuse", "RoPE recomposition", "CacheBlend"]
    assert list(summary.columns) == list(table.strategy)  # transposed to fit: one column per strategy
    assert summary.loc["mean KL", "Full prefill"] == "0" and all(float(v) > 0 for v in summary.loc["mean KL"][1:])
    # heatmap, deviation (last), trade-off; the all-questions deviation would be the same figure again
    assert len(at.get("plotly_chart")) == 3
    assert {"doc tokens recomputed", "question tokens"} <= set(table.columns) and "tokens recomputed" not in table
    assert "prefix-cache tokens" in table and "tokens reused" not in table  # fixed ordering's hits, not all reuse
    assert (table.set_index("strategy").loc["Naive reuse", "doc tokens recomputed"] == 0
            < table.set_index("strategy").loc["Naive reuse", "question tokens"])
    assert not any("Prompt Cache follows" in i.value for i in at.info)
    at.multiselect(key="rag_strategies").set_value(["naive", "promptcache"])
    at.button(key="rag_run").click().run()
    assert len(at.get("plotly_chart")) == 4  # two questions: now the deviation over all of them differs
    titles = [c.proto.spec for c in at.get("plotly_chart")]
    deviation = [t for t in titles if "Deviation of document-token KV" in t]
    assert len(deviation) == 2 and "the last question" in deviation[0] and "mean over 2 questions" in deviation[1]
    assert any("Prompt Cache follows the paper's rule" in i.value for i in at.info)  # its score explained
    at.button(key="rag_sim_run").click().run()
    at.button(key="rag_drift_run").click().run()
    assert not at.exception
    assert len(at.get("plotly_chart")) == 6
    at.number_input(key="rag_capacity").set_value(3).run()  # the chart of an unbounded cache is not this one's
    assert len(at.get("plotly_chart")) == 5
    assert any(c.value.startswith("The last simulation's cache kept every prompt:") for c in at.caption)
    assert not any("stopped before it finished" in w.value for w in at.warning)  # every run ended: none cut short


def test_bad_input_shows_an_error_and_keeps_the_page() -> None:
    at = rag_app()
    at.radio(key="rag_source").set_value("Free text").run()
    at.text_input(key="rag_text").set_value("   ")
    at.button(key="rag_run").click().run()
    assert not at.exception
    assert "empty" in at.error[0].value
    at.text_input(key="rag_text").set_value("Who keeps the lighthouse?")
    # out of range is refused in words with the value typed, never run with an older one
    for key, value, said in (("rag_k", 99, "k must be between 1 and 14 (the number of documents), not 99"),
                             ("rag_k", 0, "k must be between 1 and 14 (the number of documents), not 0"),
                             ("rag_runs", 50, "timed runs must be between 1 and 9, not 50"),
                             ("rag_answer_tokens", 0, "answer tokens must be between 1 and 64, not 0"),
                             ("rag_select_layer", -1, "the selection layer must be in 0…29, not -1")):
        at.number_input(key=key).set_value(value)
        at.button(key="rag_run").click().run()
        assert not at.exception and said in at.error[0].value, [e.value for e in at.error]
        assert not at.session_state["rag_results"]
        at.number_input(key=key).set_value(
            {"rag_k": 3, "rag_runs": 3, "rag_select_layer": 1, "rag_answer_tokens": 8}[key])
    at.number_input(key="rag_drift_layer").set_value(5).run()  # the heatmap shows the chosen layer's frequencies
    titles = [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]
    assert any(t.endswith("Δp, layer 5") for t in titles), titles
    at.number_input(key="rag_drift_layer").set_value(99)
    at.button(key="rag_drift_run").click().run()
    assert not at.exception and any("drift layer 99 is out of range" in e.value for e in at.error)
    assert not any("vs position shift" in c.proto.spec for c in at.get("plotly_chart"))  # no layer 99 to draw
    at.number_input(key="rag_capacity").set_value(-1).run()  # refused as typed, before any click
    assert not at.exception and any("0 (unbounded) or more prompts, not -1" in e.value for e in at.error)
    assert at.button(key="rag_sim_run").disabled


def test_a_saved_run_opens_at_once_from_its_file() -> None:
    at = rag_app()
    charts = len(at.get("plotly_chart"))
    results = rag_results()
    made = stamp_of(stamp("SmolLM2-135M-Instruct"))
    data = to_json(rag_record(results, made)).encode()
    at.file_uploader(key="rag_open").set_value(("kvlab_rag.json", data, "application/json")).run()
    assert not at.exception
    assert [e.value for e in at.error] == ["Prompt Cache failed: RuntimeError: out of positions"]  # the file's
    assert any("Opened from a file, no model run" in i.value and made.label() in i.value for i in at.info)
    table = at.main.dataframe[0].value
    assert list(table.strategy) == ["Full prefill", "Naive reuse", "Prompt Cache"]
    assert len(at.get("plotly_chart")) == charts + 2  # the last question's deviation and the trade-off
    assert not any("scored 0 or below" in c.value for c in at.caption)  # 7.5 and 2.25 single their documents out
    unmatched = [replace(results[0], retrieved=[("d03", 0.0), ("d01", 0.0)])]  # a question no word of which matched
    at.file_uploader(key="rag_open").set_value(
        ("none.json", to_json(rag_record(unmatched, made)).encode(), "application/json")).run()
    assert any("Every document retrieved scored 0 or below" in c.value for c in at.caption)
    at.file_uploader(key="rag_open").set_value(("cut.json", data[:60], "application/json")).run()
    assert any("not valid JSON (line" in e.value for e in at.error) and not at.exception
    assert len(at.main.dataframe) == 2  # the opened run stays


def test_a_saved_run_replays_on_its_page_and_says_whether_it_matches(model: LoadedModel) -> None:
    corpus = load_corpus()
    lab = RagLab(model, corpus)
    settings = RagSettings(k=1, strategies=("naive", "fixed"), answer_tokens=2)
    results = [lab.run(q, settings) for q in corpus.questions[:2]]
    data = json.loads(to_json(rag_record(results, now(model.facts.name), made_on(corpus))))
    at = rag_app()
    for tampered in (False, True):
        if tampered:
            data["questions"][0]["results"][1]["kl"] += 0.25
        at.file_uploader(key="rag_open").set_value((f"r{tampered}.json", json.dumps(data).encode(),
                                                    "application/json")).run()
        at.button(key="rag_replay_button").click().run()
        assert not at.exception and not at.error
        if tampered:
            assert any("differs from the file" in w.value and "question 1 (q01) · naive.kl:" in w.value
                       for w in at.warning)
        else:
            assert any("Replay identical" in s.value for s in at.success) and not at.warning
        assert not any("Opened from a file" in i.value for i in at.info)  # the list is the replay's now
    data.pop("corpus")
    at.file_uploader(key="rag_open").set_value(("old.json", json.dumps(data).encode(), "application/json")).run()
    assert any("No replay: this file was saved before" in c.value for c in at.caption)
    assert "rag_replay_button" not in [b.key for b in at.button]


def test_a_run_cut_short_by_another_click_says_so_on_the_next_run() -> None:
    at = rag_app()
    at.session_state["rag_running"] = "Where is the ferry?"  # what a click during a run leaves behind
    at.run()
    assert not at.exception
    assert [w.value for w in at.warning] == ["The run of “Where is the ferry?” stopped before it finished: another "
                                             "click or a page change ran the page again while it ran, so it is not "
                                             "in the results. Run it again."]
    at.button(key="rag_clear").click().run()
    assert not at.warning  # said once


def test_results_and_drift_of_other_settings_or_another_model_are_not_shown_as_the_current_ones() -> None:
    """A walk switched the sidebar's model after a run: the list stayed, unlabelled, and saved under the new model;
    the q·k curve of layer 2 stayed under layer 5's heatmap."""
    at = rag_app()
    at.number_input(key="rag_k").set_value(1)
    at.number_input(key="rag_runs").set_value(1)
    at.number_input(key="rag_answer_tokens").set_value(2)
    at.multiselect(key="rag_strategies").set_value(["naive"])
    at.button(key="rag_run").click().run()
    model = at.session_state["rag_model"]
    at.session_state["rag_model"] = "embedded:gemma-3-270m"  # as if these results ran before a switch to this model
    at.run()
    assert any(i.value.startswith("**These results ran on embedded:gemma-3-270m**; the sidebar") for i in at.info)
    at.button(key="rag_run").click().run()  # a list of its own on the sidebar's model
    assert len(at.session_state["rag_results"]) == 1 and at.session_state["rag_model"] == model
    assert not any("These results ran on" in i.value for i in at.info)

    def titles() -> list[str]:
        return [json.loads(c.proto.spec)["layout"].get("title", {}).get("text", "") for c in at.get("plotly_chart")]

    at.button(key="rag_drift_run").click().run()
    assert any("q·k error under naive reuse, layer 2 head 0" in t for t in titles())
    at.number_input(key="rag_drift_layer").set_value(5).run()
    assert not any("q·k error under naive reuse" in t for t in titles())
    assert any(c.value.startswith("The last q·k measurement was of layer 2, head 0") for c in at.caption)
