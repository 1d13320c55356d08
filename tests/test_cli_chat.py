"""`python -m kvlab chat`: the JSON it writes, and one clear line with exit code 2 for bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

import kvlab.cli.chat as chat_command
import kvlab.cli.rag as rag_command
from kvlab.cli import COMMANDS, main
from kvlab.cli.printing import text_table
from kvlab.engine.facts import LoadedModel
from kvlab.workloads.chat.records import positions_of

ROOT = Path(__file__).resolve().parents[1]
CONV = [
    {"role": "user", "content": "My vault code is 27182. Please keep it in mind."},
    {"role": "assistant", "content": "Noted: your vault code is 27182."},
    {"role": "user", "content": "What is my vault code?"},
    {"role": "assistant", "content": "Your vault code is 27182.", "prefill": "Your vault code is", "answer": "27182"},
]


@pytest.mark.model
def test_chat_command_writes_every_record(tmp_path: Path, capsys: pytest.CaptureFixture, embedded_config) -> None:
    conv = tmp_path / "c.json"
    conv.write_text(json.dumps(CONV))
    out = tmp_path / "r.json"
    code = main(["chat", "--conversation", str(conv), "--policies", "streamingllm,h2o", "--budget", "24",
                 "--max-new-tokens", "4", "--out", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert [t["reply_source"] for t in data["turns"]] == ["golden", "golden"]
    last = data["turns"][1]["policies"]
    assert set(last) == {"full", "streamingllm", "h2o"}
    assert len(last["h2o"]["retained"]) == embedded_config.num_hidden_layers
    assert all(len(positions_of(h)) == 24 for layer in last["h2o"]["retained"] for h in layer)
    assert last["streamingllm"]["retained"][0][0][0] == [0, 4]  # the sinks, as a run
    assert last["full"]["correct"] is not None
    printed = capsys.readouterr().out
    assert "streamingllm" in printed and "kl" in printed


def ctrl_c_as_it_returns(monkeypatch: pytest.MonkeyPatch, owner: type, name: str) -> None:
    """Make ``owner.name`` send this process a Ctrl-C each time it returns, as a user pressing it then would."""
    method = getattr(owner, name)

    def interrupted(self, *args, **kwargs):
        result = method(self, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        return result

    monkeypatch.setattr(owner, name, interrupted)


def test_ctrl_c_stops_after_the_turn_and_writes_the_turns_that_ran(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, tiny: LoadedModel,
        terminal_sigint: None) -> None:
    monkeypatch.setattr(chat_command, "load_model", lambda *args, **kwargs: tiny)
    ctrl_c_as_it_returns(monkeypatch, chat_command.ChatSession, "run_turn")  # as the first turn ends
    conv, out = tmp_path / "c.json", tmp_path / "r.json"
    conv.write_text(json.dumps(CONV))
    before = signal.getsignal(signal.SIGINT)
    code = main(["chat", "--conversation", str(conv), "--policies", "window", "--budget", "8", "--max-new-tokens",
                 "2", "--out", str(out)])
    assert code == 130
    data = json.loads(out.read_text())
    assert len(data["turns"]) == 1 and data["cancelled"] is True
    err = capsys.readouterr().err
    assert "interrupted: 1 of the 2 turns ran" in err and "| 1/2 [" in err  # the bar counts the turn that ran
    assert signal.getsignal(signal.SIGINT) is before


def test_ctrl_c_stops_rag_after_the_question_and_writes_the_questions_that_ran(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, tiny: LoadedModel,
        terminal_sigint: None) -> None:
    monkeypatch.setattr(rag_command, "load_model", lambda *args, **kwargs: tiny)
    ctrl_c_as_it_returns(monkeypatch, rag_command.RagLab, "run")  # as the first question ends
    out, table, report = tmp_path / "r.json", tmp_path / "r.csv", tmp_path / "r.html"
    before = signal.getsignal(signal.SIGINT)
    code = main(["rag", "--limit", "3", "--k", "2", "--runs", "1", "--answer-tokens", "2", "--drift-layer", "1",
                 "--out", str(out), "--csv", str(table), "--html", str(report)])
    assert code == 130
    data = json.loads(out.read_text())
    assert len(data["questions"]) == 1 and data["cancelled"] is True
    assert pd.read_csv(table)["question"].nunique() == 1
    said = report.read_text().split("<table", 1)[0]  # the report says what ran, when, and that it was cut short
    assert "Cut short: 1 of the 3 questions ran" in said and f"model {tiny.facts.name}" in said
    assert "k 2, strategies" in said and "not a speed measurement" in said
    err = capsys.readouterr().err
    assert "interrupted: 1 of the 3 questions ran" in err and "| 1/3 [" in err  # the bar counts the question
    assert signal.getsignal(signal.SIGINT) is before


def test_ctrl_c_in_a_command_without_a_clean_stop_is_one_line_and_exit_130(
        capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(rag_command, "run", interrupted)
    assert main(["rag"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "kvlab: interrupted: rag stopped before it finished and wrote no result"


def loading_torch(process: subprocess.Popen) -> None:
    """Wait until ``process`` has mapped torch's library: it is inside its imports, past the start-up handler."""
    maps, deadline = Path(f"/proc/{process.pid}/maps"), time.monotonic() + 60
    while process.poll() is None and time.monotonic() < deadline and "libtorch" not in maps.read_text():
        time.sleep(0.01)
    assert process.poll() is None, "kvlab finished starting before torch was seen loading"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to see torch loading")
def test_ctrl_c_while_kvlab_starts_is_one_line_and_exit_130() -> None:
    """torch and transformers take seconds to import: a Ctrl-C then is a stop, not a traceback."""
    # a test run in the background inherits an ignored SIGINT; a user's terminal gives Python its default
    started = subprocess.Popen([sys.executable, "-m", "kvlab", "--help"], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    loading_torch(started)  # well inside the imports
    started.send_signal(signal.SIGINT)
    out, err = started.communicate(timeout=60)
    assert started.returncode == 130 and "Traceback" not in err, err[-2000:]
    assert err.strip() == "kvlab: interrupted while starting" and not out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to see torch loading")
def test_a_ctrl_c_the_caller_ignores_stays_ignored_while_kvlab_starts() -> None:
    """A background job ignores SIGINT: kvlab's start must not turn it back into a stop."""
    started = subprocess.Popen([sys.executable, "-m", "kvlab", "--help"], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    loading_torch(started)
    started.send_signal(signal.SIGINT)
    out, err = started.communicate(timeout=120)
    assert started.returncode == 0 and out.startswith("usage:"), err[-2000:]


@pytest.mark.slow
def test_a_percent_budget_holds_each_turn_within_that_share_of_fulls_bytes(
        tmp_path: Path, tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(chat_command, "load_model", lambda *a, **k: tiny)
    conv, out = tmp_path / "c.json", tmp_path / "r.json"
    conv.write_text(json.dumps(CONV))
    assert main(["chat", "--conversation", str(conv), "--policies", "streamingllm", "--budget-unit", "percent",
                 "--budget", "30", "--max-new-tokens", "2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["settings"]["budget_percent"] == 30
    for turn in data["turns"]:
        full, own = turn["policies"]["full"], turn["policies"]["streamingllm"]
        assert own["budget_bytes"] == int(full["kv_bytes"] * 30 / 100) and own["kv_bytes"] <= own["budget_bytes"]
        assert full["budget_bytes"] is None  # Full keeps every token
    assert "held_share" in capsys.readouterr().out


def test_max_turns_runs_the_first_turns_and_empty_cells_print_as_dashes(
        tmp_path: Path, tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(chat_command, "load_model", lambda *a, **k: tiny)
    conv, out = tmp_path / "c.json", tmp_path / "r.json"
    conv.write_text(json.dumps(CONV))
    assert main(["chat", "--conversation", str(conv), "--policies", "snapkv", "--budget", "16", "--max-turns", "1",
                 "--max-new-tokens", "2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert len(data["turns"]) == 1 and not data["cancelled"]
    printed = capsys.readouterr().out
    full = next(line for line in printed.splitlines() if line.split()[1:2] == ["full"])
    assert " - " in full and not any(word in printed for word in ("None", "<NA>", "nan", "NaN"))


def test_text_tables_show_every_empty_cell_as_a_dash() -> None:
    table = pd.DataFrame({"x": [0.12345, None], "n": pd.array([3, None], dtype="Int64"), "s": ["a", None],
                          "b": [True, None]})
    lines = text_table(table).splitlines()
    assert lines[1].split() == ["0.123", "3", "a", "True"] and lines[2].split() == ["-", "-", "-", "-"]
    # a count made float by an empty cell prints whole; a float that is not a count keeps its places
    counts = pd.DataFrame({"kept_tokens": [121.0, 32.0], "budget_tokens": [None, 32.0], "kl": [0.0, 0.25],
                           "held_tokens": [1.5, 2.0]})
    assert [line.split() for line in text_table(counts).splitlines()[1:]] == [
        ["121", "-", "0.000", "1.500"], ["32", "32", "0.250", "2.000"]]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--conversation", "{conv}", "--max-turns", "0"], "--max-turns must be a whole number of at least 1, not 0"),
        (["--conversation", "missing.json"], "not found"),
        (["--conversation", "{conv}", "--policies", "lru"], "unknown policy"),
        (["--conversation", "{conv}", "--budget", "2", "--policies", "streamingllm"], "below its minimum"),
        (["--conversation", "{conv}", "--budget", "many"], "the budget must be a whole number of tokens, not 'many'"),
        (["--conversation", "{conv}", "--budget", "64,128"], "give one budget"),
        (["--conversation", "{conv}", "--budget-unit", "percent", "--budget", "150"], "at most 100, not 150"),
        (["--conversation", "{bad}"], "JSON"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture, args: list,
                                          message: str) -> None:
    conv, bad = tmp_path / "c.json", tmp_path / "bad.json"
    conv.write_text(json.dumps(CONV))
    bad.write_bytes(b"{not json")
    args = [a.format(conv=conv, bad=bad) for a in args]
    assert main(["chat", *args, "--out", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]



@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_prints_its_help(command: str, capsys: pytest.CaptureFixture) -> None:
    """``--help`` formats every help text (a bare % in one once crashed argparse's formatting)."""
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    assert f"python -m kvlab {command}" in capsys.readouterr().out


def test_replies_cut_shorter_than_the_answer_are_warned_of_before_the_chat_runs(
        tmp_path: Path, tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(chat_command, "load_model", lambda *a, **k: tiny)
    conv, out = tmp_path / "c.json", tmp_path / "r.json"
    conv.write_text(json.dumps(CONV))
    need = len(tiny.encode(" 27182"))
    assert main(["chat", "--conversation", str(conv), "--policies", "snapkv", "--budget", "16",
                 "--max-new-tokens", str(need - 1), "--out", str(out)]) == 0
    assert f"kvlab: warning: Replies are cut at {need - 1} tokens, but the one scored turn needs more" \
        in capsys.readouterr().err
    assert main(["chat", "--conversation", str(conv), "--policies", "snapkv", "--budget", "16",
                 "--max-new-tokens", str(need), "--out", str(out)]) == 0
    assert "Replies are cut" not in capsys.readouterr().err
