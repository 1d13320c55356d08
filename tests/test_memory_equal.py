"""The memory-equal comparison (issue 12 item 3) on the tiny random Llama: measured bytes held and read."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from kvlab.experiments.arena import ArenaSettings, memory_equal, results_json, run_arena
from kvlab.workloads.chat.conversation import Conversation, Turn
from kvlab.engine.model import LoadedModel
from kvlab.viz.arena import memory_equal_figure

CONTEXT = "Notes for the new cook. " + " ".join(f"Shelf {i} holds jar {100 + i}." for i in range(16))
CONV = Conversation(name="jars", description="two questions on one context", system=None, turns=(
    Turn(user=CONTEXT + "\n\nWhat does shelf 3 hold?", golden="Shelf 3 holds jar 103.", answer="103"),
    Turn(user="And shelf 7?", golden="Shelf 7 holds jar 107.", answer="107"),
))
SETTINGS = ArenaSettings(policies=("streamingllm", "quest", "kivi"), budgets=(32, 64), max_new_tokens=3,
                         params={"kivi": {"bits": 4, "group_size": 16, "residual": 16}})


@pytest.fixture(scope="module")
def table(tiny: LoadedModel) -> pd.DataFrame:
    return run_arena(tiny, [CONV], SETTINGS)


def at(table: pd.DataFrame, policy: str) -> pd.DataFrame:
    return table[table["policy"] == policy].reset_index(drop=True)


def test_bytes_read_per_generated_token(table: pd.DataFrame, tiny: LoadedModel) -> None:
    assert table["error"].isna().all()
    for name in ("full", "streamingllm", "kivi"):  # every key is read: what is held
        rows = at(table, name)
        assert rows["kv_bytes_read"].equals(rows["kv_bytes"].astype(float)) and rows["read_share"].isna().all()
    full, quest, kivi = at(table, "full"), at(table, "quest"), at(table, "kivi")
    assert (kivi["kv_bytes"] < full["kv_bytes"]).all()  # 4-bit storage, scales and zero points included
    f = tiny.facts
    meta = [f.n_layers * 2 * math.ceil(n / 16) * f.n_kv_heads * f.head_dim * f.bytes_per_element
            for n in quest["total_tokens"]]  # quest keeps every token; two key vectors per page of 16
    assert (quest["kv_bytes"] == full["kv_bytes"] + meta).all()
    assert (quest["read_share"] < 1).all()
    expected = meta + quest["read_share"] * (quest["kv_bytes"] - meta)
    assert quest["kv_bytes_read"].tolist() == pytest.approx(expected.tolist())
    assert (quest["kv_bytes_read"] < full["kv_bytes"]).all()


def test_memory_equal_summary_and_figure(table: pd.DataFrame) -> None:
    summary = memory_equal(table).set_index(["policy", "budget"])
    assert (summary.loc["full", "held_share"] == 1).all() and (summary.loc["full", "read_share_of_full"] == 1).all()
    assert (summary.loc["quest", "held_share"] > 1).all() and (summary.loc["quest", "read_share_of_full"] < 1).all()
    assert (summary.loc["kivi", "held_share"] < 1).all()
    s = summary.loc["streamingllm"]
    assert (s["held_share"] == s["read_share_of_full"]).all() and s.loc[32, "held_share"] < s.loc[64, "held_share"]
    rows = at(table, "streamingllm")
    shares = rows["kv_bytes"] / at(table, "full")["kv_bytes"]
    assert s.loc[32, "held_share"] == pytest.approx(shares[rows["budget"] == 32].mean())
    fig = memory_equal_figure(memory_equal(table))
    assert len(fig.data) == 4 * 2 + 3 * 2  # every policy in both accuracy panels, all but Full in both KL panels


def test_results_json_holds_the_memory_equal_table(table: pd.DataFrame) -> None:
    data = json.loads(json.dumps(results_json(table, SETTINGS, "tiny-llama", [CONV.name])))
    rows = {(r["policy"], r["budget"]): r for r in data["memory_equal"]}
    summary = memory_equal(table).set_index(["policy", "budget"])
    assert set(rows) == set(summary.index) and len(rows) == 4 * 2
    for key, r in rows.items():
        assert r["held_share"] == pytest.approx(summary.loc[key, "held_share"])
        assert r["read_share_of_full"] == pytest.approx(summary.loc[key, "read_share_of_full"])
    assert rows[("full", 32)]["held_share"] == 1 and rows[("quest", 32)]["held_share"] > 1
    assert rows[("kivi", 64)]["held_share"] < 1
    assert results_json(table.iloc[:0], SETTINGS, "tiny-llama", [CONV.name])["memory_equal"] == []
