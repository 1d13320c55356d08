"""The seed's table rebuilt from arena rows: hand-made rows at the thresholds' edges, failures, gaps."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from kvlab.experiments.runner import COLUMNS
from kvlab.experiments.seed_table import (
    FAMILIES,
    MARKS,
    UNSURE,
    WORKLOADS,
    family_of,
    seed_cells,
    seed_table,
    verdict,
)
from kvlab.policies import POLICIES
from kvlab.stats import Interval, wilson
from kvlab.viz.arena import CELL_CHARS, seed_headroom_figure, seed_table_figure

FULL_BYTES = 1000
TURNS = 60  # Full answers every one of them: enough questions for a 95 % interval to clear a line


def rows(policy: str, correct: int, *, budget: int = 64, mode: str = "multi-turn", kl: float = 0.5,
         held: float = 0.25, params: dict | None = None, error_from: int | None = None) -> list[dict]:
    """A policy's rows on one workload: the first ``correct`` of TURNS questions answered."""
    out = []
    for turn in range(1, TURNS + 1):
        failed = error_from is not None and turn >= error_from
        kv = None if failed else FULL_BYTES * held
        out.append(dict.fromkeys(COLUMNS) | {
            "workload": "w", "budget": budget, "mode": mode, "turn": turn, "policy": policy,
            "params": json.dumps(params or {}), "scored": not failed, "correct": None if failed else turn <= correct,
            "kl": None if failed else kl, "kv_bytes": kv, "kv_kib": None if failed else kv / 1024,
            "kv_bytes_read": kv, "error": "RuntimeError: boom" if failed else None})
    return out


def full(budget: int = 64, mode: str = "multi-turn") -> list[dict]:
    return rows("full", TURNS, budget=budget, mode=mode, kl=0.0, held=1.0)


def cell(cells: pd.DataFrame, family: str, workload: str = "multi-turn", budget: int = 64) -> pd.Series:
    hit = cells[(cells["family"] == family) & (cells["workload"] == workload) & (cells["budget"] == budget)]
    assert len(hit) == 1
    return hit.iloc[0]


@pytest.mark.parametrize(("share", "mark"), [
    (Interval(0.95, 0.91, 0.99, 60), "✓"), (Interval(0.92, 0.89, 0.96, 60), UNSURE),
    (Interval(0.7, 0.55, 0.85, 60), "⚠"), (Interval(0.55, 0.45, 0.65, 60), UNSURE),
    (Interval(0.2, 0.1, 0.45, 60), "✗"), (Interval(0.5, 0.0, 1.0, 1), UNSURE),
])
def test_a_mark_needs_its_whole_interval_on_one_side_of_each_line(share: Interval, mark: str) -> None:
    assert verdict(share) == mark


def test_thresholds_from_rows() -> None:
    table = pd.DataFrame(full() + rows("streamingllm", 60) + rows("snapkv", 42, kl=0.7) + rows("h2o", 36)
                         + rows("pyramidkv", 12, held=0.3))
    cells = seed_cells(table)
    window = cell(cells, "window / sink")  # 60 of 60: [0.94, 1]
    assert (window["verdict"], window["policy"], window["accuracy_of_full"]) == ("✓", "streamingllm", 1.0)
    assert window["held_share"] == pytest.approx(0.25) and window["agrees"] == "agrees"
    assert (window["share_low"], window["share_high"], window["n"]) == (wilson(60, 60).low, 1.0, 60)
    importance = cell(cells, "importance scoring")  # the best member: snapkv's 42 of 60 ([0.57, 0.80]) beats h2o's 36
    assert (importance["verdict"], importance["policy"], importance["kl"]) == ("⚠", "snapkv", pytest.approx(0.7))
    assert importance["agrees"] == "agrees"
    pyramid = cell(cells, "pyramid")  # 12 of 60: [0.12, 0.32]
    assert pyramid["verdict"] == "✗" and pyramid["agrees"] == "no: worse"
    assert "✗ 20% [12–32%] of Full's answers (n = 60 by Full)" in pyramid["cell"]
    assert "held 30% of Full's bytes" in pyramid["cell"]


def test_an_interval_across_a_line_is_unsure_and_shows_the_interval() -> None:
    table = pd.DataFrame(full() + rows("streamingllm", 54) + rows("h2o", 36))
    cells = seed_cells(table)
    window = cell(cells, "window / sink")  # 54 of 60 is 90 %, but [0.80, 0.95] straddles the 90 % line
    assert window["verdict"] == UNSURE and window["agrees"] == "cannot tell"
    assert window["cell"].startswith("≈ 90% [80–95%] of Full's answers (n = 60 by Full)")
    assert cell(cells, "importance scoring")["verdict"] == UNSURE  # 36 of 60: [0.47, 0.71] straddles 50 %
    few = seed_cells(pd.DataFrame(full()[:5] + rows("streamingllm", 5)[:5]))
    assert cell(few, "window / sink")["verdict"] == UNSURE  # 5 of 5 questions: [0.57, 1] cannot clear 90 %


def test_ties_go_to_the_lower_kl() -> None:
    table = pd.DataFrame(full() + rows("h2o", 6, kl=0.9) + rows("tova", 6, kl=0.4))
    assert cell(seed_cells(table), "importance scoring")["policy"] == "tova"


def test_a_failed_policy_is_failed_not_a_number() -> None:
    table = pd.DataFrame(full() + rows("streamingllm", 9, error_from=4) + rows("h2o", 3, error_from=6)
                         + rows("tova", 12))
    cells = seed_cells(table)
    window = cell(cells, "window / sink")
    assert window["status"] == "failed" and window["verdict"] == "failed"
    assert pd.isna(window["accuracy_of_full"]) and pd.isna(window["kl"]) and pd.isna(window["held_share"])
    assert window["cell"] == "failed: streamingllm: RuntimeError: boom"
    importance = cell(cells, "importance scoring")  # tova is measured; h2o failed and is named, not scored
    assert importance["policy"] == "tova" and importance["accuracy_of_full"] == 0.2
    assert "h2o failed" in importance["cell"]


def test_families_not_run_and_workloads_not_measured_say_so() -> None:
    table = pd.DataFrame(full() + rows("streamingllm", 9))
    cells = seed_cells(table)
    assert len(cells) == len(FAMILIES) * len(WORKLOADS)
    quest = cell(cells, "query-aware sparse reading (Quest)")
    assert quest["status"] == "not run" and pd.isna(quest["accuracy_of_full"]) and quest["cell"] == "not run (quest)"
    single = cell(cells, "window / sink", "single-shot")
    assert single["status"] == "not run" and single["cell"] == "not run (mode not in this run)"
    for workload in ("RAG", "code edits"):
        gap = cell(cells, "window / sink", workload)
        assert gap["status"] == "not measured" and gap["cell"].startswith("not measured in this run")
        assert pd.isna(gap["accuracy_of_full"])
    assert cell(cells, "quantization")["agrees"] == ""


def test_every_built_in_policy_has_a_family_named_in_the_table() -> None:
    for name in POLICIES:  # a new policy missing from the families would drop out of the table without a word
        family = family_of(name, {"evict_with": "full"})
        assert (family is None) == (name == "full"), name
        assert family in {f.name for f in FAMILIES} | {None}
        row = next((f for f in FAMILIES if f.name == family), None)
        assert row is None or name in re.split(r"[ ,]+", row.policies), (name, family)  # the row's words name it


def test_kivi_splits_by_what_it_evicts_with() -> None:
    assert family_of("kivi", {"bits": 4, "evict_with": "full"}) == "quantization"
    assert family_of("kivi", {"bits": 2, "evict_with": "streamingllm"}) == "quantization + eviction"
    assert family_of("kivi", {"bits": 16, "evict_with": "snapkv"}) == "importance scoring"
    assert family_of("full", {}) is None
    table = pd.DataFrame(full() + rows("kivi", TURNS, held=0.27, params={"bits": 4, "evict_with": "full"}))
    quantized = cell(seed_cells(table), "quantization")
    assert quantized["verdict"] == "✓" and quantized["held_share"] == pytest.approx(0.27)
    assert quantized["agrees"] == "the seed gives no verdict"
    assert cell(seed_cells(table), "quantization + eviction")["status"] == "not run"


def test_modes_and_budgets_are_separate_cells_and_full_answering_none_is_not_rated() -> None:
    table = pd.DataFrame(full(64) + rows("streamingllm", 12, budget=64) + full(64, "single-shot")
                         + rows("streamingllm", TURNS, budget=64, mode="single-shot")
                         + rows("full", 0, budget=128, kl=0.0, held=1.0) + rows("streamingllm", 0, budget=128))
    cells = seed_cells(table)
    assert cell(cells, "window / sink")["verdict"] == "✗"
    assert cell(cells, "window / sink", "single-shot")["verdict"] == "✓"
    none = cell(cells, "window / sink", budget=128)
    assert none["verdict"] == "n/a (Full answered none)" and none["agrees"] == "cannot tell"
    wide = seed_table(table)
    assert list(wide.columns) == ["family", "policies", "budget", *WORKLOADS]
    assert wide["family"].tolist() == [f.name for f in FAMILIES for _ in (64, 128)]
    assert wide.loc[0, "multi-turn"].startswith("✗ 20% [12–32%] of Full's answers")
    assert wide.loc[0, "multi-turn"].endswith("| seed: ✓ good: temporal locality follows how older turns fade "
                                              "→ no: worse")


PROOF = Path(__file__).parent / "data" / "arena_proof_rows.csv"


def test_a_real_runs_rows_give_a_complete_table() -> None:
    """Real rows: two of the nine retrieval sessions of the issue-12 proof run (SmolLM2-135M; full, streamingllm,
    snapkv, pyramidkv, tova, quest, kivi at 4 bits; budgets 128, 256, 512; both modes), as `kvlab arena` wrote them."""
    table = pd.read_csv(PROOF)
    cells = seed_cells(table)
    assert len(cells) == len(FAMILIES) * len(WORKLOADS) * 3
    measured = cells[cells["status"] == "measured"]
    run = {family_of(p, json.loads(s)) for p, s in table[["policy", "params"]].drop_duplicates().itertuples(
        index=False)} - {None}
    assert set(measured["family"]) == run and set(measured["workload"]) == {"multi-turn", "single-shot"}
    assert set(cells[cells["family"] == "quantization + eviction"]["status"]) == {"not run", "not measured"}
    # tova's share of Full's answers at 512: the questions both answered over those Full answered, by hand
    rows = table[(table["budget"] == 512) & (table["mode"] == "multi-turn") & table["scored"]]
    keys = ["workload", "turn"]
    both = rows[rows["policy"] == "tova"].merge(rows[rows["policy"] == "full"], on=keys, suffixes=("", "_full"))
    importance = cell(cells, "importance scoring", budget=512)
    kept, n = int((both["correct"] & both["correct_full"]).sum()), int(both["correct_full"].sum())
    assert importance["policy"] == "tova" and importance["accuracy_of_full"] == kept / n and importance["n"] == n
    assert importance["held_share"] == pytest.approx((both["kv_bytes"] / both["kv_bytes_full"]).mean())
    assert 0.3 < importance["held_share"] < 0.5  # 512 tokens of conversations of 1.1k–2.1k
    # every mark stands where its interval lies: a clear mark only when the interval clears the line
    for c in measured[measured["n"] > 0].itertuples():
        assert c.verdict == verdict(Interval(c.accuracy_of_full, c.share_low, c.share_high, int(c.n)))
    assert set(measured["verdict"]) <= {*MARKS, UNSURE}

def test_figure_colours_measured_cells_and_writes_the_rest() -> None:
    table = pd.DataFrame(full() + rows("streamingllm", 54) + rows("h2o", 3, error_from=2))
    fig = seed_table_figure(seed_cells(table))
    heat = fig.data[0]
    assert [y.replace("<br>", " ") for y in heat.y] == [f.name for f in FAMILIES]  # long names on two lines
    assert max(len(line) for y in heat.y for line in y.split("<br>")) <= 26 and heat.colorbar.orientation == "h"
    assert list(heat.x) == ["multi-turn · 64", "single-shot · 64", "RAG", "code edits"]
    assert heat.z[0][0] == 0.9 and heat.text[0][0] == f"{UNSURE} 90%"
    assert heat.z[1][0] is None and heat.text[1][0] == "failed"
    assert heat.text[0][1] == "not run" and heat.text[0][2] == "not<br>measured"
    # words wrap at one size: plotly shrank a line wider than its cell to a few pixels
    assert heat.textfont.size == 11 and all(len(line) <= CELL_CHARS for row in heat.text for cell in row
                                            for line in cell.split("<br>"))
    two = seed_table_figure(seed_cells(pd.DataFrame(full(64) + full(128) + rows("quest", 42, budget=128))))
    assert list(two.data[0].x) == ["multi-turn · 64", "multi-turn · 128", "single-shot · 64", "single-shot · 128",
                                   "RAG", "code edits"]
    assert two.data[0].z[3][1] == 0.7 and two.data[0].text[3][0] == "not run"


def test_query_agnostic_and_oracle_rows_have_verdicts_from_their_own_runs() -> None:
    table = pd.DataFrame(full() + rows("expected_attention", 36, kl=0.4) + rows("keydiff", 48, kl=0.9)
                         + rows("oracle", TURNS, kl=0.1, held=0.25))
    cells = seed_cells(table)
    agnostic = cell(cells, "query-agnostic scoring")  # keydiff's 48 of 60 ([0.68, 0.88]) beats expected attention's 36
    assert (agnostic["verdict"], agnostic["policy"], agnostic["accuracy_of_full"]) == ("⚠", "keydiff", 0.8)
    oracle = cell(cells, "oracle (not deployable: reads later turns)")
    assert (oracle["verdict"], oracle["policy"], oracle["accuracy_of_full"]) == ("✓", "oracle", 1.0)
    assert oracle["agrees"] == "the seed gives no verdict"
    assert family_of("expected_attention", {}) == family_of("keydiff", {}) == "query-agnostic scoring"
    assert "oracle" in seed_table(table)["policies"].tolist()


def test_head_adaptive_and_head_hybrid_rows_have_verdicts_from_their_own_runs() -> None:
    table = pd.DataFrame(full() + rows("adakv", 48, kl=0.3, params={"scorer": "snapkv", "alpha_safeguard": 0.2})
                         + rows("duoattention", 57, kl=0.2, held=0.3, params={"head_compression_ratio": 0.8})
                         + rows("kivi", 20, params={"bits": 4, "evict_with": "adakv"}))
    cells = seed_cells(table)
    adaptive = cell(cells, "head-adaptive budgets (AdaKV)")  # 48 of 60: [68–88 %], between the lines
    assert (adaptive["verdict"], adaptive["policy"], adaptive["accuracy_of_full"]) == ("⚠", "adakv", 0.8)
    hybrid = cell(cells, "head-hybrid (DuoAttention)")  # 57 of 60: 95 % but [86–98 %] straddles 90 %
    assert (hybrid["verdict"], hybrid["policy"], hybrid["n"]) == (UNSURE, "duoattention", TURNS)
    assert hybrid["share_low"] < 0.9 < hybrid["share_high"] and f"{UNSURE} 95% [86–98%]" in hybrid["cell"]
    assert hybrid["held_share"] == pytest.approx(0.3)
    assert cell(cells, "quantization + eviction")["policy"] == "kivi"  # AdaKV under KIVI is quantization + eviction
    assert family_of("adakv", {"scorer": "kvzip"}) == "head-adaptive budgets (AdaKV)"
    listed = seed_table(table).set_index("family")["policies"]
    assert listed["head-adaptive budgets (AdaKV)"] == "adakv with any scorer"
    assert listed["head-hybrid (DuoAttention)"] == "duoattention"


def test_the_headroom_chart_draws_the_oracle_dashed_and_says_each_familys_distance_to_it() -> None:
    table = pd.DataFrame(full(64) + full(128) + rows("snapkv", 30) + rows("snapkv", 45, budget=128, held=0.4)
                         + rows("oracle", 54, kl=0.1) + rows("oracle", 60, budget=128, kl=0.05)
                         + rows("duoattention", 60, held=0.86)  # no budget bounds its retrieval heads
                         + rows("streamingllm", 6, mode="single-shot") + full(64, mode="single-shot"))
    fig = seed_headroom_figure(seed_cells(table))
    by_name = {t.name: t for t in fig.data if t.xaxis == "x"}
    oracle = by_name["oracle (not deployable: reads later turns): headroom · held 25% of Full's bytes"]
    assert oracle.line.dash == "longdash" and list(oracle.y) == [0.9, 1.0]
    snap = by_name["importance scoring · held 25–40% of Full's bytes"]
    assert list(snap.x) == ["64", "128"] and list(snap.y) == [0.5, 0.75] and snap.line.dash is None
    assert [c[1] for c in snap.customdata] == ["oracle 90%: +40 points of headroom<br>held 25% of Full's bytes",
                                               "oracle 100%: +25 points of headroom<br>held 40% of Full's bytes"]
    assert snap.error_y.array[0] == pytest.approx(wilson(30, 60).high - 0.5)
    assert list(by_name["head-hybrid (DuoAttention) · held 86% of Full's bytes"].y) == [1.0]  # above the oracle's
    single = [t for t in fig.data if t.xaxis == "x2"]  # its own panel; no oracle there, so the hover says so
    assert [t.name for t in single] == ["window / sink · held 25% of Full's bytes"]
    assert single[0].customdata[0][1] == "oracle not run at this budget<br>held 25% of Full's bytes"
    assert "against the oracle's headroom (dashed" in fig.layout.title.text
    without = seed_headroom_figure(seed_cells(table[table["policy"] != "oracle"]))  # no dashed line to promise
    assert "oracle's headroom" not in without.layout.title.text and "add the oracle" in without.layout.title.text


def test_a_grid_where_full_answered_nothing_still_writes_every_cell_and_says_why_nothing_is_drawn() -> None:
    """Plotly draws no cell of a heatmap without a single value, and so none of its words: the grid stays written."""
    cells = seed_cells(pd.DataFrame(rows("full", 0, kl=0.0, held=1.0) + rows("streamingllm", 0)))
    heat = seed_table_figure(cells).data[0]
    assert all(v is not None for row in heat.z for v in row) and not heat.showscale
    assert heat.text[0][0] == "n/a (Full<br>answered<br>none)" and heat.text[1][0] == "not run"
    headroom = seed_headroom_figure(cells)
    assert not headroom.data and "Nothing to draw" in headroom.layout.annotations[-1].text
