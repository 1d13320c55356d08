"""The memory-equal comparison (issue 12 item 3) on the tiny random Llama: measured bytes held and read."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from kvlab.cli import chat as chat_command
from kvlab.cli import main
from kvlab.engine.facts import LoadedModel
from kvlab.errors import KvlabError
from kvlab.experiments.plan import ArenaSettings, parse_budgets
from kvlab.experiments.runner import check_grid, run_arena
from kvlab.experiments.seed_table import seed_cells
from kvlab.experiments.tables import memory_equal, results_json
from kvlab.policies import make_policy
from kvlab.policies.memory import MIB, held_bound, kivi_worst_bytes, tokens_within
from kvlab.viz.arena import SHARE_STEP, memory_equal_figure
from kvlab.workloads.chat.budgets import budget_words, mib_settings
from kvlab.workloads.chat.conversation import Conversation, Turn, conversation_to_json
from kvlab.workloads.chat.settings import ChatSettings

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


@pytest.mark.slow
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


BY_BYTES = ArenaSettings(policies=("streamingllm", "pyramidkv", "quest", "kivi"), budget_unit="mib",
                         budgets=(0.05,), max_new_tokens=3,
                         params={"kivi": {"bits": 4, "group_size": 8, "residual": 16, "evict_with": "streamingllm"},
                                 "pyramidkv": {"window": 8}})


def test_a_byte_budget_gives_each_policy_the_tokens_that_fit_and_is_never_exceeded(tiny: LoadedModel) -> None:
    """At one byte budget the 4-bit cache keeps more tokens than full precision, and no evicting policy's
    measured bytes after a turn exceed the budget (the conversation outgrows it)."""
    cap = int(0.05 * MIB)
    chat = BY_BYTES.chat_settings(0.05, tiny.facts)
    per_token = tiny.facts.kv_bytes(1)  # one token's K and V over every layer and KV head, unquantized
    assert chat.budget_of("streamingllm") == chat.budget_of("quest") == cap // per_token
    assert held_bound(make_policy("pyramidkv", window=8), chat.budget_of("pyramidkv"), tiny.facts) <= cap
    assert chat.budget_of("kivi") > 2 * chat.budget_of("streamingllm")  # 4 bits + scales ≈ a quarter and more
    table = run_arena(tiny, [CONV], BY_BYTES)
    assert table["error"].isna().all()
    assert (table["total_tokens"] * per_token > cap).all()  # the budget binds: Full holds more than it
    for name in ("streamingllm", "pyramidkv", "kivi"):
        rows = at(table, name)
        assert (rows["kv_bytes"] <= cap).all(), (name, rows["kv_bytes"].tolist(), cap)
        assert (rows["budget_tokens"] == chat.budget_of(name)).all()
    assert (at(table, "kivi")["kept_tokens"] > at(table, "streamingllm")["kept_tokens"]).all()
    assert set(seed_cells(table)["budget"]) == {0.05}  # a fractional MiB budget is not rounded away


def test_a_byte_budget_gives_pyramidkv_its_largest_fitting_budget(tiny: LoadedModel) -> None:
    """PyramidKV's integer pyramid holds less at some larger budgets, so bisection is not enough: the budget
    chosen is the largest of all that fit."""
    policy, facts = make_policy("pyramidkv"), replace(tiny.facts, n_layers=30)  # the embedded model's depth
    held = {b: held_bound(policy, b, facts) for b in range(policy.min_budget(), 513)}
    assert any(held[b + 1] < held[b] for b in range(policy.min_budget(), 512))  # not monotone: the case at hand
    for kib in (300, 437, 1000, 3000):
        nbytes = kib * 1024
        assert tokens_within(policy, nbytes, facts, 512) == max(b for b, h in held.items() if h <= nbytes)


def test_kivis_worst_case_bounds_every_quantization_state(tiny: LoadedModel) -> None:
    quant = make_policy("kivi", bits=2, group_size=8, residual=16).quantizer()
    heads = tiny.facts.n_kv_heads
    for slots in (1, 7, 8, 9, 23, 40):
        worst = kivi_worst_bytes(quant, slots, tiny.facts)
        for k_full in range(min(slots, 15) + 1):  # fewer than residual keys in full precision per head
            for v_full in (0, min(slots, 16)):
                layer = SimpleNamespace(key_quantized=torch.arange(slots).expand(heads, slots) < slots - k_full,
                                        value_quantized=torch.arange(slots).expand(heads, slots) < slots - v_full)
                assert quant.layer_bytes(layer, tiny.facts.head_dim, tiny.facts.bytes_per_element) <= worst


def test_a_byte_budget_below_a_policys_minimum_is_refused_in_words(tiny: LoadedModel) -> None:
    small = ArenaSettings(policies=("snapkv",), budget_unit="mib", budgets=(0.0005,))
    with pytest.raises(KvlabError, match="snapkv: 0.0005 MiB of K/V does not hold its minimum budget"):
        check_grid(tiny, [CONV], small)
    whole = tiny.facts.kv_bytes(tiny.facts.context_length) / MIB  # Full's K/V over the whole context
    check_grid(tiny, [CONV], ArenaSettings(policies=("snapkv",), budget_unit="mib", budgets=(whole,)))
    with pytest.raises(KvlabError, match=r"budget 1e\+09 MiB exceeds the K/V the model holds over its whole context"):
        check_grid(tiny, [CONV], ArenaSettings(policies=("snapkv",), budget_unit="mib", budgets=(whole, 1e9)))
    with pytest.raises(KvlabError, match="numbers of MiB"):
        ArenaSettings(budget_unit="mib", budgets=(float("nan"),))
    with pytest.raises(KvlabError, match="budget unit must be one of tokens, mib"):
        ArenaSettings(budget_unit="gb")
    assert parse_budgets("2.5, 5", "mib") == (2.5, 5.0)


def test_the_kl_axis_spans_the_kls_drawn() -> None:
    summary = pd.DataFrame({"policy": ["full", "streamingllm", "kivi"], "budget": [64] * 3, "held_share": [1, .2, .25],
                            "read_share_of_full": [1, .2, .25], "accuracy": [1, 0, 1], "kl": [0, 1.4, 0.02],
                            "failed": [0, 0, 0]})
    fig = memory_equal_figure(summary)
    low, high = fig.layout.yaxis3.range
    assert 10 ** low < 0.02 and 10 ** high > 1.4 and 10 ** high < 3  # not the 10^4 plotly drew on its own
    assert fig.layout.yaxis4.range == fig.layout.yaxis3.range


def test_points_of_several_policies_at_one_spot_stand_side_by_side() -> None:
    """Full, Quest and KIVI holding every answer at one share would hide each other; each is drawn apart, the
    hover keeps the measured share, and a point alone stays where it was measured."""
    summary = pd.DataFrame({"policy": ["full", "quest", "kivi", "snapkv"], "budget": [64] * 4,
                            "held_share": [1.0, 1.0, 1.0, 0.3], "read_share_of_full": [1.0, 0.3, 1.0, 0.3],
                            "accuracy": [1.0, 1.0, 1.0, 0.5], "kl": [0, 0.01, 0.01, 0.2], "failed": [0] * 4})
    fig = memory_equal_figure(summary)
    held = {t.name: (t.x[0], t.customdata[0]) for t in fig.data if t.xaxis == "x" and t.yaxis == "y"}
    assert sorted(x for x, _ in list(held.values())[:3]) == pytest.approx([1 - SHARE_STEP, 1, 1 + SHARE_STEP])
    assert all(measured == 1.0 for _, measured in list(held.values())[:3]) and held["snapkv"] == (0.3, 0.3)
    read_kl = {t.name: t.x[0] for t in fig.data if t.xaxis == "x4"}  # bottom right: KL against bytes read
    assert read_kl == {"quest": 0.3, "kivi": 1.0, "snapkv": 0.3}  # KIVI alone at 1; Quest and SnapKV differ in KL


def test_a_workload_longer_than_the_context_is_refused_before_any_cell(tiny: LoadedModel) -> None:
    words = "the jar on the shelf holds lentils " * 150  # about 1.05k tokens a turn, the tiny model has 2,048
    long = Conversation(name="long", description="", system=None,
                        turns=(Turn(user=words), Turn(user=words), Turn(user="What does the jar hold?")))
    settings = ArenaSettings(policies=("snapkv",), budgets=(16,), max_new_tokens=8)
    with pytest.raises(KvlabError, match=r"^long: its messages and golden replies with 8 new tokens take at least "
                                         r"\d+ positions, more than .*'s context of 2048; no turn was run$"):
        check_grid(tiny, [CONV, long], settings)
    check_grid(tiny, [CONV, long], replace(settings, position_mode="rerotated"))  # positions stay in the cache
    check_grid(tiny, [CONV, long], replace(settings, max_turns=1))  # the grid runs turn 1 alone: it fits
    # single-shot asks each later question against turn 1 alone: 1.05k + 1.05k does not fit, 1.05k + a question does
    with pytest.raises(KvlabError, match="no turn was run"):
        check_grid(tiny, [long], replace(settings, modes=("single-shot",)))
    check_grid(tiny, [replace(long, turns=long.turns[::2])], replace(settings, modes=("single-shot",)))
    # a turn that would fit but for its reply's new tokens: check_fits would refuse it only after turn 1 ran
    short = replace(long, turns=long.turns[:1] + (Turn(user="the jar on the shelf holds lentils " * 135),))
    check_grid(tiny, [short], settings)
    with pytest.raises(KvlabError, match="with 128 new tokens"):
        check_grid(tiny, [short], replace(settings, max_new_tokens=128))


def test_a_chat_runs_at_a_byte_budget_as_the_arena_does_and_a_bad_one_is_refused(tiny: LoadedModel, tmp_path,
                                                                                  monkeypatch, capsys) -> None:
    base = ChatSettings(policies=("streamingllm", "kivi"), max_new_tokens=3,
                        params={"kivi": {"bits": 4, "group_size": 8, "residual": 16, "evict_with": "streamingllm"}})
    chat = mib_settings(base, 0.05, tiny.facts)
    arena = ArenaSettings(policies=("streamingllm", "kivi"), budget_unit="mib", budgets=(0.05,), max_new_tokens=3,
                          params=base.params).chat_settings(0.05, tiny.facts)
    assert (chat.budget, chat.policy_budgets, chat.budget_mib) == (arena.budget, arena.policy_budgets, 0.05)
    assert chat.budget_of("kivi") > 2 * chat.budget_of("streamingllm")  # 4 bits hold more tokens in the bytes
    for mib, words in ((0.0, "more than 0 MiB, not 0"), (1e9, "exceeds the K/V the model holds over its whole"),
                       (0.0005, "does not hold its minimum budget")):
        with pytest.raises(KvlabError, match=words):
            mib_settings(base, mib, tiny.facts)
    monkeypatch.setattr(chat_command, "load_model", lambda *a, **k: tiny)
    conv = tmp_path / "conv.json"
    conv.write_text(json.dumps(conversation_to_json(CONV)))
    out = tmp_path / "out.json"
    assert main(["chat", "--conversation", str(conv), "--policies", "streamingllm,kivi", "--budget-unit", "mib",
                 "--budget", "0.05", "--max-new-tokens", "3", "--out", str(out),
                 *[f"--param=kivi.{k}={v}" for k, v in base.params["kivi"].items()]]) == 0
    saved = json.loads(out.read_text())["settings"]
    assert (saved["budget_mib"], saved["policy_budgets"]) == (0.05, chat.policy_budgets)
    assert f"budget: {budget_words(chat)}" in capsys.readouterr().out  # each policy's tokens, said as on the page
    # a policy whose minimum is past the 128 tokens of an unconverted budget: judged by its bytes, not by 128
    mib = tiny.facts.kv_bytes(600) / MIB
    assert main(["chat", "--conversation", str(conv), "--policies", "quest", "--param", "quest.page_size=200",
                 "--budget-unit", "mib", "--budget", f"{mib:.4f}", "--max-new-tokens", "2", "--out", str(out)]) == 0
    assert main(["chat", "--conversation", str(conv), "--budget-unit", "mib", "--budget", "0", "--out",
                 str(out)]) == 2
