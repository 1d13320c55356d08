"""A policy that raises is shown as a failure: no score anywhere, an error on the pages, exit 1 from the CLI.

A test-only policy (``broken``) keeps the newest tokens until the conversation reaches position
``fail_from``, then raises; it runs on the tiny random Llama next to Window.
"""

from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
import torch
from page_helpers import open_page

import kvlab.cli.arena as arena_command
import kvlab.cli.chat as chat_command
import ui.common
from kvlab.cli import main
from kvlab.engine.conversion import EMBEDDED
from kvlab.engine.facts import LoadedModel
from kvlab.experiments.plan import ArenaSettings
from kvlab.experiments.report import arena_report
from kvlab.experiments.runner import run_arena
from kvlab.experiments.tables import (
    accuracy_grid,
    failure_text,
    failures,
    fidelity_vs_budget,
    memory_vs_fidelity,
    per_turn,
    results_json,
)
from kvlab.policies import LayerView, Policy
from kvlab.policies.evict import check_nans, policy_scores
from kvlab.viz.arena import memory_vs_fidelity_figure, per_turn_figure
from kvlab.viz.chat import fidelity_lines
from kvlab.workloads.chat.conversation import load_conversation
from kvlab.workloads.chat.records import TurnResult, turn_table
from kvlab.workloads.chat.replay import session_to_json
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.settings import ChatSettings

MESSAGE = "scores exploded"
CONV = [
    {"role": "user", "content": "My vault code is 27182. Please keep it in mind."},
    {"role": "assistant", "content": "Noted: your vault code is 27182."},
    {"role": "user", "content": "What is my vault code?"},
    {"role": "assistant", "content": "Your vault code is 27182.", "prefill": "Your vault code is", "answer": "27182"},
]
SHORT = Path(__file__).resolve().parents[1] / "data" / "conversations" / "cooking-questions.json"
BUDGET = 8  # below every message and reply here: every eviction asks the policy
SCORES = ("kl", "top1", "correct", "kept_tokens", "kv_kib")


@dataclass
class Broken(Policy):
    """Keeps the newest tokens like Window, and raises once its cache holds position ``fail_from``."""

    name = "broken"
    summary = "test only: fails"
    fail_from: int = 0

    def scores(self, view: LayerView) -> torch.Tensor:
        if view.positions.max() >= self.fail_from:
            raise RuntimeError(MESSAGE)
        return view.positions.float()


@pytest.fixture(autouse=True)
def broken(register_policy) -> None:
    register_policy(Broken)


@pytest.fixture
def conv_file(tmp_path: Path) -> Path:
    path = tmp_path / "vault.json"
    path.write_text(json.dumps(CONV))
    return path


def run_chat(lm: LoadedModel, policies: tuple[str, ...] = ("window", "broken"), fail_from: int = 0) -> ChatSession:
    """The policies over both turns of ``CONV`` (golden replies, so nothing long is decoded)."""
    params = {"broken": {"fail_from": fail_from}} if "broken" in policies else {}
    session = ChatSession(lm, ChatSettings(policies=policies, budget=BUDGET, max_new_tokens=2, params=params))
    session.run_turn(CONV[0]["content"], golden=CONV[1]["content"])
    session.run_turn(CONV[2]["content"], golden=CONV[3]["content"], prefill=CONV[3]["prefill"],
                     answer=CONV[3]["answer"])
    return session


def assert_no_score(turn: TurnResult) -> None:
    rec = turn.policies["broken"]
    assert rec.error == f"RuntimeError: {MESSAGE}"
    assert (rec.kl, rec.top1, rec.correct, rec.kv_bytes) == (None, None, None, None)
    assert rec.cache_tokens == [] and rec.retained == [] and rec.blocks == {} and rec.reply == ""


@pytest.fixture(scope="module")
def starts(tiny: LoadedModel) -> dict[str, int]:
    """Where turn 1's reply and turn 2 start in ``CONV``'s token stream."""
    turns = run_chat(tiny, ("window",)).turns
    return {"reply 1": turns[0].segments[1]["start"], "turn 2": turns[0].total_tokens}


@pytest.mark.slow
@pytest.mark.parametrize("failing_turn, fail_from", [
    (1, None),  # the first eviction of turn 1, before any score
    (1, "reply 1"),  # turn 1's eviction after the reply: it had been scored on that reply already
    (2, "turn 2"),  # turn 2's first eviction: turn 1 keeps its score
])
def test_a_failed_policy_has_no_score_on_its_turn_and_after(tiny: LoadedModel, starts: dict[str, int],
                                                            failing_turn: int, fail_from: str | None) -> None:
    session = run_chat(tiny, fail_from=starts[fail_from] if fail_from else 0)
    assert session.failed == {"broken": f"RuntimeError: {MESSAGE}"}
    for turn in session.turns:
        assert list(turn.policies) == ["full", "window", "broken"]  # still listed, after it failed too
        window = turn.policies["window"]
        assert window.error is None and isinstance(window.kl, float) and isinstance(window.top1, float)
        if turn.index + 1 >= failing_turn:
            assert_no_score(turn)
        else:
            assert turn.policies["broken"].error is None and isinstance(turn.policies["broken"].kl, float)
    assert session.turns[1].policies["window"].correct is not None

    table = turn_table(session.turns)
    failed = table[(table.policy == "broken") & (table.turn >= failing_turn)]
    assert len(failed) == 3 - failing_turn and failed[list(SCORES)].isna().all().all()
    assert (failed["error"] == f"RuntimeError: {MESSAGE}").all()

    rows = list(csv.DictReader(io.StringIO(table.to_csv(index=False))))
    for row in rows:
        if row["policy"] == "broken" and int(row["turn"]) >= failing_turn:
            assert all(row[k] == "" for k in SCORES) and MESSAGE in row["error"]

    data = json.loads(json.dumps(session_to_json(session)))
    for turn in data["turns"][failing_turn - 1:]:
        rec = turn["policies"]["broken"]
        assert (rec["kl"], rec["top1"], rec["correct"], rec["kv_bytes"]) == (None, None, None, None)
        assert MESSAGE in rec["error"]

    fig = fidelity_lines(table)
    broken = [t for t in fig.data if t.legendgroup == "broken"]
    assert broken[0].name == f"broken (failed on turn {failing_turn})"
    for trace in broken:  # no point with a score on a turn it had failed by
        assert all(pd.isna(y) for x, y in zip(trace.x, trace.y) if x >= failing_turn)


@pytest.mark.slow
def test_arena_rows_and_summaries_have_no_score_for_a_failed_policy(tiny: LoadedModel, starts: dict[str, int],
                                                                    conv_file: Path) -> None:
    settings = ArenaSettings(policies=("window", "broken"), budgets=(8, 16), max_new_tokens=2,
                             params={"broken": {"fail_from": starts["reply 1"]}})  # fails on turn 1's reply
    table = run_arena(tiny, [load_conversation(conv_file)], settings)
    assert len(table) == 2 * 2 * 3
    broken, window = table[table.policy == "broken"], table[table.policy == "window"]
    scores = ["correct", "kl", "top1", "kept_tokens", "compression", "kv_bytes", "kv_kib", "bytes_reserved"]
    assert broken[scores].isna().all().all() and not broken["scored"].any()
    assert (broken["error"] == f"RuntimeError: {MESSAGE}").all()
    assert window["kl"].notna().all() and window["error"].isna().all()
    # turn 1 it ran until it failed, so that turn's costs are real; from turn 2 on it ran nothing: no cost, not 0
    costs = ["shared_s", "own_s", "evict_ms", "extra_prefill_tokens", "extra_prefill_s", "past_context"]
    assert (broken[broken.turn == 1]["shared_s"] > 0).all() and broken[broken.turn > 1][costs].isna().all().all()

    error = f"RuntimeError: {MESSAGE}"
    assert failures(table).to_dict("records") == [
        {"workload": "vault", "budget": b, "policy": "broken", "turn": 1, "turns": "1, 2", "error": error,
         "alone": False,
         "text": f"broken failed on vault, budget {b}, turn 1 and was dropped (no score from then on): {error}"}
        for b in (8, 16)]
    first = next(failures(table).itertuples())
    assert failure_text(first, "**broken**") == f"**broken**{first.text.removeprefix('broken')}"  # the page's bold
    pt, summary, memory = per_turn(table), fidelity_vs_budget(table), memory_vs_fidelity(table)
    for agg in (pt, summary, memory):
        rows = agg[agg.policy == "broken"]
        assert len(rows) >= 2  # its rows are there (one per budget at least), not dropped
        assert rows[["kl", "top1", "accuracy"]].isna().all().all()  # never 0 or 1
        assert (rows["failed"] > 0).all() and (agg[agg.policy != "broken"]["failed"] == 0).all()
    assert memory[memory.policy == "broken"][["own_s", "shared_s"]].isna().all().all()
    s8 = summary.set_index(["policy", "budget"]).loc[("window", 8)]
    assert s8["kl"] == pytest.approx(window[window.budget == 8]["kl"].mean())
    grid = accuracy_grid(table)
    assert grid[grid.policy == "broken"].drop(columns=["policy", "budget"]).isna().all().all()
    data = json.loads(json.dumps(results_json(table, settings, "tiny-llama", ["vault"])))
    assert all(r["kl"] is None and r["top1"] is None and r["correct"] is None
               for r in data["rows"] if r["policy"] == "broken")

    per_turn_fig = per_turn_figure(pt, "kl")
    assert {t.name for t in per_turn_fig.data if t.legendgroup == "broken"} == {"broken (failed)"}
    assert all(pd.isna(y) for t in per_turn_fig.data if t.legendgroup == "broken" for y in t.y)
    memory_fig = memory_vs_fidelity_figure(memory)
    assert [len(t.x) for t in memory_fig.data if t.name == "broken (failed)"] == [0]
    page = arena_report(table, settings, "tiny-llama", ["vault"])
    assert "Failed policies" in page and MESSAGE in page and "closest to Full is window" in page


def test_chat_command_prints_the_error_and_exits_1(tmp_path: Path, tiny: LoadedModel, conv_file: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(chat_command, "load_model", lambda *a, **k: tiny)
    out = tmp_path / "r.json"
    code = main(["chat", "--conversation", str(conv_file), "--policies", "window,broken", "--budget", str(BUDGET),
                 "--max-new-tokens", "2", "--out", str(out)])
    assert code == 1
    printed = capsys.readouterr()
    assert "broken failed on turn 1" in printed.err and MESSAGE in printed.err
    assert [line.split()[4] for line in printed.out.splitlines() if " broken " in line] == ["FAILED"] * 2
    data = json.loads(out.read_text())  # the others' results are still written
    for turn in data["turns"]:
        assert turn["policies"]["window"]["kl"] is not None
        rec = turn["policies"]["broken"]
        assert rec["kl"] is None and rec["top1"] is None and MESSAGE in rec["error"]


@pytest.mark.slow
def test_arena_command_prints_the_error_and_exits_1(tmp_path: Path, tiny: LoadedModel, conv_file: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(arena_command, "load_model", lambda *a, **k: tiny)
    out = tmp_path / "run"
    code = main(["arena", "--workload", str(conv_file), "--policies", "window,broken", "--budgets", "8",
                 "--max-new-tokens", "2", "--max-turns", "1", "--out", str(out)])
    assert code == 1
    printed = capsys.readouterr()
    assert "broken failed on vault, budget 8, turn 1" in printed.err and MESSAGE in printed.err
    assert "FAILED, no score on the turns named (the errors are on stderr): broken at budget 8 on vault, turns 1" \
        in printed.out  # its row in the accuracy table reads "-", as an unscored one does
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [r["policy"] for r in rows] == ["full", "window", "broken"]
    assert rows[1]["kl"] != "" and all(rows[2][k] == "" for k in ("kl", "top1", "correct", "kv_bytes"))
    data = json.loads((out / "results.json").read_text())
    assert data["rows"][2]["kl"] is None and MESSAGE in data["rows"][2]["error"]
    assert MESSAGE in (out / "report.html").read_text()


@pytest.fixture
def tiny_page_model(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pages run on the tiny model: it stands in the app's model cache under the embedded model's key."""
    monkeypatch.setitem(ui.common._MODELS, (EMBEDDED, "auto", "auto", False), tiny)


@pytest.mark.usefixtures("tiny_page_model")
def test_chat_page_shows_the_error_and_goes_on() -> None:
    at = open_page("app_pages/chat.py", timeout=120)
    at.multiselect(key="chat_policies").set_value(["window", "broken"])
    at.number_input(key="chat_budget").set_value(BUDGET)
    at.number_input(key="chat_max_new").set_value(2)
    at.chat_input[0].set_value("My vault code is 27182. Please keep it in mind.").run()
    assert not at.exception
    errors = [e.value for e in at.error]
    assert len(errors) == 1 and "**broken** failed on this turn" in errors[0] and MESSAGE in errors[0]
    assert any(m.value == "**broken** · failed, no score" for m in at.markdown)
    at.chat_input[0].set_value("What is my vault code?").run()
    assert not at.exception and len(at.chat_message) == 4
    assert "**broken** failed on turn 1" in at.error[0].value
    turn = at.session_state["chat"].turns[1]
    assert turn.policies["window"].kl is not None and turn.policies["broken"].kl is None


@pytest.mark.usefixtures("tiny_page_model")
def test_arena_page_shows_the_error_next_to_the_results() -> None:
    at = open_page("app_pages/arena.py", timeout=120)
    at.multiselect(key="arena_files").set_value([SHORT])
    at.multiselect(key="arena_policies").set_value(["window", "broken"])
    at.text_input(key="arena_budgets").set_value("8")
    at.number_input(key="arena_max_new").set_value(1)
    at.number_input(key="arena_max_turns").set_value(1)
    at.button(key="arena_run").click().run()
    job = at.session_state["arena_job"]
    job.join(120)
    at.run()
    assert not at.exception and job.error is None
    assert len(at.error) == 1 and "**broken** failed on" in at.error[0].value and MESSAGE in at.error[0].value
    assert len(at.get("plotly_chart")) == 6


def test_a_single_shot_failure_is_told_as_that_question_alone_and_a_shared_turn_once() -> None:
    """A single-shot question runs alone on turn 1's caches and is rolled back: a policy failing it is asked the
    next one again and keeps its multi-turn scores, so the page must not say it was dropped. A failure on turn 1,
    whose record every mode shares, drops it from both modes and is told once."""
    def row(policy: str, mode: str, turn: int, error: str | None) -> dict:
        return {"workload": "w", "budget": 64, "mode": mode, "turn": turn, "policy": policy, "error": error}

    oracle = "KvlabError: the oracle knows only the future of its script"
    table = pd.DataFrame(
        [row("oracle", mode, 1, None) for mode in ("multi-turn", "single-shot")]
        + [row("oracle", "single-shot", t, oracle if t > 2 else None) for t in (2, 3, 4)]
        + [row("oracle", "multi-turn", t, None) for t in (2, 3, 4)]
        + [row("broken", mode, t, "RuntimeError: boom") for mode in ("multi-turn", "single-shot") for t in (1, 2)])
    got = failures(table)
    assert got[["policy", "turn", "turns"]].to_dict("records") == [
        {"policy": "oracle", "turn": 3, "turns": "3, 4"}, {"policy": "broken", "turn": 1, "turns": "1, 2"}]
    oracle_text, broken_text = got["text"][0], got["text"][1]
    assert "single-shot questions of turns 3, 4" in oracle_text and "dropped" not in oracle_text
    assert "turn 1 and was dropped (no score from then on)" in broken_text


@dataclass
class Returns(Policy):
    """Returns whatever ``scores_of`` makes of the view: a test's planted breakage."""

    name = "returns"
    summary = "test only: returns what it is given"

    def scores(self, view: LayerView) -> torch.Tensor:
        return self.scores_of(view)


@pytest.mark.parametrize("scores_of, said", [
    (lambda v: torch.full(v.positions.shape, float("nan")), "returned NaN for 6 slots where a key may be kept"),
    (lambda v: v.positions.float().masked_fill(v.positions == 1, float("nan")),
     "returned NaN for 2 slots where a key may be kept"),
    (lambda v: v.positions.float()[:, :2], "returned shape (2, 2), not one score per slot (2, 3)"),
    (lambda v: v.positions, "returned torch.int64, not a tensor of floats"),
    (lambda v: v.positions.tolist(), "returned list, not a tensor of floats"),
])
def test_scores_that_are_not_one_number_per_slot_raise_naming_the_policy(scores_of, said: str) -> None:
    policy = Returns()
    policy.scores_of = scores_of
    view = LayerView(layer=3, budget=2, positions=torch.tensor([[0, 1, 2], [0, 1, 2]]), keys=torch.zeros(2, 3, 4),
                     window_mean={}, accumulated=None, eligible=torch.ones(2, 3, dtype=torch.bool))
    nans: dict[int, torch.Tensor] = {}
    with pytest.raises(ValueError, match=rf"^returns.scores\(\) at layer 3 {re.escape(said)}"):
        policy_scores(policy, view, nans)
        check_nans(policy, nans)


def test_a_nan_score_where_no_key_may_be_kept_is_not_a_failure() -> None:
    policy = Returns()
    policy.scores_of = lambda v: v.positions.float().masked_fill(v.positions < 0, float("nan"))
    view = LayerView(layer=0, budget=1, positions=torch.tensor([[-1, 0, 1]]), keys=torch.zeros(1, 3, 4),
                     window_mean={}, accumulated=None, eligible=torch.tensor([[False, True, True]]))
    nans: dict[int, torch.Tensor] = {}
    assert policy_scores(policy, view, nans).tolist() == [[float("-inf"), 0.0, 1.0]]
    check_nans(policy, nans)
