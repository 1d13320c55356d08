"""The policy arena: a tiny grid on the embedded model, cancelling, the HTML report and the CLI."""

from __future__ import annotations

import json
import re
import threading
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

import kvlab.cli.arena as arena_command
from kvlab import __version__
from kvlab.cli import main
from kvlab.cli.interrupt import INTERRUPTED
from kvlab.engine.facts import LoadedModel
from kvlab.errors import KvlabError
from kvlab.experiments.job import ArenaJob
from kvlab.experiments.plan import ArenaSettings, parse_budgets
from kvlab.experiments.report import arena_report
from kvlab.experiments.runner import COLUMNS, run_arena, run_cell
from kvlab.experiments.tables import accuracy_grid, after_turn_one, fidelity_vs_budget, memory_vs_fidelity, per_turn
from kvlab.saved import UNKNOWN, stamp_of
from kvlab.workloads.chat.conversation import Conversation, Turn, load_conversation, short_replies
from kvlab.workloads.chat.metrics import shortest_answer
from kvlab.workloads.chat.replay import session_conversation
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.settings import ChatSettings

WORKLOAD = Path(__file__).resolve().parents[1] / "data" / "retrieval" / "community-garden.json"
SETTINGS = ArenaSettings(policies=("streamingllm",), budgets=(128, 64), max_new_tokens=6, max_turns=2)


@pytest.fixture(scope="module")
def short_workload(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The retrieval session with its newsletter cut to ~220 tokens: the grid costs a fifth."""
    data = json.loads(WORKLOAD.read_text())
    first = data["messages"][0]
    question = first["content"].rsplit("\n\n", 1)[1]
    first["content"] = first["content"][:800] + "\n\n" + question
    path = tmp_path_factory.mktemp("arena") / "community-garden.json"
    path.write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module")
def grid(model: LoadedModel, short_workload: Path) -> pd.DataFrame:
    """Full and StreamingLLM at budgets 64 and 128 over the first two turns of a retrieval session."""
    seen: list[tuple[float, str]] = []
    table = run_arena(model, [load_conversation(short_workload)], SETTINGS, progress=lambda *a: seen.append(a))
    assert seen[0] == (0.0, "community-garden · budget 64 tokens · turn 1/2")
    assert [fraction for fraction, _ in seen] == [0.0, 0.25, 0.5, 0.75, 1.0]  # 4 turns in the grid
    assert seen[-1] == (1.0, "done")
    return table


@pytest.mark.model
def test_one_row_per_budget_turn_and_policy(grid: pd.DataFrame) -> None:
    assert list(grid.columns) == COLUMNS
    assert len(grid) == 2 * 2 * 2
    keys = grid[["budget", "turn", "policy"]].apply(tuple, axis=1).tolist()
    assert keys == [(b, t, p) for b in (64, 128) for t in (1, 2) for p in ("full", "streamingllm")]
    assert set(grid["workload"]) == {"community-garden"} and grid["scored"].all()
    assert grid["error"].isna().all()


@pytest.mark.model
def test_full_is_the_exact_reference(grid: pd.DataFrame) -> None:
    full = grid[grid["policy"] == "full"]
    assert (full["kl"] == 0.0).all() and (full["top1"] == 1.0).all()
    assert (full["kept_tokens"] == full["total_tokens"]).all() and (full["compression"] == 1.0).all()
    # Full does not depend on the budget: both sessions give it the same record
    a, b = (full[full["budget"] == x].reset_index() for x in (64, 128))
    assert a["reply"].tolist() == b["reply"].tolist() and a["kv_bytes"].tolist() == b["kv_bytes"].tolist()


@pytest.mark.model
def test_budgets_hold_and_larger_budgets_keep_more(grid: pd.DataFrame, model: LoadedModel) -> None:
    s = grid[grid["policy"] == "streamingllm"]
    assert (s["kept_tokens"] == s["budget"]).all()  # a uniform budget per layer, once the text is longer
    assert (s["compression"] == s["budget"] / s["total_tokens"]).all()
    f = model.facts
    assert (s["kv_bytes"] == s["budget"] * f.n_layers * f.n_kv_heads * 2 * f.head_dim * f.bytes_per_element).all()
    assert (grid["bytes_reserved"] >= grid["kv_bytes"]).all()  # whole blocks hold at least the kept tokens
    kept = grid.pivot_table(index=["turn", "policy"], columns="budget", values="kept_tokens")
    assert (kept[128] >= kept[64]).all()
    assert (s["kl"] > 0).all()


@pytest.mark.model
def test_summary_tables(grid: pd.DataFrame, model: LoadedModel) -> None:
    pt = per_turn(grid)
    assert len(pt) == 8 and set(pt["workloads"]) == {1}
    full = grid[grid["policy"] == "full"]
    assert pt[pt["policy"] == "full"]["accuracy"].tolist() == full["correct"].astype(float).tolist()
    summary = fidelity_vs_budget(grid)
    row = summary[(summary["policy"] == "streamingllm") & (summary["budget"] == 64)].iloc[0]
    s64 = grid[(grid["policy"] == "streamingllm") & (grid["budget"] == 64)]
    assert row["kl"] == pytest.approx(s64["kl"].mean(), abs=0)
    assert row["accuracy_turn1"] == float(s64["correct"].iloc[0])
    assert row["accuracy_later"] == float(s64["correct"].iloc[1])
    memory = memory_vs_fidelity(grid).set_index(["policy", "budget"])
    f = model.facts
    per_token = f.n_layers * f.n_kv_heads * 2 * f.head_dim * f.bytes_per_element  # × (K, V)
    assert memory.loc[("streamingllm", 128), "kv_kib"] == 128 * per_token / 1024
    assert memory.loc[("streamingllm", 64), "compression"] == pytest.approx(s64["compression"].mean())
    wide = accuracy_grid(grid)
    assert list(wide.columns) == ["policy", "budget", "turn 1", "turn 2", "all turns", "n", "all turns 95 %", "kl",
                                  "kl 95 %", "top1"]


def test_turn_one_findings_in_words() -> None:
    summary = pd.DataFrame({"policy": ["full", "snapkv", "h2o", "tova"], "budget": [64, 64, 64, 64],
                            "accuracy_turn1": [1.0, 0.5, 0.25, float("nan")],
                            "accuracy_later": [0.5, 0.0, 0.25, 0.5]})
    assert after_turn_one(summary) == ["snapkv at 64: falls from 50% on turn 1 to 0% after"]


@pytest.mark.model
def test_html_report_is_self_contained(grid: pd.DataFrame) -> None:
    page = arena_report(grid, SETTINGS, "SmolLM2-135M-Instruct", ["community-garden"])
    assert page.count("plotly.js v") == 1  # the library inline, once
    assert not re.search(r"<script[^>]+src=", page)
    assert "<link" not in page
    assert page.count('class="plotly-graph-div"') == 7  # the seed's table and its headroom chart last
    assert "The seed's table, measured" in page
    assert "Accuracy per turn per policy and budget" in page and "community-garden" in page
    empty = arena_report(grid.iloc[:0], SETTINGS, "m", ["w"], cancelled=True)
    assert "cancelled" in empty and "plotly.js" not in empty


@pytest.mark.slow
def test_cancel_stops_between_turns(tiny: LoadedModel) -> None:
    conv = load_conversation(WORKLOAD)
    cancel = threading.Event()

    def progress(fraction: float, label: str) -> None:
        if fraction > 0:  # the first turn has finished
            cancel.set()

    table = run_arena(tiny, [conv], SETTINGS, cancel=cancel, progress=progress)
    assert table[["budget", "turn"]].drop_duplicates().values.tolist() == [[64, 1]]
    assert len(table) == 2

    job = ArenaJob(tiny, [conv], SETTINGS)
    job.cancel()
    job.start().join(60)
    assert not job.running and job.cancelled and job.error is None and job.table.empty


@pytest.mark.slow
def test_cancel_stops_inside_a_turn(tiny: LoadedModel) -> None:
    """Cancel set between two forwards of a turn stops it before the next: the turn in progress is dropped,
    the finished ones stay."""
    conv = load_conversation(WORKLOAD)
    two = ArenaSettings(policies=("window",), budgets=(32,), max_new_tokens=64, max_turns=2)
    cancel = threading.Event()
    turn, forwards = [0], [0]  # the cell's turn now running; turn 2's forwards finished so far
    last = tiny.model.get_decoder().layers[-1]

    def on_turn(step: int) -> None:
        turn[0] = step

    def count(*_: object) -> None:
        if turn[0] == 1:
            forwards[0] += 1
            if forwards[0] == 6:
                cancel.set()

    hook = last.register_forward_hook(count)
    try:
        rows = run_cell(tiny, conv, 32, two, cancel=cancel, on_turn=on_turn)
    finally:
        hook.remove()
    assert {r["turn"] for r in rows} == {1} and forwards == [6]  # the sixth forward of turn 2 was its last


def test_cancel_stops_a_prefill_before_its_next_decoder_layer(tiny: LoadedModel) -> None:
    """The arena's Cancel does not wait for a forward to end: set during turn 2's first forward, no later
    decoder layer runs, and the cell keeps turn 1's rows only."""
    conv = load_conversation(WORKLOAD)
    two = ArenaSettings(policies=("window",), budgets=(32,), max_new_tokens=8, max_turns=2)
    cancel = threading.Event()
    armed, later_calls = [False], [0]
    layers = tiny.model.get_decoder().layers

    def arm(step: int) -> None:
        armed[0] = step == 1

    def cancel_in_layer_1(*_: object) -> None:
        if armed[0]:
            cancel.set()

    def count_later(*_: object) -> None:
        if cancel.is_set():
            later_calls[0] += 1

    hooks = [layers[1].register_forward_hook(cancel_in_layer_1)]
    hooks += [layer.register_forward_hook(count_later) for layer in layers[2:]]
    try:
        rows = run_cell(tiny, conv, 32, two, cancel=cancel, on_turn=arm)
    finally:
        for hook in hooks:
            hook.remove()
    assert cancel.is_set() and later_calls == [0]
    assert {r["turn"] for r in rows} == {1}


def test_job_runs_in_the_background(tiny: LoadedModel) -> None:
    conv = load_conversation(WORKLOAD)
    settings = ArenaSettings(policies=("window",), budgets=(32,), max_new_tokens=2, max_turns=1)
    job = ArenaJob(tiny, [conv], settings).start()
    job.join(120)
    assert not job.running and job.error is None and not job.cancelled
    assert (job.done, job.total) == (1, 1) and len(job.table) == 2


@pytest.mark.parametrize("kwargs, message", [
    ({"budgets": ()}, "at least one budget"),
    ({"budgets": (0, 64)}, "at least 1 token"),
    ({"budgets": (64.5,)}, "whole numbers"),
    ({"policies": ("lru",)}, "unknown policy"),
    ({"policies": ("streamingllm",), "budgets": (2,)}, "below its minimum"),
    ({"max_turns": 0}, "max turns"),
    ({"max_new_tokens": 0}, "max new tokens"),
    # a walk's budgets: said as typed, once each, without Python's brackets or a float's ".0"
    ({"budgets": (64, 64, 128)}, "give each budget once: 64 is given more than once"),
    ({"budgets": (50, 150.0, 0), "budget_unit": "percent"}, "at most 100, not 0, 150"),
    ({"budgets": (-1.0, 2.0), "budget_unit": "mib"}, "more than 0 MiB, not -1"),
])
def test_bad_settings_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(KvlabError, match=message):
        ArenaSettings(**kwargs)


def test_a_policy_no_budget_reaches_is_named_with_what_makes_it_so() -> None:
    grid = ArenaSettings(policies=("kivi", "quest", "snapkv", "adakv", "duoattention"), budgets=(32, 64))
    # quest reads fewer pages at a smaller budget; duoattention's heads keep sizes of their own; full is the reference
    assert grid.budget_blind() == ["kivi", "duoattention"]
    assert grid.budget_blind_note() == ("kivi (evict_with=full), duoattention: no budget changes what they keep or "
                                        "read, so their rows are the same at every budget.")
    assert ArenaSettings(policies=("kivi",), params={"kivi": {"evict_with": "snapkv"}}).budget_blind() == []
    assert ArenaSettings(policies=("kivi",), budgets=(64,)).budget_blind_note() is None  # one budget: no comparison


def test_parse_budgets() -> None:
    assert parse_budgets(" 64, 128 ,256,") == (64, 128, 256)
    assert parse_budgets("12.5%, 25 %", "percent") == (12.5, 25)
    for bad in ("", "64;128", "many", "16,,32", ",,"):
        with pytest.raises(KvlabError):
            parse_budgets(bad)


def test_budget_beyond_the_context_is_refused_before_running(tiny: LoadedModel) -> None:
    with pytest.raises(KvlabError, match="exceeds the model's context of 2048"):
        run_arena(tiny, [load_conversation(WORKLOAD)], ArenaSettings(budgets=(64, 4096)))


def test_replies_cut_shorter_than_an_answer_are_warned_of_before_the_grid_runs(tiny: LoadedModel) -> None:
    conv = load_conversation(WORKLOAD)
    answers = [t.answer for t in conv.turns if t.answer is not None]
    longest = max(len(tiny.encode(" " + shortest_answer(a))) for a in answers)
    said = short_replies(tiny.encode, [conv], longest - 1)
    assert said.startswith(f"Replies are cut at {longest - 1} tokens, but ") and f": {longest} tokens)" in said
    assert f"of the {len(answers)} scored turns" in said and "Full included" in said
    assert short_replies(tiny.encode, [conv], longest) is None
    one = Turn("What is the code?", answer="4127 9981 2231")  # one scored turn: said as one
    assert "but the one scored turn needs more" in short_replies(tiny.encode, [replace(conv, turns=(one,))], 1)


def test_the_shortest_right_answer_of_each_metric() -> None:
    assert shortest_answer("4127\nMiso", "contains") == "4127 Miso"  # every reference
    assert shortest_answer("the harbour\nharbour", "contains_any") == "harbour"  # the shortest one
    assert shortest_answer("Pass key 71432.", "first_number") == "71432"
    assert shortest_answer("B\nIvo", "option") == "B"


@pytest.mark.slow
def test_cli_writes_csv_json_and_html(tmp_path: Path, tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(arena_command, "load_model", lambda *a, **k: tiny)
    out = tmp_path / "run"
    code = main(["arena", "--workload", str(WORKLOAD), "--policies", "streamingllm,snapkv", "--budgets", "32,64",
                 "--max-new-tokens", "2", "--max-turns", "1", "--out", str(out)])
    assert code == 0
    table = pd.read_csv(out / "results.csv")
    assert len(table) == 2 * 3 and set(table["policy"]) == {"full", "streamingllm", "snapkv"}
    data = json.loads((out / "results.json").read_text())
    assert data["kvlab_arena"] == 1 and data["settings"]["budgets"] == [32, 64] and len(data["rows"]) == 6
    assert data["model"] == "tiny-llama" and data["workloads"] == ["community-garden"]
    assert stamp_of(data).kvlab_version == __version__ and stamp_of(data).saved_at != UNKNOWN
    assert (out / "report.html").read_text().count("plotly.js v") == 1
    seeds = pd.read_csv(out / "seed_table.csv")
    assert seeds.loc[seeds["family"] == "window / sink", "budget"].tolist() == [32, 64]
    assert seeds.loc[seeds["family"] == "pyramid", "multi-turn"].tolist() == ["not run (pyramidkv)"] * 2
    printed = capsys.readouterr().out
    assert "The seed's table, measured." in printed
    assert "importance scoring (h2o, snapkv, tova, knorm) at budget 64:" in printed
    # a family none of whose policies ran is named once, not printed as blocks of "not run" (the CSV keeps them)
    assert "pyramid (pyramidkv) at budget" not in printed and "not run (pyramidkv)" not in printed
    assert "Not run here (no policy of theirs in --policies): " in printed and "pyramid" in printed
    assert "wrote" in printed and "seed_table.csv" in printed


def test_a_cli_run_stopped_before_any_turn_writes_nothing_over_an_earlier_run(
        tmp_path: Path, tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    real = arena_command.run_arena

    def stopped_at_once(lm, conversations, settings, cancel, progress):  # Ctrl-C before the first turn ended
        cancel.set()
        return real(lm, conversations, settings, cancel=cancel, progress=progress)

    monkeypatch.setattr(arena_command, "load_model", lambda *a, **k: tiny)
    monkeypatch.setattr(arena_command, "run_arena", stopped_at_once)
    out = tmp_path / "run"
    out.mkdir()
    earlier = {"seed_table.csv": "family,policies,budget\nwindow / sink,streamingllm,32\n", "results.csv": "turn\n1\n"}
    for name, text in earlier.items():  # a run before
        (out / name).write_text(text)
    assert main(["arena", "--workload", str(WORKLOAD), "--policies", "h2o", "--budgets", "48", "--max-new-tokens",
                 "2", "--out", str(out)]) == INTERRUPTED
    # nothing finished, so nothing is written: the earlier run's files are neither replaced by empty ones nor lost
    assert {p.name: p.read_text() for p in out.iterdir()} == earlier
    err = capsys.readouterr().err
    assert "0 rows from the 0 turns that finished" in err and "nothing was written" in err


def test_a_cli_run_stopped_midway_says_so_above_its_tables(tmp_path: Path, tiny: LoadedModel,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture) -> None:
    real = arena_command.run_arena

    def stopped_after_a_turn(lm, conversations, settings, cancel, progress):  # Ctrl-C during the second turn
        def reported(fraction: float, message: str) -> None:
            progress(fraction, message)
            if fraction > 0:  # a turn has finished
                cancel.set()
        return real(lm, conversations, settings, cancel=cancel, progress=reported)

    monkeypatch.setattr(arena_command, "load_model", lambda *a, **k: tiny)
    monkeypatch.setattr(arena_command, "run_arena", stopped_after_a_turn)
    assert main(["arena", "--workload", str(WORKLOAD), "--policies", "h2o", "--budgets", "48", "--max-new-tokens",
                 "2", "--out", str(tmp_path / "run")]) == INTERRUPTED
    out = capsys.readouterr().out
    assert out.index("Cut short: the tables below hold the 1 turn that finished") < out.index("Accuracy")
    assert json.loads((tmp_path / "run" / "results.json").read_text())["cancelled"] is True


@pytest.mark.slow
def test_cli_replays_a_saved_run_and_names_a_row_that_differs(tmp_path: Path, tiny: LoadedModel,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(arena_command, "load_model", lambda *a, **k: tiny)
    first = tmp_path / "first"
    assert main(["arena", "--workload", str(WORKLOAD), "--policies", "snapkv", "--budgets", "32", "--max-new-tokens",
                 "2", "--max-turns", "2", "--modes", "multi-turn,single-shot", "--out", str(first)]) == 0
    saved = first / "results.json"
    data = json.loads(saved.read_text())
    assert data["conversations"][0]["name"] == "community-garden"
    capsys.readouterr()
    # the replay takes its grid from the file: the options given here are ignored
    assert main(["arena", "--replay", str(saved), "--policies", "h2o", "--out", str(tmp_path / "again")]) == 0
    assert f"every row equals {saved}'s" in capsys.readouterr().out
    row = next(r for r in data["rows"] if r["policy"] == "snapkv" and r["turn"] == 2 and r["mode"] == "single-shot")
    row["kl"] += 0.5
    data["rows"].reverse()  # rows are matched by their coordinates, not their order
    saved.write_text(json.dumps(data))
    before = saved.read_bytes()
    assert main(["arena", "--replay", str(saved), "--out", str(first)]) == 2  # never over the evidence
    assert (f"--out {first} would write results.json, which is the file being replayed itself"
            in capsys.readouterr().err and saved.read_bytes() == before)
    assert main(["arena", "--replay", str(saved)]) == 1  # a check alone: no --out, no files
    out = capsys.readouterr()
    assert "wrote" not in out.out and sorted(p.name for p in tmp_path.iterdir()) == ["again", "first"]
    err = out.err
    assert "kvlab: error: the replay on" in err and "differs from" in err
    assert "workload community-garden · budget 32 · mode single-shot · turn 2 · policy snapkv.kl:" in err
    assert err.count("\n  ") == 1  # that row's KL and nothing else
    # a cancelled run's file: a replay of the whole grid would differ in every row it never reached (a walk read
    # 24 lines of "only in the re-run" and no word of why)
    saved.write_text(json.dumps({**data, "cancelled": True}))
    assert main(["arena", "--replay", str(saved)]) == 2
    assert "cannot be replayed: it was cancelled before its grid finished" in capsys.readouterr().err
    del data["conversations"]
    saved.write_text(json.dumps(data))
    assert main(["arena", "--replay", str(saved), "--out", str(tmp_path / "o")]) == 2
    assert "saved before arena runs kept their conversations" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--workload", "missing.json"], "not found"),
    (["--workload", "{wl}", "--policies", "lru"], "unknown policy"),
    (["--workload", "{wl}", "--budgets", "64,lots"], "comma-separated whole numbers"),
    (["--workload", "{wl}", "--budgets", "2", "--policies", "streamingllm"], "below its minimum"),
    (["--workload", "{wl}", "--max-turns", "0"], "max turns"),
    (["--workload", "{wl}", "--budget-unit", "percent", "--budgets", "25,0"], "more than 0 and at most 100"),
    (["--workload", "{bad}"], "not valid JSON"),
    (["--workload", "{wl}", "{wl}"], "distinct"),
])
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path: Path, tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture, args: list, message: str) -> None:
    monkeypatch.setattr(arena_command, "load_model", lambda *a, **k: tiny)
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"{not json")
    args = [a.format(wl=WORKLOAD, bad=bad) for a in args]
    assert main(["arena", *args, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_cli_never_writes_over_a_workload_it_reads(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "o"
    out.mkdir()
    workload = out / "results.json"
    workload.write_bytes(WORKLOAD.read_bytes())
    assert main(["arena", "--workload", str(workload), "--out", str(out)]) == 2
    assert (f"--out {out} would write results.json, which is a workload file itself"
            in capsys.readouterr().err and workload.read_bytes() == WORKLOAD.read_bytes())


def test_cli_refuses_a_file_as_output_folder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    target = tmp_path / "taken"
    target.write_text("x")
    assert main(["arena", "--workload", str(WORKLOAD), "--out", str(target)]) == 2
    assert "must be a folder" in capsys.readouterr().err


@pytest.mark.slow
def test_a_chat_in_progress_becomes_a_workload_that_replays_it(tiny: LoadedModel) -> None:
    settings = ChatSettings(policies=("full", "window"), budget=24, max_new_tokens=4)
    chat = ChatSession(tiny, settings, system="Be brief.")
    assert session_conversation(chat) is None
    chat.run_turn("First question about caches?")
    chat.run_turn("A second one?", prefill="Sure: ", answer="x")
    conv = session_conversation(chat)
    assert conv.system == "Be brief."
    assert [t.user for t in conv.turns] == ["First question about caches?", "A second one?"]
    assert [t.golden for t in conv.turns] == [t.reply for t in chat.turns]
    assert conv.turns[1].prefill == "Sure: " and conv.turns[1].answer == "x"
    table = run_arena(tiny, [conv], ArenaSettings(policies=("window",), budgets=(24,), max_new_tokens=4))
    window = table[table.policy == "window"].sort_values("turn")
    assert window["kl"].tolist() == pytest.approx([t.policies["window"].kl for t in chat.turns], abs=1e-5)


def test_a_grid_of_one_turn_cells_shows_no_kl_interval_column_and_one_of_two_turns_does(tiny: LoadedModel) -> None:
    asked = (Turn("The vault code is 4127. What is the vault code?", prefill="The vault code is", answer="4127"),)
    settings = ArenaSettings(policies=("streamingllm",), budgets=(8,), max_new_tokens=2)
    for turns, shown in ((asked, False), (asked * 2, True)):
        table = run_arena(tiny, [Conversation("vault", "", None, turns)], settings)
        page = arena_report(table, settings, "tiny-llama", ["vault"])
        assert "<th>all turns 95 %</th>" in page and ("<th>kl 95 %</th>" in page) is shown
        assert table["kl"].notna().sum() == 2 * len(turns)  # every turn has a KL: one turn gives no interval
