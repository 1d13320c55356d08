"""The seed's table rebuilt from arena rows: hand-made rows at the thresholds' edges, failures, gaps."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from kvlab.experiments.runner import COLUMNS
from kvlab.experiments.seed_table import FAMILIES, WORKLOADS, family_of, seed_cells, seed_table, verdict
from kvlab.viz.arena import seed_table_figure

FULL_BYTES = 1000
TURNS = 10  # Full answers every one of them


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


def test_thresholds_at_their_edges() -> None:
    assert [verdict(x) for x in (1.0, 0.9, 0.8999, 0.5, 0.4999, 0.0)] == ["✅", "✅", "⚠", "⚠", "✗", "✗"]
    table = pd.DataFrame(full() + rows("streamingllm", 9) + rows("snapkv", 5, kl=0.7) + rows("h2o", 4)
                         + rows("pyramidkv", 4, held=0.3))
    cells = seed_cells(table)
    window = cell(cells, "window / sink")
    assert (window["verdict"], window["policy"], window["accuracy_of_full"]) == ("✅", "streamingllm", 0.9)
    assert window["held_share"] == pytest.approx(0.25) and window["agrees"] == "agrees"
    importance = cell(cells, "importance scoring")  # the best member: snapkv's 5 of 10 beats h2o's 4
    assert (importance["verdict"], importance["policy"], importance["kl"]) == ("⚠", "snapkv", pytest.approx(0.7))
    assert importance["agrees"] == "agrees"
    pyramid = cell(cells, "pyramid")
    assert pyramid["verdict"] == "✗" and pyramid["agrees"] == "no: worse"
    assert "✗ 40% of Full's answers (10 by Full)" in pyramid["cell"] and "held 30% of Full's bytes" in pyramid["cell"]


def test_ties_go_to_the_lower_kl() -> None:
    table = pd.DataFrame(full() + rows("h2o", 6, kl=0.9) + rows("tova", 6, kl=0.4))
    assert cell(seed_cells(table), "importance scoring")["policy"] == "tova"


def test_a_failed_policy_is_failed_not_a_number() -> None:
    table = pd.DataFrame(full() + rows("streamingllm", 9, error_from=4) + rows("h2o", 3, error_from=6)
                         + rows("tova", 2))
    cells = seed_cells(table)
    window = cell(cells, "window / sink")
    assert window["status"] == "failed" and window["verdict"] == "failed"
    assert pd.isna(window["accuracy_of_full"]) and pd.isna(window["kl"]) and pd.isna(window["held_share"])
    assert window["cell"] == "failed: streamingllm: RuntimeError: boom"
    importance = cell(cells, "importance scoring")  # tova is measured; h2o failed and is named, not scored
    assert importance["policy"] == "tova" and importance["accuracy_of_full"] == 0.2 and "h2o failed" in importance["cell"]


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


def test_kivi_splits_by_what_it_evicts_with() -> None:
    assert family_of("kivi", {"bits": 4, "evict_with": "full"}) == "quantization"
    assert family_of("kivi", {"bits": 2, "evict_with": "streamingllm"}) == "quantization + eviction"
    assert family_of("kivi", {"bits": 16, "evict_with": "snapkv"}) == "importance scoring"
    assert family_of("full", {}) is None
    table = pd.DataFrame(full() + rows("kivi", 10, held=0.27, params={"bits": 4, "evict_with": "full"}))
    quantized = cell(seed_cells(table), "quantization")
    assert quantized["verdict"] == "✅" and quantized["held_share"] == pytest.approx(0.27)
    assert quantized["agrees"] == "the seed gives no verdict"
    assert cell(seed_cells(table), "quantization + eviction")["status"] == "not run"


def test_modes_and_budgets_are_separate_cells_and_full_answering_none_is_not_rated() -> None:
    table = pd.DataFrame(full(64) + rows("streamingllm", 2, budget=64) + full(64, "single-shot")
                         + rows("streamingllm", 10, budget=64, mode="single-shot")
                         + rows("full", 0, budget=128, kl=0.0, held=1.0) + rows("streamingllm", 0, budget=128))
    cells = seed_cells(table)
    assert cell(cells, "window / sink")["verdict"] == "✗"
    assert cell(cells, "window / sink", "single-shot")["verdict"] == "✅"
    none = cell(cells, "window / sink", budget=128)
    assert none["verdict"] == "n/a (Full answered none)" and none["agrees"] == "cannot tell"
    wide = seed_table(table)
    assert list(wide.columns) == ["family", "policies", "budget", *WORKLOADS]
    assert wide["family"].tolist() == [f.name for f in FAMILIES for _ in (64, 128)]
    assert wide.loc[0, "multi-turn"].startswith("✗ 20% of Full's answers")
    assert wide.loc[0, "multi-turn"].endswith("| seed: ✅ 好 (good): temporal locality follows how older turns fade "
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
    # tova's share of Full's answers at 512, counted here by hand from the rows
    rows = table[(table["budget"] == 512) & (table["mode"] == "multi-turn") & table["scored"]]
    hits = rows.groupby("policy")["correct"].sum()
    importance = cell(cells, "importance scoring", budget=512)
    assert importance["policy"] == "tova" and importance["accuracy_of_full"] == hits["tova"] / hits["full"]
    keys = ["workload", "turn"]
    held = rows[rows["policy"] == "tova"].merge(rows[rows["policy"] == "full"], on=keys, suffixes=("", "_full"))
    assert importance["held_share"] == pytest.approx((held["kv_bytes"] / held["kv_bytes_full"]).mean())
    assert 0.3 < importance["held_share"] < 0.5  # 512 tokens of conversations of 1.1k–2.1k
    assert (cells[cells["family"] == "quantization"].query("status == 'measured'")["verdict"] == "✅").all()
    assert (cells[cells["family"] == "pyramid"].query("status == 'measured'")["verdict"] == "✗").all()

def test_figure_colours_measured_cells_and_writes_the_rest() -> None:
    table = pd.DataFrame(full() + rows("streamingllm", 9) + rows("h2o", 3, error_from=2))
    fig = seed_table_figure(seed_cells(table))
    heat = fig.data[0]
    assert list(heat.y) == [f.name for f in FAMILIES]
    assert list(heat.x) == ["multi-turn · 64", "single-shot · 64", "RAG", "code edits"]
    assert heat.z[0][0] == 0.9 and heat.text[0][0] == "✅ 90%"
    assert heat.z[1][0] is None and heat.text[1][0] == "failed"
    assert heat.text[0][1] == "not run" and heat.text[0][2] == "not measured"
    two = seed_table_figure(seed_cells(pd.DataFrame(full(64) + full(128) + rows("quest", 7, budget=128))))
    assert list(two.data[0].x) == ["multi-turn · 64", "multi-turn · 128", "single-shot · 64", "single-shot · 128",
                                   "RAG", "code edits"]
    assert two.data[0].z[3][1] == 0.7 and two.data[0].text[3][0] == "not run"
