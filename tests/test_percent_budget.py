"""A budget of a % of Full's K/V bytes (issue 24 item 4): converted before every compression from what Full holds
then, never exceeded on a measured turn, a policy's minimum kept and marked, and no eviction while the conversation
fits. Tiny random models with a byte tokenizer: no embedded model."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from kvlab.engine.facts import LoadedModel
from kvlab.engine.tiny import byte_tokenizer, tiny_model
from kvlab.errors import KvlabError
from kvlab.experiments.plan import ArenaSettings, parse_budgets
from kvlab.experiments.runner import run_arena
from kvlab.experiments.tables import memory_equal
from kvlab.policies import make_policy
from kvlab.policies.memory import held_bound, kivi_worst_bytes, share_tokens
from kvlab.workloads.chat.conversation import Conversation, Turn
from kvlab.workloads.chat.records import budget_marks, over_budget
from kvlab.workloads.chat.settings import ChatSettings

CONTEXT = "Notes. " + " ".join(f"Shelf {i} holds jar {100 + i}." for i in range(6))
CONV = Conversation(name="jars", description="three questions on one context", system=None, turns=(
    Turn(user=CONTEXT + " What does shelf 3 hold?", golden="Jar 103.", answer="103"),
    Turn(user="And shelf 5?", golden="Jar 105.", answer="105"),
    Turn(user="And shelf 1?", golden="Jar 101.", answer="101"),
))
KIVI = {"bits": 4, "group_size": 8, "residual": 16, "evict_with": "streamingllm"}
EVICTING = ("streamingllm", "pyramidkv", "kivi")  # full precision, a per-layer pyramid, quantized with eviction
SETTINGS = ArenaSettings(policies=(*EVICTING, "quest"), budget_unit="percent", budgets=(25, 60), max_new_tokens=3,
                         params={"kivi": KIVI, "pyramidkv": {"window": 8}})


@pytest.fixture(scope="module")
def llama() -> LoadedModel:
    return tiny_model("llama", tokenizer=byte_tokenizer())[0]


@pytest.fixture(scope="module")
def table(llama: LoadedModel) -> pd.DataFrame:
    return run_arena(llama, [CONV], SETTINGS)


def with_full(table: pd.DataFrame) -> pd.DataFrame:
    """Each row with the bytes Full held on the same budget, mode and turn."""
    keys = ["budget", "mode", "turn"]
    full = table[table["policy"] == "full"].set_index(keys)["kv_bytes"].rename("full_bytes")
    return table.join(full, on=keys)


@pytest.mark.slow
def test_every_measured_turn_holds_at_most_its_share_of_what_full_holds(table: pd.DataFrame) -> None:
    assert table["error"].isna().all()
    t = with_full(table)
    for name in EVICTING:
        rows = t[t["policy"] == name]
        share = (rows["full_bytes"] * rows["budget"] / 100).astype(int)  # the bytes the budget allows that turn
        assert (rows["budget_kib"] * 1024 == share).all(), name
        assert (rows["kv_bytes"] <= share).all(), (name, rows[["kv_bytes", "budget_kib"]])
        assert rows["held_share"].tolist() == pytest.approx((rows["kv_bytes"] / rows["full_bytes"]).tolist())
        for _, cell in rows.groupby("budget"):  # the budget grows with the conversation
            assert cell["budget_kib"].is_monotonic_increasing and cell["budget_tokens"].is_monotonic_increasing
    at25 = t[t["budget"] == 25].set_index(["policy", "turn"])
    assert (at25.loc["streamingllm", "kept_tokens"] < at25.loc["streamingllm", "total_tokens"]).all()  # it binds
    assert (at25.loc["kivi", "kept_tokens"] > at25.loc["streamingllm", "kept_tokens"]).all()  # 4 bits hold more
    for name in ("full", "quest"):  # they keep every token: no number they would ignore
        assert t[t["policy"] == name]["budget_kib"].isna().all()
    assert t[t["policy"] == "full"]["budget_tokens"].isna().all()
    assert t[t["policy"] == "quest"]["budget_tokens"].notna().all()  # what a decoding query reads
    summary = memory_equal(table).set_index(["policy", "budget"])["held_vs_budget"]
    assert (summary.loc[list(EVICTING)] == "within").all()
    assert (summary.loc[["full", "quest"]] == "no budget bounds it").all()


@pytest.mark.slow
def test_on_a_sliding_window_model_the_share_is_of_what_full_really_holds() -> None:
    lm = tiny_model("gemma3", tokenizer=byte_tokenizer())[0]
    settings = ArenaSettings(policies=("streamingllm", "snapkv"), budget_unit="percent", budgets=(40,),
                             max_new_tokens=2, max_turns=2, params={"snapkv": {"window": 4}})
    t = with_full(run_arena(lm, [CONV], settings))
    assert t["error"].isna().all()
    full = t[t["policy"] == "full"]
    assert (full["kv_bytes"] < [lm.facts.kv_bytes(n) for n in full["total_tokens"]]).all()  # windows hold less
    rows = t[t["policy"] != "full"]
    assert (rows["kv_bytes"] <= (rows["full_bytes"] * 0.4).astype(int)).all()


@pytest.mark.slow
def test_a_share_below_a_policys_minimum_keeps_the_minimum_and_is_marked(llama: LoadedModel) -> None:
    settings = ArenaSettings(policies=("streamingllm",), budget_unit="percent", budgets=(1,), max_new_tokens=2,
                             max_turns=1, params={"streamingllm": {"n_sink": 8}})
    table = run_arena(llama, [CONV], settings)
    row = table[table["policy"] == "streamingllm"].iloc[0]
    assert row["error"] is None and row["budget_tokens"] == 9  # n_sink + 1: its minimum
    assert row["kv_kib"] > row["budget_kib"]
    # the row names the turn and its numbers: the budget column is the largest any turn allowed, not that turn's
    assert memory_equal(table).set_index("policy").loc["streamingllm", "held_vs_budget"] == (
        f"over its budget on turn 1 of {row['workload']} ({row['mode']}): {row['kv_kib']:.1f} KiB held, "
        f"{row['budget_kib']:.1f} allowed")


def test_each_turn_says_whether_it_held_more_than_its_budget_allowed() -> None:
    rows = pd.DataFrame({"kv_kib": [45.0, 20.0, 90.0, None], "budget_kib": [27.2, 27.2, None, 27.2]})
    marks = list(budget_marks(over_budget(rows), rows["budget_kib"], rows["kv_kib"]))
    assert marks[:3] == ["over its budget", "within", "no budget bounds it"]
    assert pd.isna(marks[3])  # a failed row held nothing to compare: no mark


@pytest.mark.slow
def test_no_eviction_while_the_conversation_fits_the_budget(llama: LoadedModel) -> None:
    """PyramidKV's pyramid gives its top layers less than the budget; a conversation shorter than the budget
    still keeps every token. At 100 % of Full's bytes every full-precision policy keeps what Full keeps."""
    for settings in (ArenaSettings(policies=("pyramidkv",), budgets=(400,), max_new_tokens=2, max_turns=2),
                     ArenaSettings(policies=EVICTING, budget_unit="percent", budgets=(100,), max_new_tokens=2,
                                   max_turns=2, params={"kivi": KIVI})):
        table = run_arena(llama, [CONV], settings)
        assert (table["total_tokens"] < 400).all()
        assert (table["kept_tokens"] == table["total_tokens"]).all(), table[["policy", "turn", "kept_tokens"]]


def test_the_share_becomes_the_largest_token_budget_whose_worst_case_fits(llama: LoadedModel) -> None:
    facts = llama.facts
    policies = [make_policy("streamingllm"), make_policy("pyramidkv", window=8), make_policy("kivi", **KIVI)]
    for full_tokens in (40, 150, 300):
        full_bytes = facts.kv_bytes(full_tokens)
        for percent in (10, 25, 50):
            allowed = int(full_bytes * percent / 100)
            for policy in policies:
                fitting = [b for b in range(policy.min_budget(), full_tokens + 1)
                           if held_bound(policy, b, facts, full_tokens) <= allowed]
                expected = max(fitting, default=policy.min_budget())  # the minimum where none fits
                assert share_tokens(policy, percent, full_bytes, full_tokens, facts) == expected
    assert share_tokens(make_policy("streamingllm"), 25, facts.kv_bytes(100), 100, facts) == 25  # bytes ∝ tokens
    assert share_tokens(make_policy("snapkv"), 1, facts.kv_bytes(40), 40, facts) == make_policy("snapkv").min_budget()


def test_kivis_bound_after_seen_tokens_covers_groups_an_eviction_cut(llama: LoadedModel) -> None:
    """An eviction can leave one key of each quantized group, each group keeping its min and max: the bound
    without the conversation's length misses that, the bound after ``seen`` tokens does not."""
    quant = make_policy("kivi", bits=2, group_size=8, residual=16).quantizer()
    heads, f = llama.facts.n_kv_heads, llama.facts
    slots = 24
    layer = SimpleNamespace(key_quantized=torch.ones(heads, slots, dtype=torch.bool),
                            value_quantized=torch.ones(heads, slots, dtype=torch.bool),
                            key_group=torch.arange(heads * slots).view(heads, slots))  # one key left per group
    held = quant.layer_bytes(layer, f.head_dim, f.bytes_per_element)
    assert held > kivi_worst_bytes(quant, slots, f)
    assert held <= kivi_worst_bytes(quant, slots, f, slots * 8)  # the conversation filled that many groups


def test_a_percent_budget_is_checked_in_words() -> None:
    assert parse_budgets("12.5, 25%", "percent") == (12.5, 25.0)
    for budgets in ((0,), (150,), (float("nan"),)):
        with pytest.raises(KvlabError, match="% of Full's K/V bytes"):
            ArenaSettings(budget_unit="percent", budgets=budgets)
    with pytest.raises(KvlabError, match="more than 0 and at most 100, not 0"):
        ChatSettings(budget_percent=0)
    with pytest.raises(KvlabError, match="either MiB or a %"):
        ChatSettings(budget_percent=20, budget_mib=1.0)
    chat = ArenaSettings(budget_unit="percent", budgets=(25,)).chat_settings(25)
    assert chat.budget_percent == 25 and chat.budget_mib is None
