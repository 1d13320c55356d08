"""`python -m kvlab stream`: the files it writes (on the tiny model with the embedded tokenizer), and one clear
line with a non-zero exit code for bad input."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pandas as pd
import pytest

import kvlab.cli.stream as stream_cli
from kvlab import __version__
from kvlab.cli import main
from kvlab.cli.interrupt import stop_on_interrupt
from kvlab.cli.options import made, out_folder
from kvlab.engine.facts import LoadedModel

PROSE = ("The river ran past the mill and the miller counted the sacks of grain while the children watched "
         "the water turn the great wheel. ") * 40


@pytest.fixture
def on_tiny(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> LoadedModel:
    """The command loads the tiny random Llama instead of a real model."""
    monkeypatch.setattr(stream_cli, "load_model", lambda *args, **kwargs: tiny)
    return tiny


def test_stream_writes_tokens_segments_json_and_report(on_tiny, tmp_path: Path, capsys) -> None:
    text = tmp_path / "prose.txt"
    text.write_text(PROSE)
    out = tmp_path / "run"
    code = main(["stream", "--text", str(text), "--tokens", "120", "--budget", "24", "--chunk", "16",
                 "--policies", "full,window,streamingllm,recompute", "--sinks", "0,4", "--segment", "50",
                 "--out", str(out)])
    assert code == 0
    tokens = pd.read_csv(out / "tokens.csv")
    assert {"policy", "position", "nll"} <= set(tokens.columns)
    assert tokens.groupby("policy").size().to_dict() == {"full": 119, "recompute": 119, "streamingllm": 119,
                                                         "window": 119}
    data = json.loads((out / "result.json").read_text())
    assert data["settings"]["budget"] == 24 and data["tokens"] == 120 and data["text"] == "prose.txt"
    assert data["kvlab_version"] == __version__ and data["saved_at"].endswith("UTC") and data["model"]
    assert [r["sinks"] for r in data["sink_ablation"]] == [0, 4]
    assert {r["policy"] for r in data["summary"]} == {"full", "window", "streamingllm", "recompute"}
    assert len(pd.read_csv(out / "segments.csv")) == 4 * 3
    report = (out / "report.html").read_text()
    assert "Sink ablation" in report and "trained context" in report
    # its own seconds beside the stream's; the report's tables head their columns in words and never say None
    assert data["sink_ablation_time_s"] > 0 and data["time_s"] > 0
    tables = report.split("<script", 1)[0]  # plotly.js follows them
    assert "None" not in tables and "<th>perplexity</th>" in tables and "<th>ppl</th>" not in tables
    printed = capsys.readouterr().out
    assert "dense (Full)" in printed and "4 + 20" in printed and "sink_ablation.csv" in printed
    # the same folder again without the ablation: the first run's ablation does not stay as this one's
    assert main(["stream", "--text", str(text), "--tokens", "60", "--budget", "24", "--chunk", "16",
                 "--policies", "full,window", "--out", str(out)]) == 0
    assert not (out / "sink_ablation.csv").exists() and "sink_ablation.csv" not in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--policies", "full,nonsense"], "unknown policy 'nonsense'; a stream runs full, streamingllm, window"),
    # every policy the cache size does not suit, not the first alone
    (["--budget", "99999", "--tokens", "100"],
     "tokens; streamingllm: budget 99999 exceeds the model's context"),
    (["--policies", "quest"], "keeps every key"),
    (["--policies", "full,oracle"], "a stream has no script"),
    (["--text", "/"], "text file / is a folder, not a file"),
    (["--chunk", "0"], "chunk"),
    (["--budget", "0"], "cache size"),
    (["--tokens", "1"], "between 2 and 1,000,000, not 1"),
    (["--tokens", "1000000000"], "between 2 and 1,000,000"),
    (["--sinks", "0,four"], "sink counts are whole numbers"),
    (["--sinks", "0,,4"], "sink counts '0,,4' has an empty item between two commas"),
    (["--sinks", " "], "give at least one sink count, e.g. 0,1,2,4,8"),
    (["--policies", ""], "--policies is empty"),
    (["--sinks", "0,30"], "no room"),
    (["--param", "snapkv.window=4"], "not among the policies"),
    (["--tokens", "100000"], "fewer than --tokens"),
    (["--budget", "500"], "needs at least"),
])
def test_bad_input_is_one_line_and_a_non_zero_exit(on_tiny, tmp_path: Path, capsys, args, message) -> None:
    text = tmp_path / "prose.txt"
    text.write_text(PROSE)
    code = main(["stream", "--text", str(text), "--tokens", "200", "--budget", "24", "--chunk", "16",
                 "--out", str(tmp_path / "run"), *args])
    err = capsys.readouterr().err
    assert code != 0 and message in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()  # a refused run leaves no folder, not even an empty one


def test_a_file_that_is_no_text_is_refused_before_any_model_work(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(stream_cli, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    binary = tmp_path / "notes.txt"
    binary.write_bytes(b"\xff\xfe\x00\x01" * 100)
    assert main(["stream", "--text", str(binary), "--out", str(tmp_path / "o")]) == 2
    assert "not UTF-8 text" in capsys.readouterr().err
    assert main(["stream", "--text", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o")]) == 2
    assert "text file not found" in capsys.readouterr().err


def test_ctrl_c_stops_after_the_chunk_keeps_what_was_read_and_exits_130(on_tiny, tmp_path: Path, capsys,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          terminal_sigint: None) -> None:
    text = tmp_path / "prose.txt"
    text.write_text(PROSE)
    bar = stream_cli.progress_bar

    def interrupting_bar(*args, **kwargs):  # Ctrl-C arrives while the second chunk is read
        made, report = bar(*args, **kwargs)

        def progress(frac: float, message: str) -> None:
            report(frac, message)
            if frac < 1 and "32 of" in message:
                os.kill(os.getpid(), signal.SIGINT)
        return made, progress

    monkeypatch.setattr(stream_cli, "progress_bar", interrupting_bar)
    before = signal.getsignal(signal.SIGINT)  # the shell's; a job started in the background has it ignored
    out = tmp_path / "run"
    code = main(["stream", "--text", str(text), "--tokens", "120", "--budget", "24", "--chunk", "16",
                 "--policies", "full,streamingllm", "--sinks", "0,4", "--out", str(out)])
    assert code == 130
    tokens = pd.read_csv(out / "tokens.csv")
    assert tokens.groupby("policy").size().to_dict() == {"full": 32, "streamingllm": 32}  # the chunk it was on
    data = json.loads((out / "result.json").read_text())
    assert data["cancelled"] is True and data["sink_ablation"] is None  # the ablation never started
    printed = capsys.readouterr()
    assert "interrupted: the stream stopped after 32 of 119 tokens" in printed.err
    # beside the numbers too, where a walk read a table of 96 tokens with no word that it was cut short
    assert "Cut short: the tables below hold the first 32 of 119 tokens to score." in printed.out
    assert signal.getsignal(signal.SIGINT) is before  # Ctrl-C is the shell's again


def test_ctrl_c_before_the_first_chunk_writes_nothing_over_an_earlier_run(on_tiny, tmp_path: Path, capsys,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    text = tmp_path / "prose.txt"
    text.write_text(PROSE)
    out = tmp_path / "run"
    out.mkdir()
    (out / "tokens.csv").write_text("an earlier run's\n")
    real = stream_cli.run_stream

    def stopped_at_once(lm, ids, settings, progress, cancel):
        cancel.set()
        return real(lm, ids, settings, progress, cancel)

    monkeypatch.setattr(stream_cli, "run_stream", stopped_at_once)
    assert main(["stream", "--text", str(text), "--tokens", "120", "--budget", "24", "--chunk", "16",
                 "--policies", "full,streamingllm", "--out", str(out)]) == 130
    assert [p.name for p in out.iterdir()] == ["tokens.csv"]
    assert (out / "tokens.csv").read_text() == "an earlier run's\n"
    assert "stopped before its first chunk was read; nothing was written" in capsys.readouterr().err


def test_a_second_ctrl_c_aborts_at_once(terminal_sigint: None) -> None:
    before = signal.getsignal(signal.SIGINT)
    with stop_on_interrupt("stopping") as cancel:
        os.kill(os.getpid(), signal.SIGINT)  # the first asks the run to stop: no exception
        assert cancel.is_set()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


def test_a_ctrl_c_the_caller_ignores_stays_ignored() -> None:
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a job started in the background
    try:
        with stop_on_interrupt("stopping") as cancel:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            assert not cancel.is_set()
    finally:
        signal.signal(signal.SIGINT, before)


def test_an_out_folder_that_cannot_be_made_is_refused_before_any_model_work(tmp_path: Path, capsys,
                                                                            monkeypatch) -> None:
    monkeypatch.setattr(stream_cli, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    text = tmp_path / "prose.txt"
    text.write_text(PROSE)
    assert main(["stream", "--text", str(text), "--out", str(text / "run")]) == 2  # under a file
    assert f"--out {text / 'run'} lies under {text}, which is a file, not a folder" in capsys.readouterr().err
    # a folder no process may make there, where the write permission bits say nothing (root): refused up front too
    for where, why in (("/proc/kvlab-nope", "No such file or directory"), ("/sys/kvlab-nope", "")):
        assert main(["stream", "--text", str(text), "--out", where]) == 2
        assert f"cannot create the folder {where} for --out: {why}" in capsys.readouterr().err
    deep = tmp_path / "a" / "b" / "run"  # a folder that can be made is tried, then taken away until results come
    assert out_folder(str(deep)) == deep and not (tmp_path / "a").exists()
    mine = tmp_path / "mine"  # an empty folder of the user's, reached through one that does not exist: it stays
    mine.mkdir()
    assert out_folder(str(tmp_path / "new" / ".." / "mine")) and mine.is_dir() and not (tmp_path / "new").exists()
    other = made(out_folder(str(tmp_path / "new" / ".." / "other")))  # writing makes no folder it passes through
    assert other == tmp_path.resolve() / "other" and other.is_dir() and not (tmp_path / "new").exists()
    assert out_folder(str(mine)) == mine and mine.is_dir()
