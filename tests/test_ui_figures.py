"""Details a browser session found wrong: log ticks, axis ranges, chart titles, marks that need no emoji font."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
import pytest

from kvlab.viz.chat import attention_profile, fidelity_lines
from kvlab.viz.edits import timeline_figure
from kvlab.viz.lessons import bytes_per_turn_figure, recall_interval_figure, sink_layers_figure
from kvlab.viz.rag import deviation_figure, qk_drift_figure, tradeoff_figure
from ui.chat_results import answers_shown
from ui.tables import compact_table, mark, marked, short_number


def test_the_attention_profile_labels_one_tick_per_decade_as_powers_of_ten() -> None:
    segments = [{"start": 0, "end": 3, "turn": 0, "role": "user"}]
    fig = attention_profile([[0.9, 0.05, 0.001]], 0, segments)
    axis = fig.layout.yaxis
    # plotly's default log ticks label 2 and 5 inside each decade ("5, 2, 0.1, 5, 2")
    assert (axis.type, axis.dtick, axis.exponentformat) == ("log", 1, "power")


def test_the_edit_timeline_time_axis_spans_the_savings_drawn_with_whole_ms_ticks() -> None:
    edits = pd.DataFrame({"index": [1, 2], "label": ["a", "b"], "line": [3, 9], "reuse_pct": [90.0, 40.0],
                          "reused": [90, 40], "new_tokens": [100, 100], "full_ms": [7000.0, 7400.0],
                          "reprefill_ms": [300.0, 500.0], "full_spread_ms": [50.0, 80.0],
                          "reprefill_spread_ms": [10.0, 20.0], "runs": [3, 3], "saved_ms": [6700.0, 6910.0],
                          "saved_low_ms": [6640.0, 6800.0], "saved_high_ms": [6720.0, 7000.0]})
    fig = timeline_figure(edits)
    axis = fig.layout.yaxis2
    low, high = axis.range
    # the runs saved 6640–6720 and 6800–7000 ms: the axis reaches from just below zero (the line where no time is
    # saved stays in sight) to just above the highest bar end, not plotly's guess
    assert -400 < low < 0 and 7000 < high < 7400
    lost = timeline_figure(edits.assign(saved_ms=[-4900.0, -4800.0], saved_low_ms=[-5100.0, -4850.0],
                                        saved_high_ms=[-4700.0, -4750.0]))
    assert lost.layout.yaxis2.range[0] < -5100 and lost.layout.yaxis2.range[1] > 0  # losses only: zero still shown
    assert axis.tickformat == ",.0f"
    # each bar spans the runs' own savings, from the least to the most, around their median (a walk read a bar of
    # ± both sides' spreads reaching far below zero for an edit every run of which saved time)
    bar = fig.data[1]
    assert list(bar.y) == [6700.0, 6910.0] and list(bar.error_y.arrayminus) == [60.0, 110.0]
    assert list(bar.error_y.array) == [20.0, 90.0] and bar.error_y.symmetric is False
    older = timeline_figure(edits.drop(columns=["saved_ms", "saved_low_ms", "saved_high_ms"]))
    assert list(older.data[1].y) == [6700.0, 6900.0] and list(older.data[1].error_y.array) == [0.0, 0.0]
    assert fig.data[1].name == "time saved (ms, median of the runs)"
    # the zero line is named in the legend, not by a label that sat on the last bar
    assert not fig.layout.annotations and fig.data[2].name == "no time saved (0 ms)" and fig.data[2].yaxis == "y2"
    once = timeline_figure(edits.assign(runs=1, full_spread_ms=0.0, reprefill_spread_ms=0.0))
    assert once.data[1].name == "time saved (ms, one run each)"  # not a median where each was timed once


def test_rag_charts_say_which_questions_they_draw() -> None:
    dev = pd.DataFrame({"strategy": ["Naive reuse"] * 2, "layer": [0, 1], "K": [0.1, 0.2], "V": [0.1, 0.3]})
    last, mean = deviation_figure(dev, "the last question (q03)"), deviation_figure(dev, "mean over 2 questions")
    assert last.layout.title.text.endswith("the last question (q03)")
    assert mean.layout.title.text.endswith("mean over 2 questions")
    summary = pd.DataFrame({"strategy": ["Naive reuse"], "speed-up": [2.0], "speed-up low": [1.5],
                            "speed-up high": [2.5], "mean KL": [0.3], "top-1": [0.8]})
    title = tradeoff_figure(summary, "mean over 2 questions").layout.title.text
    assert "mean over 2 questions" in title and "range over the timed runs" in title
    once = summary.assign(**{"speed-up low": 2.0, "speed-up high": 2.0})  # timed once: no range to speak of
    assert "timed once" in tradeoff_figure(once, "one question").layout.title.text


def test_strategies_on_one_point_of_the_tradeoff_chart_are_both_seen() -> None:
    summary = pd.DataFrame({"strategy": ["Full prefill", "Fixed ordering", "Naive reuse"], "speed-up": [1.0, 1.0, 3.0],
                            "speed-up low": [0.9, 0.9, 2.5], "speed-up high": [1.1, 1.1, 3.5],
                            "mean KL": [0.0, 0.0, 0.4], "top-1": [1.0, 1.0, 0.7]})
    markers = [t.marker for t in tradeoff_figure(summary, "one question").data]
    assert len({m.symbol for m in markers}) == 3 and all(m.symbol.endswith("-open") for m in markers)


def test_strategies_at_full_prefills_zero_deviation_are_named_not_drawn_under_each_other() -> None:
    dev = pd.DataFrame({"strategy": ["Full prefill"] * 2 + ["Fixed ordering"] * 2 + ["Naive reuse"] * 2,
                        "layer": [0, 1] * 3, "K": [0, 0, 0, 1e-8, 0.1, 0.2], "V": [0, 0, 0, 0, 0.1, 0.3]})
    fig = deviation_figure(dev, "the last question")
    assert {t.name for t in fig.data} == {"Naive reuse"}
    assert "0 on every layer, not drawn: Full prefill, Fixed ordering" in fig.layout.title.text
    unmeasured = dev.assign(K=[0.0, float("nan"), 0, 0, 0.1, 0.2])  # a layer with no number is not a zero
    assert "Full prefill" in {t.name for t in deviation_figure(unmeasured, "q").data}
    same_values = pd.DataFrame({"strategy": ["Naive reuse"] * 2 + ["RoPE recomposition"] * 2 + ["Prompt Cache"] * 2,
                                "layer": [0, 1] * 3, "K": [0.5, 0.6, 0.1, 0.2, 0.7, 0.8], "V": [0.1, 0.3] * 3})
    dashes = {(t.name, t.xaxis): t.line.dash for t in deviation_figure(same_values, "q").data}
    assert dashes == {("Naive reuse", "x"): "solid", ("Naive reuse", "x2"): "solid",
                      ("RoPE recomposition", "x"): "solid", ("RoPE recomposition", "x2"): "dash",
                      ("Prompt Cache", "x"): "solid", ("Prompt Cache", "x2"): "dot"}
    widths = {(t.name, t.xaxis): t.line.width for t in deviation_figure(same_values, "q").data}
    assert widths == {("Naive reuse", "x"): 2, ("Naive reuse", "x2"): 8, ("RoPE recomposition", "x"): 2,
                      ("RoPE recomposition", "x2"): 5, ("Prompt Cache", "x"): 2, ("Prompt Cache", "x2"): 2}


def test_the_sink_chart_names_the_uniform_share_in_its_legend_not_over_the_bars() -> None:
    fig = sink_layers_figure({"first_share": [0.5, 0.6], "sink_tokens": 4, "tokens": 200, "queries": 8,
                              "other": [{"share": 0.1, "token": "the", "position": 30}] * 2})
    line = fig.layout.shapes[0]
    assert line.y0 == 0.02 and line.showlegend and line.name == "uniform share of the first 4 (2.0%)"
    assert not fig.layout.annotations


# characters whose default presentation is emoji (Unicode's Emoji_Presentation): without an emoji font, as on
# a plain Debian Chromium, they draw as empty boxes; ✓ ✗ ⚠ ▶ – are ordinary text characters every font here has
EMOJI = re.compile("[\u231a\u231b\u23e9-\u23ec\u23f0\u23f3\u25fd\u25fe\u2614\u2615\u2648-\u2653\u267f\u2693\u26a1"
                   "\u26aa\u26ab\u26bd\u26be\u26c4\u26c5\u26ce\u26d4\u26ea\u26f2\u26f3\u26f5\u26fa\u26fd\u2705\u270a"
                   "\u270b\u2728\u274c\u274e\u2753-\u2755\u2757\u2795-\u2797\u27b0\u27bf\u2b1b\u2b1c\u2b50\u2b55"
                   "\U0001F000-\U0001FAFF]")


def test_no_page_or_figure_draws_an_emoji_mark() -> None:
    root = Path(__file__).resolve().parents[1]
    sources = [root / "app.py", *sorted((root / "kvlab").rglob("*.py")), *sorted((root / "app_pages").rglob("*.py")),
               *sorted((root / "ui").rglob("*.py"))]
    found = [f"{p.relative_to(root)}:{n}: {m.group()}" for p in sources
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) for m in EMOJI.finditer(line)]
    assert found == []
    assert EMOJI.search("seed: ✅ good") and not EMOJI.search("✓ ✗ ⚠ ▶ – ≈")  # the check sees what it must


def test_answer_checks_are_plain_marks_and_an_unscored_cell_n_a() -> None:
    table = pd.DataFrame({"policy": ["full", "window", "h2o"], "correct": [True, False, None]})
    assert list(marked(table, "correct")["correct"]) == ["✓", "✗", "n/a"]
    assert list(table["correct"]) == [True, False, None]  # the CSV's table keeps its values
    assert mark(float("nan")) == "n/a"


def test_the_chats_answer_columns_go_only_where_no_turn_has_an_answer() -> None:
    """A review found an all-wrong chat losing its ✗ column: a column of False read as one that says nothing."""
    wrong = pd.DataFrame({"policy": ["full", "h2o"], "correct": [False, False], "metric": ["contains"] * 2})
    assert list(answers_shown(wrong)["correct"]) == ["✗", "✗"]
    live = pd.DataFrame({"policy": ["full", "h2o"], "correct": [None, None], "metric": [None, None]})
    assert list(answers_shown(live).columns) == ["policy"]


def test_the_chats_fidelity_lines_put_equal_policies_side_by_side() -> None:
    """Three policies at KL 0 and 100 % top-1 on every turn (kivi, kvzip, duoattention at a roomy budget) drew as
    one: each policy's markers now sit beside the others' around the turn, each with its own symbol."""
    table = pd.DataFrame([{"policy": p, "turn": t, "kl": 0.0 if p != "snapkv" else 0.2, "top1": 1.0, "error": None,
                           "past_context": p == "snapkv" and t == 2}
                          for p in ("full", "kivi", "kvzip", "duoattention", "snapkv") for t in (1, 2)])
    fig = fidelity_lines(table)
    lines = [t for t in fig.data if t.name != "past the trained context"]
    assert {t.offsetgroup for t in lines} == {"kivi", "kvzip", "duoattention", "snapkv"}
    assert len({t.marker.symbol for t in lines}) == 4 and fig.layout.scattermode == "group"
    crosses = [t for t in fig.data if t.name == "past the trained context"]
    assert [t.offsetgroup for t in crosses] == ["snapkv", "snapkv"]  # over snapkv's own marker


def test_policies_filling_the_byte_budget_alike_stand_side_by_side() -> None:
    """Lesson 10: SnapKV, KVzip and the oracle all hold the budget's 3 MiB on every turn; only the oracle showed."""
    at_budget = [3 << 20] * 3
    fig = bytes_per_turn_figure({"full": [4 << 20, 6 << 20, 8 << 20], "snapkv": at_budget, "kvzip": at_budget,
                                 "oracle": at_budget}, {"kvzip": "KVzip"}, 3 << 20, "held")
    assert [t.offsetgroup for t in fig.data] == ["full", "snapkv", "kvzip", "oracle"]
    assert len({t.marker.symbol for t in fig.data}) == 4 and fig.layout.scattermode == "group"
    assert [t.name for t in fig.data][2] == "KVzip" and list(fig.data[1].y) == [3.0] * 3


def test_recall_counts_sit_under_the_bars_clear_of_their_intervals() -> None:
    fig = recall_interval_figure({"snapkv": (0, 6, 0.0, 0.39), "duoattention": (3, 6, 0.19, 0.81)},
                                 {"snapkv": "SnapKV"}, "recalled")
    bar = fig.data[0]
    assert list(bar.x) == ["SnapKV<br>0/6", "duoattention<br>3/6"] and bar.text is None
    assert list(bar.y) == [0.0, 0.5] and list(bar.customdata[1]) == ["duoattention", "3/6"]


def test_tables_print_numbers_short_without_turning_thousands_into_exponents() -> None:
    table = pd.DataFrame({"runner": ["window", "sinks"], "ppl": [5158.23, 4.37], "kl": [0.000123, 1.5],
                          "prefill_ms": [1189.4, 96.2], "tokens": [1536, 64]})
    data, config = compact_table(table, {"ppl": "perplexity"}, pinned="runner")
    formats = {c: (config[c]["type_config"]["format"], config[c]["type_config"].get("step"))
               for c in ("ppl", "kl", "prefill_ms")}
    assert formats == {"ppl": ("localized", 1), "kl": ("%.3g", None), "prefill_ms": ("localized", 1)}  # whole, 1,189
    assert config["ppl"]["label"] == "perplexity" and config["runner"]["pinned"] and "tokens" not in config
    cells = (("ppl", 5158.23), ("kl", 0.000123), ("TTFT ms", 1189.4), ("n", 3), ("prefill_ms", 96.2),
             ("re-prefill (ms, one run)", 1075.4), ("items", 7.25))  # "ms" as a word only
    assert [short_number(c, v) for c, v in cells] == ["5,158", "0.000123", "1,189", "3", "96", "1,075", "7.25"]
    # 3 significant digits would print 999.6 as "1e+03": whole from 999.5 on, in cells and columns alike
    assert [short_number("ppl", v) for v in (999.4, 999.5, 999.6)] == ["999", "1,000", "1,000"]
    _, edge = compact_table(pd.DataFrame({"a": [999.4], "b": [999.6]}), {})
    assert [edge[c]["type_config"]["format"] for c in "ab"] == ["%.3g", "localized"]
    # Streamlit's step-1 format cuts decimals off (1,189.6 showed as 1,189): whole columns are rounded first, as the
    # transposed tables' cells are, and the others keep their values
    assert data["prefill_ms"].tolist() == [1189.0, 96.0] and data["ppl"].tolist() == [5158.0, 4.0]
    assert data["kl"].tolist() == table["kl"].tolist() and table["prefill_ms"].tolist() == [1189.4, 96.2]
    halves = compact_table(pd.DataFrame({"TTFT ms": [133.7, 132.5, 133.5]}))[0]["TTFT ms"]
    assert [f"{v:,.0f}" for v in halves] == [short_number("TTFT ms", v) for v in (133.7, 132.5, 133.5)]


def test_a_quiet_column_shows_only_where_a_row_says_something_in_it() -> None:
    rows = pd.DataFrame({"policy": ["full", "h2o"], "error": [None, None], "past_context": ["", " "],
                         "note": ["—", "—"]})
    data, _ = compact_table(rows, quiet=("error", "past_context", "note", "absent"))
    assert list(data.columns) == ["policy"]  # None, blanks and the placeholder say nothing
    said = rows.assign(error=[None, "RuntimeError: boom"], past_context=["", "⚠ past"])
    assert list(compact_table(said, quiet=("error", "past_context"))[0].columns) == list(said.columns)
    assert list(compact_table(rows)[0].columns) == list(rows.columns)  # only the columns named quiet go


def test_the_drift_chart_names_the_score_spread_in_its_legend_not_on_the_curves() -> None:
    drift = {"delta": [0, 64, 128], "score_abs_error": [0.0, 1.0, 2.0], "attention_tv": [0.0, 0.3, 0.35],
             "score_std": 1.8}
    fig = qk_drift_figure(drift, 2, 0)
    assert not fig.layout.annotations  # a label on the line sat on the TV curve where it crossed
    std = next(t for t in fig.data if t.name == "std of true scores")
    assert list(std.x) == [0, 128] and list(std.y) == [1.8, 1.8] and std.line.dash == "dash"


def test_fit_titles_breaks_long_titles_notes_and_panel_titles_once() -> None:
    from plotly.subplots import make_subplots

    from kvlab.viz.titles import LINE_PX, NOTES_CHARS, PANEL_CHARS, TITLE_CHARS, fit_titles, titled

    fig = make_subplots(rows=1, cols=3, subplot_titles=["KL(Full ‖ policy), nats per token", "top-1", "accuracy"])
    fig.update_layout(**titled("K/V each policy holds after the turn, and what paging would free or copy",
                               ["held as stored: kivi packed, quest with its page metadata"] * 2), height=400)
    fig.update_xaxes(title="budget (tokens per layer per KV head)")
    top, height = fig.layout.margin.t, fig.layout.height
    fit_titles(fig)
    # one axis title for three panels, under the middle one (three side by side ran into each other)
    assert [fig.layout[a].title.text for a in ("xaxis", "xaxis2", "xaxis3")] == [
        None, "budget (tokens per layer per KV head)", None]
    title = fig.layout.title.text
    lines = title.split("<br>")
    assert all(len(re.sub(r"</?sup>", "", line)) <= max(TITLE_CHARS, NOTES_CHARS) for line in lines)
    assert lines[0] == "K/V each policy holds after the turn, and what" and lines[1] == "paging would free or copy"
    assert all(line.startswith("<sup>") and line.endswith("</sup>") for line in lines[2:]) and len(lines) >= 4
    assert (fig.layout.title.yref, fig.layout.title.y, fig.layout.title.yanchor) == ("container", 1, "top")  # stays up
    first = fig.layout.annotations[0].text
    assert first.replace("<br>", " ") == "KL(Full ‖ policy), nats per token"
    assert all(len(line) <= PANEL_CHARS // 3 for line in first.split("<br>"))
    panel_lines = first.count("<br>")
    notes = sum(line.startswith("<sup>") for line in lines)
    assert fig.layout.margin.t == (top + LINE_PX["title"] * (len(lines) - notes - 1) + LINE_PX["notes"] * (notes - 1)
                                   + LINE_PX["panel"] * panel_lines)
    assert fig.layout.height - height == fig.layout.margin.t - top  # the panels keep their height
    again = fig.layout.margin.t
    fit_titles(fig)
    assert fig.layout.title.text == title and fig.layout.margin.t == again  # a figure drawn twice is fitted once
    two = make_subplots(rows=1, cols=2).update_xaxes(title="k (documents retrieved) of the corpus")
    two.frames = [go.Frame(layout={"title": "my_plugin_policy_with_params(budget=64): kept tokens after turn 1"})]
    fit_titles(two)
    titles = [two.layout.xaxis.title.text, two.layout.xaxis2.title.text]
    assert titles == ["k (documents retrieved) of the corpus", None]  # an even row: under the first panel
    assert all(len(line) <= TITLE_CHARS for line in two.frames[0].layout.title.text.split("<br>"))  # as it plays
    short = go.Figure(layout={"title": "Short"})
    assert fit_titles(short).layout.title.text == "Short" and short.layout.margin.t is None


def _marked_page(how: str) -> None:
    """A page doing work inside ``marked_while_running``: it ends, fails, or is stopped the way a click stops it."""
    import streamlit as st

    from ui.common import marked_while_running

    if st.session_state.get("seen"):  # the page's next run reads what the last one left
        st.write(f"left: {st.session_state.get('working')!r}")
        return
    st.session_state.seen = True
    with marked_while_running("working", 7):
        st.write(f"during: {st.session_state.working!r}")
        if how == "fails":
            raise RuntimeError("the work failed")
        if how == "stopped":
            st.stop()  # the control exception a click's rerun raises in the script


@pytest.mark.parametrize(("how", "left"), [("ends", "None"), ("fails", "None"), ("stopped", "7")])
def test_work_cut_short_by_a_click_leaves_its_marker_and_work_that_ended_or_failed_does_not(how: str,
                                                                                            left: str) -> None:
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_function(_marked_page, args=(how,)).run()
    assert at.markdown[0].value == "during: 7"
    assert bool(at.exception) == (how == "fails")
    assert at.run().markdown[0].value == f"left: {left}"
