"""The arena page under Streamlit's AppTest: a tiny background run on the embedded model, and bad input."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from page_helpers import open_page
from streamlit.testing.v1 import AppTest

from kvlab.engine.conversion import EMBEDDED
from kvlab.engine.facts import LoadedModel
from kvlab.experiments.plan import ArenaSettings
from kvlab.experiments.runner import run_arena
from kvlab.experiments.tables import results_json
from kvlab.export import to_json
from kvlab.workloads.chat.conversation import Conversation, Turn
from ui.common import cached_model

pytestmark = pytest.mark.model  # the app loads the embedded model

ROOT = Path(__file__).resolve().parents[1]
SHORT = ROOT / "data" / "conversations" / "cooking-questions.json"


def arena_app() -> AppTest:
    at = open_page("app_pages/arena.py", timeout=300)
    assert not at.exception
    return at


def set_grid(at: AppTest, policies: list[str], budgets: str, max_new: int, max_turns: int | None = None,
             files: list[Path] | None = None) -> None:
    """Fill in the grid's workloads (default: the short cooking conversation), policies, budgets and lengths."""
    at.multiselect(key="arena_files").set_value([SHORT] if files is None else files)
    at.multiselect(key="arena_policies").set_value(policies)
    at.text_input(key="arena_budgets").set_value(budgets)
    at.number_input(key="arena_max_new").set_value(max_new)
    if max_turns is not None:
        at.number_input(key="arena_max_turns").set_value(max_turns)


def test_tiny_run_completes_with_charts_and_downloads() -> None:
    at = arena_app()
    assert not at.get("plotly_chart") and "arena_job" not in at.session_state
    set_grid(at, ["streamingllm"], "16,32", 2, 1)
    at.button(key="arena_run").click().run()
    assert not at.exception and not at.error
    job = at.session_state["arena_job"]
    job.join(240)
    assert not job.running and job.error is None and (job.done, job.total) == (2, 2)
    at.run()
    assert not at.exception and not at.error
    assert len(at.get("plotly_chart")) == 6  # the 4 tabs' charts, the seed table and its headroom
    banner = next(s.value for s in at.success if "turns ×" in s.value)
    assert banner.startswith("2 turns × 2 policies in") and banner.endswith("at 2 budget settings."), banner
    grid = at.main.dataframe[0].value
    assert list(grid["policy"]) == ["full", "full", "streamingllm", "streamingllm"]
    assert list(grid["budget"]) == [16, 32, 16, 32]
    # no answer to check in this workload: its fidelity and no empty accuracy columns; one turn a cell: a KL of one
    # case has no interval (not one of no width), and a column of none is left out, the caption saying why
    assert list(grid.columns) == ["policy", "budget", "kl", "top1"]
    assert any("none of one turn" in c.value for c in at.caption)
    assert len(at.main.get("download_button")) == 3  # the sidebar holds the figures zip
    assert any("has an answer to check" in c.value for c in at.caption)
    assert at.radio(key="arena_metric").value == "kl"  # nothing to score here, so KL is shown first
    assert not any("rows are the same at every budget" in c.value for c in at.caption)  # streamingllm evicts
    at.radio(key="arena_metric").set_value("top1").run()
    assert not at.exception and len(at.get("plotly_chart")) == 6


def test_both_modes_draw_the_drop_chart_and_table() -> None:
    at = arena_app()
    set_grid(at, ["streamingllm"], "16", 2, 2)
    at.multiselect(key="arena_modes").set_value(["multi-turn", "single-shot"])
    at.button(key="arena_run").click().run()
    assert not at.exception and not at.error
    job = at.session_state["arena_job"]
    job.join(240)
    assert not job.running and job.error is None and (job.done, job.total) == (3, 3)  # turn 1 runs once
    at.run()
    assert not at.exception and not at.error
    assert "Single-shot vs multi-turn" in [h.value for h in at.subheader]
    assert len(at.get("plotly_chart")) == 7  # the modes chart, the four tabs' charts, the seed table, headroom
    drop = at.main.dataframe[1].value
    assert sorted(drop["turn"]) == [1, 1, 2, 2] and (drop[drop["turn"] == 1]["kl_rise"] == 0).all()
    # two turns cannot differ between the modes: the table, the chart and the page say so
    assert not drop["modes can differ"].any()
    assert any("equals multi-turn by construction" in w.value for w in at.warning)


def test_two_local_ray_workers_draw_the_in_process_charts() -> None:
    at = arena_app()
    set_grid(at, ["streamingllm"], "16,32", 2, 1)
    drawn, threads = {}, torch.get_num_threads()
    for where in ("this process", "local Ray workers"):
        at.radio(key="arena_run_on").set_value(where).run()
        # each worker runs one torch thread; so does this process here: then float32 sums add up in the same
        # order and the numbers match bit for bit (with more threads they differ in the last bits)
        torch.set_num_threads(1)
        try:
            at.button(key="arena_run").click().run()
            assert not at.exception and not at.error
            job = at.session_state["arena_job"]
            job.join(600)
        finally:
            torch.set_num_threads(threads)
        assert not job.running and job.error is None and (job.done, job.total) == (2, 2)
        at.run()
        assert not at.exception and not at.error
        drawn[where] = ([chart.proto.spec for chart in at.get("plotly_chart")], at.main.dataframe[0].value)
    (charts, grid), (ray_charts, ray_grid) = drawn.values()
    assert at.number_input(key="arena_workers").value == 2 and job.plan.workers == 2
    assert len(charts) == 6 and ray_charts == charts  # the same figures, number for number
    assert ray_grid.equals(grid)


def test_cancel_button_stops_the_turn_in_progress() -> None:
    at = arena_app()
    lm = cached_model(EMBEDDED, "auto", "auto", False, None)  # the page's cached model (a cache hit)
    at.multiselect(key="arena_files").set_value([SHORT])
    at.multiselect(key="arena_policies").set_value(["window"])
    at.text_input(key="arena_budgets").set_value("8")
    at.number_input(key="arena_max_new").set_value(1)
    at.number_input(key="arena_max_turns").set_value(1)
    at.button(key="arena_run").click().run()  # a run that finishes: its results stay through the next one's cancel
    first = at.session_state["arena_job"]
    first.join(240)
    at.number_input(key="arena_max_turns").set_value(0).run()
    with lm.lock:  # the job blocks in its first forward, so Cancel lands during turn 1
        at.button(key="arena_run").click().run()
        job = at.session_state["arena_job"]
        assert job.running and job.total == 6
        time.sleep(3)  # let the job pass its before-turn cancel check and block in turn 1's first forward
        at.button(key="arena_cancel").click().run()
        assert not at.exception
    job.join(240)
    at.run()
    # the turn in progress stops at its next check (issue 13: within seconds, not at the turn's end)
    assert not at.exception and job.cancelled and job.done == 0
    assert at.warning[0].value == ("Cancelled after 0 of 6 turns: no turn finished, so this run has no results; below "
                                   "are the results of the run before it.")
    assert first.done == 1 and any(s.value.startswith("1 turn × ") for s in at.success)  # the first run drawn


def test_bad_input_shows_an_error_and_keeps_the_page() -> None:
    at = arena_app()
    at.text_input(key="arena_budgets").set_value("64,lots")
    at.button(key="arena_run").click().run()
    assert not at.exception and "comma-separated whole numbers" in at.error[0].value
    at.text_input(key="arena_budgets").set_value("64")
    at.multiselect(key="arena_files").set_value([])
    at.button(key="arena_run").click().run()
    assert not at.exception and "at least one workload" in at.error[0].value
    assert "arena_job" not in at.session_state
    for key, value, words in (("arena_max_new", 2000,
                               "reply tokens (max new tokens) must be between 1 and 1024, not 2000"),
                              ("arena_block", 0, "block size must be between 1 and 4,096 tokens, not 0"),
                              ("arena_max_turns", -2, "turns per workload must be 0 (all) or more, not -2")):
        at = arena_app()
        at.number_input(key=key).set_value(value)
        at.button(key="arena_run").click().run()
        assert not at.exception and words in at.error[0].value and at.number_input(key=key).value == value
        assert "arena_job" not in at.session_state
    for key, value, words in (("arena_ruler_length", 100, "length 100 is outside what kvlab generates"),
                              ("arena_ruler_samples", 0, "samples must be between 1 and 1000, not 0"),
                              ("arena_ruler_questions", -1, "questions must be between 1 and 64")):
        at = arena_app()  # a RULER field out of range is refused in words, not kept silently at its last valid value
        at.multiselect(key="arena_ruler_tasks").set_value(["niah_single_1"])
        at.number_input(key=key).set_value(value)
        at.button(key="arena_run").click().run()
        assert not at.exception and words in at.error[0].value and at.number_input(key=key).value == value
        assert "arena_job" not in at.session_state


def test_the_current_chat_runs_as_a_workload() -> None:
    at = open_page("app_pages/chat.py", timeout=300)
    at.multiselect(key="chat_policies").set_value(["window"])
    at.number_input(key="chat_budget").set_value(16)
    at.number_input(key="chat_max_new").set_value(3)
    at.chat_input[0].set_value("My locker code is 3141. Please remember it.").run()
    assert not at.exception
    chat_turn = at.session_state["chat"].turns[0]
    at.switch_page("app_pages/arena.py").run()
    assert not at.exception and not at.checkbox(key="arena_use_chat").disabled
    at.multiselect(key="arena_files").set_value([])
    at.checkbox(key="arena_use_chat").check()
    at.multiselect(key="arena_policies").set_value(["window"])
    at.text_input(key="arena_budgets").set_value("16")
    at.number_input(key="arena_max_new").set_value(3)
    at.button(key="arena_run").click().run()
    assert not at.exception and not at.error
    job = at.session_state["arena_job"]
    job.join(240)
    assert job.error is None and (job.done, job.total) == (1, 1)
    at.run()
    grid = job.table
    assert set(grid["workload"]) == {"current-chat"}
    assert grid[grid.policy == "window"]["kl"].iloc[0] == pytest.approx(chat_turn.policies["window"].kl, abs=1e-5)


def test_a_budget_in_mib_runs_each_policy_at_its_own_tokens_and_a_bad_one_is_refused() -> None:
    at = arena_app()
    at.radio(key="arena_budget_unit").set_value("mib")
    set_grid(at, ["streamingllm", "kivi"], "0.001", 2, 1)  # less than one token of K/V
    at.button(key="arena_run").click().run()
    assert "arena_job" not in at.session_state
    assert any("does not hold its minimum budget" in e.value for e in at.error), [e.value for e in at.error]
    at.text_input(key="arena_budgets").set_value("10")
    at.run()
    at.selectbox(key="arena_kivi_evict_with").set_value("streamingllm")
    at.button(key="arena_run").click().run()
    assert not at.exception and not at.error
    job = at.session_state["arena_job"]
    job.join(240)
    assert not job.running and job.error is None
    rows = job.table.set_index("policy")
    assert rows.loc["kivi", "budget_tokens"] > rows.loc["streamingllm", "budget_tokens"]  # 2 bits hold more
    assert (job.table["budget"] == 10).all()
    at.run()
    assert not at.exception and not at.error


def test_an_scbench_upload_and_generated_ruler_tasks_reach_the_grid_and_a_bad_file_is_refused() -> None:
    at = arena_app()
    record = {"id": 4, "context": "The boat key number is 6613. The shed code is 2290.",
              "multi_turns": [{"input": "What is the boat key number?", "answer": "6613"},
                              {"input": "What is the shed code?", "answer": "2290"}]}
    bad = json.dumps({**record, "multi_turns": [{"input": "q"}]}) + "\n"
    at.multiselect(key="arena_files").set_value([])
    at.file_uploader(key="arena_upload").set_value(("scbench_kv.jsonl", bad.encode(), "application/jsonl")).run()
    at.button(key="arena_run").click().run()
    assert not at.exception and "multi_turns[0] has no 'answer'" in at.error[0].value
    assert "arena_job" not in at.session_state
    good = json.dumps(record) + "\n"
    at.file_uploader(key="arena_upload").set_value(("scbench_kv.jsonl", good.encode(), "application/jsonl"))
    at.multiselect(key="arena_ruler_tasks").set_value(["niah_single_1"])
    at.number_input(key="arena_ruler_length").set_value(512)
    at.number_input(key="arena_ruler_samples").set_value(1)
    set_grid(at, ["streamingllm"], "16", 2, files=[])
    at.button(key="arena_run").click().run()
    assert not at.exception and not at.error
    job = at.session_state["arena_job"]  # the grid got both workloads; running them is the other tests' job
    job.cancel()
    job.join(600)
    names = [c.name for c in job.conversations]
    assert names == ["scbench_kv-4", "niah_single_1-512-s0-0"]
    assert [t.metric for c in job.conversations for t in c.turns] == ["contains"] * 3
    # 2 reply tokens cannot say niah's 7-digit number: said before the grid, not found as 0 % after it
    assert any(w.value.startswith("Replies are cut at 2 tokens, but ") and "niah_single_1-512-s0-0, turn 1" in w.value
               for w in at.warning), [w.value for w in at.warning]


def test_a_single_query_ruler_task_asks_as_many_questions_as_set_one_per_turn() -> None:
    """The multi-turn variant of niah_multikey_1 had one turn from the page (the CLI's --questions had no widget)."""
    at = arena_app()
    at.multiselect(key="arena_ruler_tasks").set_value(["niah_multikey_1"])
    at.number_input(key="arena_ruler_length").set_value(1024)
    at.number_input(key="arena_ruler_samples").set_value(1)
    at.number_input(key="arena_ruler_questions").set_value(3)
    at.checkbox(key="arena_ruler_multi").check()
    set_grid(at, ["streamingllm"], "16", 2, files=[])
    at.button(key="arena_run").click().run()
    assert not at.exception and not at.error
    job = at.session_state["arena_job"]
    job.cancel()
    job.join(600)
    assert [len(c.turns) for c in job.conversations] == [3]
    at.run()  # the finished job's page: Run is enabled again
    # a task with no multi-turn variant runs as RULER's own one-turn task beside the others, and the page says so
    at.multiselect(key="arena_ruler_tasks").set_value(["niah_multikey_1", "cwe"])
    at.button(key="arena_run").click().run()
    assert not at.exception and not at.error
    job = at.session_state["arena_job"]
    job.cancel()
    job.join(600)
    assert [len(c.turns) for c in job.conversations] == [3, 1]
    assert any(i.value == "cwe asks one question, so it runs as RULER's one-turn task beside the multi-turn variants."
               for i in at.info), [i.value for i in at.info]


def test_a_saved_run_opens_at_once_from_its_file(tiny: LoadedModel) -> None:
    conv = Conversation("vault", "two questions", None, (
        Turn("The vault code is 4127.", golden="Noted.", answer=None),
        Turn("What is the vault code?", prefill="The vault code is", answer="4127")))
    settings = ArenaSettings(policies=("streamingllm", "kivi"), budgets=(8, 16), max_new_tokens=2,
                             params={"kivi": {"group_size": 16, "residual": 16}})  # the tiny model's heads: 16
    table = run_arena(tiny, [conv], settings)
    data = to_json(results_json(table, settings, "tiny-llama", ["vault"])).encode()
    at = arena_app()
    at.file_uploader(key="arena_open").set_value(("kvlab-arena.json", data, "application/json")).run()
    assert not at.exception and not at.error
    assert any("Opened from a file, no model run" in i.value and "model tiny-llama" in i.value
               and "workloads vault" in i.value for i in at.info)
    assert len(at.get("plotly_chart")) >= 5 and "arena_job" not in at.session_state  # nothing ran
    rows = next(d.value for d in at.main.dataframe if "kv_kib" in d.value and len(d.value) == len(table))
    assert list(rows["policy"]) == list(table["policy"])
    # kivi on full keeps every token: its rows cannot move with the budget, and the budget tab says why
    said = "kivi (evict_with=full): no budget changes what it keeps or reads"
    assert any(c.value.startswith(said) for c in at.caption)
    at.file_uploader(key="arena_open").set_value(("cut.json", data[:80], "application/json")).run()
    assert any("not valid JSON (line" in e.value for e in at.error) and not at.exception


def test_a_saved_run_replays_on_its_page_and_says_whether_every_row_matches(model: LoadedModel) -> None:
    conv = Conversation("vault", "two questions", None, (
        Turn("The vault code is 4127.", golden="Noted.", answer=None),
        Turn("What is the vault code?", golden="The vault code is 4127.", prefill="The vault code is",
             answer="4127")))
    settings = ArenaSettings(policies=("streamingllm",), budgets=(8,), max_new_tokens=2)
    table = run_arena(model, [conv], settings)
    saved = json.loads(to_json(results_json(table, settings, model.facts.name, ["vault"], conversations=[conv])))
    at = arena_app()
    for tampered in (False, True):
        if tampered:
            saved["rows"][-1]["kl"] += 0.25
        raw = json.dumps(saved).encode()
        at.file_uploader(key="arena_open").set_value((f"run-{tampered}.json", raw, "application/json")).run()
        assert any("Opened from a file" in i.value for i in at.info)
        at.button(key="arena_replay_button").click().run()
        job = at.session_state["arena_job"]
        job.join(240)
        assert job.error is None and job.conversations == [conv]
        at.run()
        assert not at.exception
        if tampered:
            assert any("differs from the file" in w.value and "turn 2 · policy streamingllm.kl" in w.value
                       for w in at.warning)
        else:
            assert any("Replay identical" in s.value for s in at.success) and not at.warning
    saved.pop("conversations")
    at.file_uploader(key="arena_open").set_value(("old.json", json.dumps(saved).encode(), "application/json")).run()
    assert any("cannot be replayed" in c.value for c in at.caption)
    assert "arena_replay_button" not in [b.key for b in at.button]


def test_a_tick_for_a_chat_since_cleared_does_not_stay_on_greyed_out() -> None:
    at = arena_app()
    at.session_state["arena_use_chat"] = True  # as a tick made while a chat existed leaves it
    at.run()
    box = at.checkbox(key="arena_use_chat")
    assert not at.exception and box.disabled and not box.value
