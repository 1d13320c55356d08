"""Wide tables transposed to fit: one column per strategy, each measure in its own format; arena summaries' n and
intervals."""

from __future__ import annotations

import re

import pandas as pd

from kvlab.experiments.html import table_html
from kvlab.experiments.tables import accuracy_grid, fidelity_vs_budget, per_turn
from kvlab.stats import bootstrap_mean, wilson
from kvlab.viz.arena import (
    NOTHING_SCORED,
    fidelity_vs_budget_figure,
    memory_equal_figure,
    memory_vs_fidelity_figure,
    per_turn_figure,
)
from ui.tables import transposed


def test_a_wide_summary_becomes_one_column_per_strategy() -> None:
    df = pd.DataFrame([
        {"strategy": "Full prefill", "questions": 3, "accuracy": 1.0, "mean KL": 0.0, "TTFT ms": 812.4,
         "speed-up": 1.0},
        {"strategy": "CacheBlend", "questions": 3, "accuracy": float("nan"), "mean KL": 0.01234, "TTFT ms": 301.6,
         "speed-up": 2.6938},
    ])
    out = transposed(df, "strategy")
    assert list(out.columns) == ["Full prefill", "CacheBlend"]
    assert list(out.index) == ["questions", "accuracy", "mean KL", "TTFT ms", "speed-up"]
    assert out.loc["TTFT ms", "Full prefill"] == "812" and out.loc["TTFT ms", "CacheBlend"] == "302"
    assert out.loc["mean KL", "CacheBlend"] == "0.0123" and out.loc["speed-up", "CacheBlend"] == "2.69"
    assert out.loc["accuracy", "CacheBlend"] == "" and out.loc["questions", "CacheBlend"] == "3"  # no score: blank


def test_arena_summaries_carry_n_and_95_percent_intervals() -> None:
    # one policy at one budget: 3 of 4 questions right over two turns, KLs 0.1, 0.2, 0.3, 0.4
    rows = pd.DataFrame({"policy": "snapkv", "budget": 64, "workload": ["a", "a", "b", "b"], "turn": [1, 2, 1, 2],
                         "scored": True, "correct": [True, True, False, True], "kl": [0.1, 0.2, 0.3, 0.4],
                         "top1": 1.0, "error": None})
    summary = fidelity_vs_budget(rows).iloc[0]
    hand = wilson(3, 4)
    assert summary["scored"] == 4 and (summary["accuracy_low"], summary["accuracy_high"]) == (hand.low, hand.high)
    kl = bootstrap_mean([0.1, 0.2, 0.3, 0.4])
    assert (summary["kl_low"], summary["kl_high"]) == (kl.low, kl.high) and kl.low < summary["kl"] < kl.high
    turn = per_turn(rows).set_index("turn")
    assert turn.loc[2, "accuracy_low"] == wilson(2, 2).low and turn.loc[1, "scored"] == 2
    grid = accuracy_grid(rows).iloc[0]
    assert grid["n"] == 4 and grid["all turns 95 %"] == f"[{hand.low:.2f}, {hand.high:.2f}]"
    assert grid["kl 95 %"] == f"[{kl.low:.3f}, {kl.high:.3f}]"


def test_the_arena_charts_draw_the_intervals_as_error_bars() -> None:
    rows = pd.DataFrame({"policy": "snapkv", "budget": [64, 64, 128, 128], "workload": "a", "turn": [1, 2, 1, 2],
                         "scored": True, "correct": [True, False, True, True], "kl": [0.1, 0.3, 0.05, 0.07],
                         "top1": 1.0, "error": None})
    pt, summary = per_turn(rows), fidelity_vs_budget(rows)
    fig = per_turn_figure(pt, "accuracy")
    first = pt[(pt["budget"] == 64)].sort_values("turn")
    bars = fig.data[0].error_y
    assert list(bars.array) == list(first["accuracy_high"] - first["accuracy"])
    assert list(bars.arrayminus) == list(first["accuracy"] - first["accuracy_low"])
    budget_fig = fidelity_vs_budget_figure(summary)
    kl = next(t for t in budget_fig.data if t.xaxis == "x")  # the KL panel
    assert list(kl.error_y.arrayminus) == list(summary["kl"] - summary["kl_low"])
    assert per_turn_figure(pt, "top1").data[0].error_y.array is None  # no interval for top-1: no bars
    assert "bars: 95 % intervals" in fig.layout.title.text and "one turn" not in fig.layout.title.text
    # one question a point: Wilson's interval still spans (its bars are drawn), a bootstrap of one KL has none
    assert "no bars: a point of one question has no interval" in per_turn_figure(pt, "kl").layout.title.text
    assert fig.data[0].cliponaxis is False  # a point on the axis's edge drawn whole
    single = per_turn_figure(per_turn(rows[rows["turn"] == 1]), "accuracy")  # RULER's questions: turn 1 alone
    assert "every workload here has one turn: nothing after turn 1 to compare" in single.layout.title.text


def test_policies_with_equal_scores_are_drawn_side_by_side_not_on_top_of_each_other() -> None:
    # every policy finds nothing: drawn at one x, only the last line would show
    rows = pd.DataFrame([{"policy": p, "budget": b, "workload": "a", "turn": t, "scored": True, "correct": False,
                          "kl": 0.5, "top1": 0.5, "error": None}
                         for p in ("streamingllm", "h2o", "snapkv") for b in (64, 128) for t in (1, 2)])
    turns = per_turn_figure(per_turn(rows), "accuracy")
    assert turns.layout.scattermode == "group"
    assert len({t.offsetgroup for t in turns.data if t.xaxis == "x"}) == 3
    budgets = fidelity_vs_budget_figure(fidelity_vs_budget(rows))
    kl = [t for t in budgets.data if t.xaxis == "x"]  # the log₂ budget axis: each policy shifted by a factor
    assert len({tuple(t.x) for t in kl}) == 3 and all(list(t.customdata) == [64, 128] for t in kl)
    assert all(0.9 < x / b < 1.1 for t in kl for x, b in zip(t.x, t.customdata))
    many = fidelity_vs_budget(pd.concat([rows.assign(policy=f"p{i}", budget=rows["budget"].map({64: 64, 128: 96}))
                                         for i in range(16)]))
    at = [(b, x) for t in fidelity_vs_budget_figure(many).data if t.xaxis == "x" for b, x in zip(t.customdata, t.x)]
    assert max(x for b, x in at if b == 64) < min(x for b, x in at if b == 96)  # 64's points stay left of 96's
    percent = fidelity_vs_budget_figure(fidelity_vs_budget(rows.assign(budget=rows["budget"].map({64: 20, 128: 50}))),
                                        "% of Full's K/V bytes")
    axis = percent.layout.xaxis  # the ticks are the budgets run, not powers of two that were not
    assert (list(axis.tickvals), list(axis.ticktext)) == ([20, 50], ["20", "50"])
    assert axis.title.text == "budget (% of Full's K/V bytes)"


def test_the_memory_chart_labels_the_budgets_on_its_most_spread_out_policy() -> None:
    memory = pd.DataFrame([{"policy": p, "budget": b, "paged_kib": kib, "kl": 1.0, "kv_kib": 1.0, "compression": 0.1,
                            "accuracy": 0.0, "failed": 0}
                           for p, b, kib in (("full", 64, 9e4), ("full", 128, 9e4), ("streamingllm", 64, 4e3),
                                             ("streamingllm", 128, 7e3), ("h2o", 64, 2e4), ("h2o", 128, 4e4))])
    figure = memory_vs_fidelity_figure(memory)
    assert {t.name: t.mode for t in figure.data} == {"streamingllm": "markers+lines", "h2o": "markers+lines+text"}
    assert "budgets labelled on h2o's points" in figure.layout.title.text  # the title says whose points carry them


def test_an_accuracy_panel_with_nothing_to_score_says_so_rather_than_stand_blank() -> None:
    rows = pd.DataFrame({"policy": ["full", "snapkv"] * 2, "budget": 64, "workload": "a", "turn": [1, 1, 2, 2],
                         "scored": False, "correct": None, "kl": [0.0, 0.2, 0.0, 0.4], "top1": 1.0, "error": None})
    pt, summary = per_turn(rows), fidelity_vs_budget(rows)

    def notes(fig) -> list[str]:
        return [a.xref for a in fig.layout.annotations if a.text == NOTHING_SCORED]

    assert notes(per_turn_figure(pt, "accuracy")) == ["x domain"] and notes(per_turn_figure(pt, "kl")) == []
    assert notes(fidelity_vs_budget_figure(summary)) == ["x3 domain"]  # the accuracy panel only
    equal = pd.DataFrame({"policy": ["full", "snapkv"], "budget": 64, "held_share": [1, .3],
                          "read_share_of_full": [1, .3], "accuracy": float("nan"), "kl": [0, 0.3], "failed": 0})
    assert notes(memory_equal_figure(equal)) == ["x domain", "x2 domain"]  # both accuracy panels
    scored = rows.assign(scored=True, correct=[True, False, True, True])
    assert notes(per_turn_figure(per_turn(scored), "accuracy")) == []


def test_one_budgets_points_stand_near_its_tick_not_at_the_panels_edges() -> None:
    rows = pd.DataFrame({"policy": ["full", "oracle", "snapkv"], "budget": 32, "workload": "a", "turn": 1,
                         "scored": False, "correct": None, "kl": [0.0, 0.1, 4.0], "top1": 1.0, "error": None})
    fig = fidelity_vs_budget_figure(fidelity_vs_budget(rows))
    low, high = fig.layout.xaxis.range  # log10 of the budget
    xs = [x for t in fig.data for x in t.x]
    assert 10 ** low < min(xs) < 32 < max(xs) < 10 ** high and high - low > 0.29  # an octave shown


def test_a_kl_of_0_leaves_a_gap_on_the_log_axis_not_a_line_down_off_it() -> None:
    rows = pd.DataFrame({"policy": "snapkv", "budget": 64, "workload": "a", "turn": [1, 2, 3], "scored": False,
                         "correct": None, "kl": [0.0, 0.8, 0.5], "top1": 1.0, "error": None})  # nothing evicted at 1
    fig = per_turn_figure(per_turn(rows), "kl")
    assert pd.isna(fig.data[0].y[0]) and list(fig.data[0].y[1:]) == [0.8, 0.5]
    assert "0 (Full, or nothing evicted yet) is off the log axis" in fig.layout.title.text
    assert not pd.isna(per_turn_figure(per_turn(rows.assign(top1=0.0)), "top1").data[0].y[0])  # a linear axis keeps 0s


def test_a_log_axis_of_a_few_decades_labels_1_2_3_and_5_of_each() -> None:
    rows = pd.DataFrame({"policy": "snapkv", "budget": 64, "workload": "a", "turn": [1, 2], "scored": False,
                         "correct": None, "kl": [0.2, 9.0], "top1": 1.0, "error": None})
    axis = per_turn_figure(per_turn(rows), "kl").layout.yaxis
    assert list(axis.ticktext) == ["0.2", "0.3", "0.5", "1", "2", "3", "5", "10"]
    wide = rows.assign(kl=[1e-5, 9.0])  # six decades: one label each
    assert list(per_turn_figure(per_turn(wide), "kl").layout.yaxis.ticktext) == ["1e-05", "0.0001", "0.001", "0.01",
                                                                                 "0.1", "1", "10"]


def test_a_report_table_writes_every_empty_cell_as_a_dash_and_whole_numbers_whole() -> None:
    """A walk read "<NA>", "None" and "254.000" in the arena's and the stream's HTML reports."""
    df = pd.DataFrame({"ppl": [1.5, None], "n": pd.array([3, None], dtype="Int64"), "reply": ["yes", None],
                       "max_rope_position": [254.0, 1024.0], "past": [True, False]})
    cells = re.findall(r"<td>([^<]*)</td>", table_html(df, "a caption", {"ppl": "perplexity"}))
    assert cells == ["1.500", "3", "yes", "254", "yes", "—", "—", "—", "1,024", "no"]
    assert "<th>perplexity</th>" in table_html(df, headers={"ppl": "perplexity"})
    # an error column only where something failed, as on the pages (a walk read a column of "—" in the report)
    assert "<th>error</th>" not in table_html(df.assign(error=None))
    assert "<th>error</th>" in table_html(df.assign(error=[None, "RuntimeError: boom"]))
