"""Prefix reuse after code edits: exact logits, LCP over ids, edit scripts and code sources."""

from __future__ import annotations

import json
import runpy
import threading
import tomllib
from pathlib import Path

import pytest
import torch
from tiny_models import eager_forward

from kvlab.engine.cache import common_prefix
from kvlab.errors import KvlabError
from kvlab.files import MB
from kvlab.workloads.code import session as code_session
from kvlab.workloads.code.edits import (
    Edit,
    apply_edit,
    encode_checked,
    first_changed_line,
    load_script,
    parse_edit,
    reuse_edit,
    start_state,
    step,
)
from kvlab.workloads.code.session import EditSession
from kvlab.workloads.code.source import MAX_BYTES, code_files, decode_bytes, edit_scripts, module_source, read_file

TEXT = "a = 1\nb = 2\nc = 3\n"
SNIPPET_LINES = 40  # of lru_scheduler.py: ~300 tokens, enough for real code at little cost


def snippet() -> str:
    path = next(p for p in code_files() if p.name == "lru_scheduler.py")
    return "".join(read_file(path).splitlines(keepends=True)[:SNIPPET_LINES])


# --- the project's code files and edit scripts ------------------------------------------------

def test_code_files_are_real_working_python(capsys):
    files = code_files()
    assert len(files) >= 2
    for path in files:
        assert len(read_file(path).splitlines()) >= 200, path.name
        runpy.run_path(str(path), run_name="__main__")  # each file asserts its own behaviour
        assert "checks passed" in capsys.readouterr().out


def test_scripted_edits_apply_and_keep_the_code_working(capsys):
    scripts = {p.stem: load_script(p) for p in edit_scripts()}
    assert {"lru_scheduler", "expr_parser", "generic"} <= set(scripts)
    for name in ("lru_scheduler", "expr_parser"):
        script = scripts[name]
        assert {e.op for e in script.edits} == {"insert", "replace", "delete"}
        text = read_file(code_files()[0].parent / script.file.removeprefix("code/"))
        lines = len(text.splitlines())
        starts = []
        for edit in script.edits:
            text, line = apply_edit(text, edit)
            starts.append(line / lines)
        assert min(starts) < 0.2 and max(starts) > 0.8 and any(0.3 < s < 0.7 for s in starts)  # early, middle, late
        exec(compile(text, name, "exec"), {"__name__": "__main__"})
        assert "ok" in capsys.readouterr().out


def test_apply_edit_insert_replace_delete():
    assert apply_edit(TEXT, Edit("insert", line=2, text="x = 0"))[0] == "a = 1\nx = 0\nb = 2\nc = 3\n"
    assert apply_edit(TEXT, Edit("insert", line=4, text="d = 4\n"))[0] == TEXT + "d = 4\n"
    assert apply_edit(TEXT, Edit("replace", line=1, count=2, text="z = 9\n"))[0] == "z = 9\nc = 3\n"
    assert apply_edit(TEXT, Edit("delete", line=3))[0] == "a = 1\nb = 2\n"
    assert apply_edit(TEXT, Edit("delete", at=0.5)) == ("a = 1\nc = 3\n", 2)  # 1 + round(0.5 * 2)
    assert apply_edit(TEXT, Edit("insert", at=1.0, text="e\n"))[1] == 4
    assert apply_edit(TEXT, Edit("replace", line=2, old="b = 2\n", text="b = 5\n"))[0] == "a = 1\nb = 5\nc = 3\n"


@pytest.mark.parametrize("edit", [
    Edit("replace", line=2, old="b = 3\n", text="x\n"),
    Edit("delete", line=4),
    Edit("delete", line=3, count=2),
    Edit("insert", line=5, text="x\n"),
])
def test_apply_edit_rejects_bad_edits(edit):
    with pytest.raises(KvlabError):
        apply_edit(TEXT, edit)


@pytest.mark.parametrize("raw", [
    {"op": "move", "line": 1}, {"op": "insert", "line": 1}, {"op": "delete"}, {"op": "delete", "line": 1, "at": 0.5},
    {"op": "delete", "line": 0}, {"op": "delete", "at": 1.5}, {"op": "delete", "line": 1, "count": 0},
    {"op": "delete", "line": 1, "colour": "red"},
])
def test_parse_edit_rejects_bad_json(raw):
    with pytest.raises(KvlabError):
        parse_edit(raw, 0)


def test_load_script_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(KvlabError, match="not valid JSON"):
        load_script(bad)
    bad.write_text(json.dumps({"edits": []}))
    with pytest.raises(KvlabError, match="non-empty"):
        load_script(bad)
    with pytest.raises(KvlabError, match="not found"):
        load_script(tmp_path / "missing.json")
    bad.write_text(json.dumps({"edits": [{"op": "insert", "at": 2, "text": "x"}]}))
    with pytest.raises(KvlabError, match="^edit file 'bad.json': edit 1: 'at' must be a number between 0 and 1"):
        load_script(bad)  # which file, not only which edit


# --- code sources -----------------------------------------------------------------------------

def test_decode_bytes_checks_utf8_size_and_emptiness():
    assert decode_bytes("print('é')\r\n".encode()) == "print('é')\n"
    with pytest.raises(KvlabError, match="not UTF-8"):
        decode_bytes(b"ok\xff\xfe")
    with pytest.raises(KvlabError, match="limit"):
        decode_bytes(b"x" * 11, max_bytes=10)
    with pytest.raises(KvlabError, match="empty"):
        decode_bytes(b"  \n")


def test_the_code_limit_is_what_the_upload_widget_and_the_server_take():
    """The code page's uploader states its limit in whole MB (Streamlit's unit, 10⁶ bytes in its browser side): the
    check must be that very limit, and the server must take a file that large."""
    config = tomllib.loads((Path(__file__).resolve().parents[1] / ".streamlit" / "config.toml").read_text())
    assert MAX_BYTES % MB == 0 and 1 <= MAX_BYTES // MB and MAX_BYTES <= config["server"]["maxUploadSize"] << 20
    assert decode_bytes(b"x" * MAX_BYTES)
    with pytest.raises(KvlabError, match="the limit is 1,000,000"):
        decode_bytes(b"x" * (MAX_BYTES + 1), "big.py")


def test_module_source_reads_an_installed_module():
    text, origin = module_source("json.decoder")
    assert origin.endswith("decoder.py") and "class JSONDecoder" in text
    assert "def makedirs(" in module_source("os")[0]  # a frozen stdlib module still has its file
    for bad in ("no_such_module_kvlab", "json.nope", "2fast", "sys"):
        with pytest.raises(KvlabError):
            module_source(bad)
    with pytest.raises(KvlabError, match=r"it is [^/\\]+\)$"):  # a file's name (or built-in), not its path
        module_source("math")


# --- prefix reuse -----------------------------------------------------------------------------

def test_first_changed_line():
    assert first_changed_line(TEXT, TEXT.replace("b = 2", "b = 7")) == 2
    assert first_changed_line(TEXT, TEXT + "d = 4\n") == 4
    assert first_changed_line(TEXT, "a = 1\n") == 2


def test_lcp():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([5], [6]) == 0
    assert common_prefix([], [1]) == 0


@pytest.mark.model
def test_lcp_uses_ids_not_characters(model):
    # the characters "value" survive the edit, but BPE turns "value" into "values": no token is shared
    old, new = "value = 1\n", "values = 1\n"
    assert model.encode(old)[0] != model.encode(new)[0]
    assert common_prefix(model.encode(old), model.encode(new)) == 0
    state = start_state(model, old)
    _, result = reuse_edit(model, state, new)
    assert result.reused == 0 and result.max_logit_diff <= 1e-3


@pytest.mark.parametrize("fixture", ["tiny", pytest.param("model", marks=pytest.mark.model)])
def test_reuse_equals_full_prefill(fixture, request):
    lm = request.getfixturevalue(fixture)
    text = snippet()
    state = start_state(lm, text)
    new_text = apply_edit(text, Edit("replace", line=20, text="    def size(self):  # edited\n"))[0]
    state, result = reuse_edit(lm, state, new_text)
    assert 0 < result.reused < result.new_tokens
    assert result.reuse_pct == pytest.approx(100 * result.reused / result.new_tokens)
    assert result.max_logit_diff <= 1e-3
    _, keys, values = eager_forward(lm, state.ids)  # the model's own eager prefill of the new text
    for ours, k, v in zip(state.cache.layers, keys, values):  # the whole K/V, not only the logits
        assert ours.keys[0].shape == k.shape
        assert torch.allclose(ours.keys[0], k, atol=1e-3) and torch.allclose(ours.values[0], v, atol=1e-3)


def test_reuse_is_zero_at_the_first_token_and_near_full_at_the_end(tiny):
    text = snippet()
    state = start_state(tiny, text)
    _, top = reuse_edit(tiny, state, "# header\n" + text)
    assert top.lcp == 0 and top.reuse_pct == 0.0 and top.suffix == top.new_tokens
    _, end = reuse_edit(tiny, state, text + "# end\n")
    assert end.reused == len(state.ids) and end.reuse_pct > 95 and end.max_logit_diff <= 1e-3
    # deleting the last line leaves nothing new: the last token is re-run so logits exist
    longer = text + "x = 1\n"
    # the old ids are a prefix of the longer ones
    assert common_prefix(tiny.encode(longer), state.ids) == len(state.ids)
    _, cut = reuse_edit(tiny, start_state(tiny, longer), text)
    assert cut.lcp == cut.new_tokens and cut.reused == cut.new_tokens - 1 and cut.suffix == 1


@pytest.mark.slow
def test_scripted_steps_chain_exactly(tiny):
    script = load_script(next(p for p in edit_scripts() if p.stem == "generic"))
    state = start_state(tiny, snippet())
    for i, edit in enumerate(script.edits, 1):
        state, result = step(tiny, state, edit, i)
        assert result.index == i and result.max_logit_diff <= 1e-3
    assert state.ids == encode_checked(tiny, state.text)


def test_encode_checked_rejects_empty_and_too_long(tiny):
    with pytest.raises(KvlabError, match="empty"):
        encode_checked(tiny, "")
    with pytest.raises(KvlabError, match="context"):
        encode_checked(tiny, "x = 1\n" * (tiny.facts.context_length // 2))


def test_the_speedup_is_the_median_of_pairs_timed_back_to_back(tiny):
    text = "def f(x):\n    return x + 1\n" * 20
    _, result = reuse_edit(tiny, start_state(tiny, text), text + "# end\n", repeats=3)
    assert result.runs == 3 and len(result.speedups) == 3
    assert result.speedup == sorted(result.speedups)[1]  # the middle pair's ratio, not a ratio of medians
    assert result.max_logit_diff < 1e-4


@pytest.mark.parametrize("edit, message", [
    ({"label": "insert 1", "op": "insert", "line": 99, "text": "x = 1"},
     "{script} does not fit {code}: insert 1: line 99 is outside 1…3"),
    ({"label": "delete all", "op": "delete", "line": 1, "count": 2}, "delete all: it leaves"),
])
def test_a_script_that_cannot_apply_is_refused_before_the_model_loads(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, edit: dict,
        message: str) -> None:
    from kvlab.cli import edit as edit_command
    from kvlab.cli import main

    monkeypatch.setattr(edit_command, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    code, script = tmp_path / "small.py", tmp_path / "script.json"
    code.write_text("a = 1\nb = 2\n")
    script.write_text(json.dumps({"edits": [edit]}))
    assert main(["edit", "--file", str(code), "--edits", str(script)]) == 2
    err = capsys.readouterr().err  # one line: no progress bar started before it
    assert err.count("\n") == 1 and err.startswith(f"kvlab: error: {message.format(script=script, code=code)}")


def test_two_clicks_on_one_edit_record_it_once(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """A walk clicked Apply again while the edit was measured: the run the click cut short went on computing beside
    the new one, both applied the same text, and the table showed the edit twice (the chart's bar at twice its
    reuse). Edits of one session now run one at a time, and one that finds its text applied already is refused."""
    session = EditSession.start(tiny, snippet())
    new_text = session.state.text + "# edited\n"
    inside, go = threading.Event(), threading.Event()
    real = code_session.reuse_edit

    def slow(*args, **kwargs):  # the first call holds the session until the second has asked for it
        inside.set()
        go.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(code_session, "reuse_edit", slow)
    first = threading.Thread(target=session.apply_text, args=(new_text,))
    first.start()
    inside.wait(10)
    assert not session.wait_idle(0)  # the page waits for it before reading the session
    refused: list[str] = []

    def second() -> None:
        try:
            session.apply_text(new_text)
        except KvlabError as exc:
            refused.append(str(exc))

    again = threading.Thread(target=second)
    again.start()
    go.set()
    first.join(10)
    again.join(10)
    assert len(session.results) == 1 and refused == ["the file holds this text already"]
    assert session.wait_idle(0) and session.state.text == new_text


def test_two_runs_playing_one_sequence_apply_its_next_edit_once(tiny) -> None:
    """Two page runs playing one sequence each read how far it had played, then applied its next edit: checked
    under the session's lock, the second finds the file moved on and is refused."""
    session = EditSession.start(tiny, snippet())
    edits = load_script(next(p for p in edit_scripts() if p.name == "generic.json")).edits
    session.apply(edits[0], 1, "generic.json", after=0)
    with pytest.raises(KvlabError, match="no longer as 0 edits of the sequence left it"):
        session.apply(edits[0], 1, "generic.json", after=0)
    assert session.played("generic.json") == 1 and len(session.results) == 1
