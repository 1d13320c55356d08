"""Single-shot next to multi-turn (issue 12 item 4) on the tiny random Llama: short turns, few reply tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

import kvlab.cli.arena as arena_command
from kvlab.cli import main
from kvlab.engine.facts import LoadedModel
from kvlab.errors import KvlabError
from kvlab.experiments.plan import MODES, ArenaSettings
from kvlab.experiments.report import arena_report
from kvlab.experiments.runner import COLUMNS, run_arena
from kvlab.experiments.tables import mode_drop, modes_note, one_mode
from kvlab.saved import TIMED
from kvlab.viz.arena import modes_figure
from kvlab.workloads.chat.conversation import Conversation, Turn
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.settings import ChatSettings

TIMINGS = [c for c in COLUMNS if TIMED.search(c)]  # the wall-clock columns, the only ones runs differ in

CONTEXT = "Notes for the new cook. " + " ".join(f"Shelf {i} holds jar {100 + i}." for i in range(12))
CONV = Conversation(name="jars", description="three questions on one context", system=None, turns=(
    Turn(user=CONTEXT + "\n\nWhat does shelf 3 hold?", golden="Shelf 3 holds jar 103.", answer="103"),
    Turn(user="And shelf 7?", golden="Shelf 7 holds jar 107.", answer="107"),
    Turn(user="And shelf 10?", golden="Shelf 10 holds jar 110.", answer="110"),
))
BOTH = ArenaSettings(policies=("streamingllm", "snapkv"), budgets=(32, 1024), max_new_tokens=3,
                     modes=("single-shot", "multi-turn"))


@pytest.fixture(scope="module")
def table(tiny: LoadedModel) -> pd.DataFrame:
    return run_arena(tiny, [CONV], BOTH)


def ask(session: ChatSession, turn: Turn, keep: bool):
    return session.run_turn(turn.user, golden=turn.golden, answer=turn.answer, keep=keep)


@pytest.mark.slow
def test_a_single_shot_turn_is_turn_one_then_that_question(tiny: LoadedModel) -> None:
    settings = ChatSettings(policies=("streamingllm",), budget=32, max_new_tokens=3)
    session = ChatSession(tiny, settings)
    ask(session, CONV.turns[0], keep=True)
    before = session.states["streamingllm"].snapshot()
    shots = [ask(session, t, keep=False) for t in CONV.turns[1:]]
    assert len(session.turns) == 1 and session.total_tokens == len(before["tokens"])  # nothing of the questions kept
    assert session.states["streamingllm"].tokens == before["tokens"]
    for turn, shot in zip(CONV.turns[1:], shots):  # each equals a fresh session that asked it right after turn 1
        fresh = ChatSession(tiny, settings)
        ask(fresh, CONV.turns[0], keep=True)
        alone = ask(fresh, turn, keep=True)
        assert shot.index == 1 and shot.total_tokens == alone.total_tokens
        for name in settings.policies:
            a, b = shot.policies[name], alone.policies[name]
            assert (a.reply, a.kl, a.kv_bytes, a.retained) == (b.reply, b.kl, b.kv_bytes, b.retained)


@pytest.mark.slow
def test_rows_per_mode_and_turn(table: pd.DataFrame) -> None:
    assert list(table.columns) == COLUMNS and table["error"].isna().all()
    assert len(table) == 2 * 2 * 3 * 3  # budgets × modes × turns × policies
    assert table.groupby("budget")["mode"].apply(lambda m: list(dict.fromkeys(m))).tolist() == [list(MODES)] * 2
    one = table[table["turn"] == 1]  # turn 1 is one run, recorded in both modes
    multi, single = (one[one["mode"] == m].drop(columns=["mode", *TIMINGS]).reset_index(drop=True) for m in MODES)
    pd.testing.assert_frame_equal(multi, single)
    multi_later = table[(table["mode"] == "multi-turn") & (table["turn"] == 3)]
    single_later = table[(table["mode"] == "single-shot") & (table["turn"] == 3)]
    # single-shot holds the context and one question; multi-turn every turn so far
    assert (single_later["total_tokens"].to_numpy() < multi_later["total_tokens"].to_numpy()).all()


def test_an_uncompressed_cache_equals_full_per_question(table: pd.DataFrame) -> None:
    big = table[(table["budget"] == 1024) & (table["mode"] == "single-shot")]
    assert (big["kl"] == 0.0).all()
    full = big[big["policy"] == "full"].set_index("turn")
    for name in ("streamingllm", "snapkv"):
        rows = big[big["policy"] == name].set_index("turn")
        assert rows["reply"].equals(full["reply"]) and rows["kv_bytes"].equals(full["kv_bytes"])
    small = table[(table["budget"] == 32) & (table["policy"] != "full")]
    assert (small["kl"] > 0).all()  # a budget below the context does compress


def test_mode_drop_and_its_figure(table: pd.DataFrame) -> None:
    drop = mode_drop(table)
    assert len(drop) == 2 * 3 * 3
    row = drop[(drop["policy"] == "streamingllm") & (drop["budget"] == 32) & (drop["turn"] == 3)].iloc[0]
    at = table[(table["policy"] == "streamingllm") & (table["budget"] == 32) & (table["turn"] == 3)].set_index("mode")
    assert row["drop"] == float(at.loc["single-shot", "correct"]) - float(at.loc["multi-turn", "correct"])
    assert row["kl_rise"] == pytest.approx(at.loc["multi-turn", "kl"] - at.loc["single-shot", "kl"])
    assert (drop[drop["turn"] == 1][["drop", "kl_rise"]] == 0).all().all()
    assert mode_drop(one_mode(table)).empty and set(one_mode(table)["mode"]) == {"multi-turn"}
    fig = modes_figure(drop, "kl")
    assert {t.name for t in fig.data} == {f"{p} {m}" for p in ("streamingllm", "snapkv") for m in MODES}


def test_modes_are_checked() -> None:
    with pytest.raises(KvlabError, match="modes"):
        ArenaSettings(modes=("one-shot",))
    with pytest.raises(KvlabError, match="modes"):
        ArenaSettings(modes=())
    assert BOTH.modes == MODES and BOTH.turns_of(CONV) == 5 and BOTH.questions_of(CONV) == 3


@pytest.mark.slow
def test_report_and_cli_show_both_modes(table: pd.DataFrame, tiny: LoadedModel, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    page = arena_report(table, BOTH, "tiny-llama", ["jars"])
    assert page.count('class="plotly-graph-div"') == 9 and "Single-shot vs multi-turn per turn" in page
    assert "mean over workloads, multi-turn" in page
    workload = tmp_path / "jars.json"
    workload.write_text(json.dumps({"name": "jars", "messages": [
        m for t in CONV.turns for m in ({"role": "user", "content": t.user},
                                       {"role": "assistant", "content": t.golden, "answer": t.answer})]}))
    monkeypatch.setattr(arena_command, "load_model", lambda *a, **k: tiny)
    out = tmp_path / "run"
    assert main(["arena", "--workload", str(workload), "--policies", "streamingllm", "--budgets", "32",
                 "--max-new-tokens", "2", "--max-turns", "2", "--modes", "single-shot,multi-turn",
                 "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["settings"]["modes"] == list(MODES) and len(data["rows"]) == 2 * 2 * 2
    assert len(data["mode_drop"]) == 2 * 2 and "kl_rise" in capsys.readouterr().out


def test_two_turns_are_flagged_equal_by_construction_and_progress_counts_what_was_asked(tiny: LoadedModel) -> None:
    two = ArenaSettings(policies=("streamingllm",), budgets=(32,), max_new_tokens=2, max_turns=2,
                        modes=("single-shot", "multi-turn"))
    seen: list[str] = []
    table = run_arena(tiny, [CONV], two, progress=lambda _, label: seen.append(label))
    assert seen == ["jars · budget 32 tokens · turn 1/2 (both modes)",
                    "jars · budget 32 tokens · single-shot re-ask 1/1 (turn 2)",
                    "jars · budget 32 tokens · turn 2/2 (multi-turn)", "done"]  # three runs, two turns asked for
    drop = mode_drop(table)
    assert not drop["modes can differ"].any() and (drop["drop"] == 0).all()
    assert "equals multi-turn by construction" in modes_note(drop)
    assert "by construction" in modes_figure(drop, "kl").layout.title.text
    assert "by construction" in arena_report(table, two, "tiny-llama", ["jars"])


def test_turns_past_two_can_differ_and_the_rest_are_shaded(table: pd.DataFrame) -> None:
    drop = mode_drop(table)
    assert drop.set_index("turn")["modes can differ"].groupby("turn").all().to_dict() == {1: False, 2: False, 3: True}
    assert modes_note(drop) is None
    fig = modes_figure(drop, "kl")
    assert len(fig.layout.shapes) == 2 and "shaded: turns 1–2" in fig.layout.title.text  # one per budget panel
