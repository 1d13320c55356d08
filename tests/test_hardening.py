"""Bad input everywhere: one clear line and exit code 2 from the CLI, KvlabError from the core API,
st.error with the session kept on the chat page. Nothing here needs the network."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from page_helpers import open_page
from streamlit.testing.v1 import AppTest

from kvlab.cli import main
from kvlab.engine.facts import LoadedModel
from kvlab.engine.model import load_model
from kvlab.engine.paging import block_figures
from kvlab.errors import KvlabError
from kvlab.policies.base import Policy
from kvlab.workloads.chat.conversation import MAX_FILE_BYTES, MAX_TURNS, load_conversation, parse_conversation
from kvlab.workloads.chat.replay import replay_session
from kvlab.workloads.chat.session import MAX_MESSAGE_CHARS, ChatSession
from kvlab.workloads.chat.settings import ChatSettings, model_policies
from kvlab.workloads.code.edits import load_script
from kvlab.workloads.code.source import MAX_BYTES, decode_bytes

CONV = [
    {"role": "user", "content": "My shed code is 5521. Please remember it."},
    {"role": "assistant", "content": "Noted: your shed code is 5521."},
]
NOT_UTF8 = b'{"messages": [{"role": "user", "content": "caf\xe9"}]}'  # Latin-1 é


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """One file per kind of wrong input, and a good conversation."""
    contents = {
        "conv": json.dumps(CONV).encode(),
        "empty": b"",
        "latin1": NOT_UTF8,
        "notjson": b"User: hello\nAssistant: hi\n",
        "notconv": json.dumps({"title": "not a conversation"}).encode(),
        "numbers": b"[1, 2, 3]",
        "blank_user": json.dumps([{"role": "user", "content": "   "}]).encode(),
        "too_many_turns": json.dumps([{"role": "user", "content": "hi"}] * (MAX_TURNS + 1)).encode(),
        "huge": json.dumps(CONV).encode() + b" " * MAX_FILE_BYTES,
    }
    paths = {}
    for name, data in contents.items():
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_bytes(data)
    return paths


def chat(conv: str, *extra: str) -> list[str]:
    return ["chat", "--conversation", conv, *extra]


CLI_CASES = [
    # wrong files
    (chat("{missing}"), "not found"),
    (chat("{tmp}"), "is a folder, not a file"),
    (chat("{empty}"), "empty.json is empty"),
    (chat("{notjson}"), "not valid JSON"),
    (chat("{latin1}"), "not UTF-8"),
    (chat("{notconv}"), "unknown top-level field"),
    (chat("{numbers}"), "must be an object"),
    (chat("{huge}"), "limited to 2 MB"),
    # empty and over-long
    (chat("{blank_user}"), "empty user message"),
    (chat("{too_many_turns}"), f"at most {MAX_TURNS}"),
    # budgets out of range, unknown policies, bad settings
    (chat("{conv}", "--budget", "1", "--policies", "h2o"), "below its minimum of 2"),
    (chat("{conv}", "--budget", "0"), "the budget must be at least 1 token"),
    (chat("{conv}", "--budget", "4", "--policies", "streamingllm"), "below its minimum of 5"),
    (chat("{conv}", "--budget", "9000", "--policies", "snapkv"), "exceeds the model's context of 8192"),
    (chat("{conv}", "--policies", "lru"), "unknown policy 'lru'"),
    (chat("{conv}", "--block-size", "0"), "block size must be between 1 and 4,096 tokens, not 0"),
    (chat("{conv}", "--block-size", "100000"), "block size must be between 1 and 4,096 tokens, not 100,000"),
    (chat("{conv}", "--out", "{conv}"), "is the conversation file itself; write elsewhere"),
    (chat("{conv}", "--max-new-tokens", "0"), "max new tokens"),
    (chat("{conv}", "--position-mode", "sideways"), "invalid choice"),
    # wrong types
    (chat("{conv}", "--budget", "many"), "the budget must be a whole number of tokens, not 'many'"),
    (chat("{conv}", "--budget", "nan"), "the budget must be a whole number of tokens, not 'nan'"),
    (["arena", "--workload", "{conv}", "--out", "{tmp}/a", "--budgets", "8,x"],
     "budgets must be comma-separated whole numbers of tokens like 64,128,256,512, not '8,x'"),
    (chat("{conv}", "--budget-unit", "percent", "--budget", "0"), "more than 0 and at most 100, not 0"),
    (chat("{conv}", "--block-size", "1.5"), "invalid int value"),
    # unknown models (never the network: a missing folder; a hub id while offline)
    (chat("{conv}", "--model", "{tmp}/no-such-model"), "no model folder"),
    (chat("{conv}", "--model", "kvlab-test/no-such-model"), "not in the local Hugging Face cache"),
    (chat("{conv}", "--device", "banana"), "'banana' is not a device"),
    # other commands
    (["rag", "--question", "  "], "the question is empty"),
    (["rag", "--limit", "0"], "--limit must be at least 1"),
    (["rag", "--corpus", "{latin1}"], "is not UTF-8 text"),
    (["edit", "--edits", "{notjson}"], "not valid JSON"),
    (["edit", "--edits", "{latin1}"], "edit file 'latin1.json' is not UTF-8 text"),
    (["edit", "--edits", "{empty}"], "edit file 'empty.json' is empty"),
    (["edit", "--edits", "{conv}"], "non-empty 'edits' list"),
    (["edit", "--edits", "{tmp}"], "is a folder, not a file"),
    (["edit", "--edits", "{conv}", "--out", "{tmp}"], "is a folder; give the path of a file"),
    (["edit", "--edits", "{conv}", "--out", "{conv}"], "is the edit script itself; write elsewhere"),
    (["edit", "--edits", "{conv}", "--positions", "0"], "--positions must be at least 1, not 0"),
    (["rag", "--out", "{tmp}"], "is a folder; give the path of a file"),
    # a walk wrote the JSON and then the report over it, and was told it wrote both
    (["rag", "--out", "{tmp}/r.json", "--html", "{tmp}/r.json"], "is the --out file itself; write elsewhere"),
    (["rag", "--out", ""], "--out needs the path of a file, not an empty name"),
    (["stream", "--out", " "], "--out needs the path of a folder, not an empty name"),
    (["rag", "--html", "{tmp}/no/such/folder/r.html"], "the folder of --html"),
    (["profile", "--out", "{tmp}"], "is a folder"),
    (["bench", "--runs", "0"], "--runs must be between 1 and 50"),
    (["bench", "--threads", "0"], "--threads must be between"),
    (["bench", "--out", "{tmp}/no/such/folder/b.json"], "does not exist"),
    (["profile", "--policies", "full,nope"], "unknown policy 'nope'"),
    (["profile", "--policies", "full"], "at least one policy besides full"),
    (["profile", "--policies", ""], "--policies is empty; give at least one"),
    (chat("{conv}", "--policies", " , "), "--policies is empty"),
    (chat("{conv}", "--policies", "h2o,,snapkv"), "--policies 'h2o,,snapkv' has an empty item between two commas"),
    (chat("{conv}", "--policies", "full,h2o,full"), "--policies names 'full' more than once; give each once"),
    (chat("{conv}", "--param", "streamingllm.n_sink=4", "--param", "streamingllm.n_sink=8"),
     "--param gives streamingllm.n_sink more than once; give it once"),
    (["rag", "--strategies", "naive,naive"], "--strategies names 'naive' more than once"),
    (chat("{conv}", "--policies", "snapkv,SnapKV"), "--policies names 'snapkv' more than once"),
    (chat("{conv}", "--budget", "16,,32"), "budgets '16,,32' has an empty item"),
    (["arena", "--workload", "{conv}", "--out", "{tmp}/a", "--modes", ""], "--modes is empty"),
    (["arena", "--workload", "{conv}", "--out", "{tmp}/a", "--policies", ","], "--policies is empty"),
    (["rag", "--strategies", "naive,,fixed"], "--strategies 'naive,,fixed' has an empty item"),
    (["profile", "--context", "0"], "--context must be at least 1 token"),
    (["profile", "--runs", "0"], "--runs must be between 1 and 50"),
    (["profile", "--context", "9000"], "more than the model's context of 8192"),
    (["profile", "--context", "99999999"], "more than the model's context of 8192"),  # refused before a text is made
    (["nonsense"], "invalid choice"),
    # a value that starts with a negative number is a value, not an unknown option
    (["stream", "--out", "{tmp}/s", "--sinks", "-1,4"], "sink counts must be distinct whole numbers ≥ 0, not -1, 4"),
    (["stream", "--out", "{tmp}/s", "--sinks", ""], "give at least one sink count, e.g. 0,1,2,4,8"),
    (chat("{conv}", "--budget", "-5,16"), "give one budget, not '-5,16'"),
    (["stream", "--out", "{tmp}/s", "--sinks", "-1,-2"], "sink counts must be distinct whole numbers ≥ 0, not -1, -2"),
    (["arena", "--workload", "{conv}", "--out", "{tmp}/a", "--budget-unit", "mib", "--budgets", "-.5"],
     "budgets must be more than 0 MiB, not -0.5"),
    (["arena", "--workload", "{conv}", "--out", "{tmp}/a", "--budget-unit", "mib", "--budgets", "-inf"],
     "budgets must be numbers of MiB, not -inf"),
    (["arena", "--workload", "{conv}", "--out", "{tmp}/a", "--budget-unit", "mib", "--budgets= "],
     "give at least one budget, e.g. 2.5,5,10 (MiB)"),
    (["arena", "--workload", "{conv}"], "give --out, the folder for the results"),
    (chat("{conv}", "--out", "{conv}/o.json"), "lies under"),
    (["arena", "--workload", "{conv}", "--out", "{conv}/a"], "which is a file, not a folder"),
    (chat("{conv}", "--policy-file", "{tmp}/typo.py"), "kvlab refused the plug-in policy file"),
]


# checked against the model the command loads
LOADS_MODEL = {"exceeds the model's context of 8192", "more than the model's context of 8192"}


@pytest.mark.parametrize("argv, message", [
    pytest.param(a, m, id=f"{a[0]}: {m}", marks=[pytest.mark.model] if m in LOADS_MODEL else []) for a, m in CLI_CASES
])
def test_cli_bad_input_is_one_line_and_exit_2(
    argv: list[str], message: str, files: dict[str, Path], tmp_path: Path,
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    names = {k: str(v) for k, v in files.items()} | {"missing": str(tmp_path / "missing.json"), "tmp": str(tmp_path)}
    argv = [a.format(**names) for a in argv]
    if argv[0] == "chat" and "--out" not in argv:
        argv += ["--out", str(tmp_path / "out.json")]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors (types, choices) exit directly
        code = exc.code
    assert code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("kvlab: error: ") and message in lines[0]
    assert "Traceback" not in captured.err + captured.out
    assert not (tmp_path / "out.json").exists()  # nothing half-written


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"policies": ("h2o",), "budget": 1}, "below its minimum of 2"),
        ({"budget": 0}, "the budget must be at least 1 token"),
        ({"policies": ("streamingllm",), "budget": 4}, "below its minimum of 5"),
        ({"policies": ("streamingllm",), "budget": 8, "params": {"streamingllm": {"n_sink": 8}}},
         "minimum of 9 tokens with n_sink=8"),
        ({"policies": ("snapkv",), "params": {"snapkv": {"windw": 8}}}, "unknown parameter(s) windw"),
        ({"policies": ("lru",)}, "unknown policy 'lru'"),
        # every refusal at once, so that one round of mending is enough
        ({"policies": ("h2o", "lru", "streamingllm"), "budget": 1, "params": {"h2o": {"windw": 2}}},
         "h2o: unknown parameter(s) windw; it takes recent_ratio; unknown policy 'lru'; choose from"),
        ({"policies": ("h2o", "streamingllm"), "budget": 1},
         "h2o: budget 1 is below its minimum of 2 tokens; streamingllm: budget 1 is below its minimum of 5 tokens"),
        ({"block_size": 0}, "block size must be between 1 and 4,096 tokens, not 0"),
        ({"position_mode": "sideways"}, "position mode must be one of original, rerotated"),
        ({"max_new_tokens": 0}, "reply tokens (max new tokens) must be between 1 and 1024"),
        ({"max_new_tokens": 5000}, "reply tokens (max new tokens) must be between 1 and 1024"),
        ({"stat_queries": 0}, "at least 1 last query"),
        ({"sink_tokens": -1}, "non-negative number of first tokens"),
        # a walk had to mend the chat's fields one refusal at a time
        ({"budget": 0, "block_size": 0, "max_new_tokens": 0}, "the budget must be at least 1 token per layer and KV "
         "head, not 0; block size must be between 1 and 4,096 tokens, not 0; reply tokens (max new tokens) must be "
         "between 1 and 1024, not 0"),
    ],
)
def test_settings_refused_before_any_model_work(kwargs: dict, message: str) -> None:
    with pytest.raises(KvlabError) as err:
        ChatSettings(**kwargs)
    assert message in str(err.value)


def test_a_models_refusals_come_all_at_once_before_any_policy_learns_from_it(
        tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    prepared: list[str] = []
    monkeypatch.setattr(Policy, "prepare", lambda self, lm, progress=None: prepared.append(self.name))
    with pytest.raises(KvlabError) as err:
        model_policies(tiny, ChatSettings(policies=("snapkv", "full", "h2o"), budget=3000))
    # one reason once, naming every policy it refuses (a walk read the same sentence four times)
    assert str(err.value) == "snapkv, h2o: budget 3000 exceeds the model's context of 2048 tokens"
    no_rope = replace(tiny, facts=replace(tiny.facts, rope_theta=None))
    with pytest.raises(KvlabError, match="re-rotated positions need a model with rotary embeddings"):
        model_policies(no_rope, ChatSettings(policies=("snapkv",), position_mode="rerotated"))
    assert prepared == []
    assert list(model_policies(tiny, ChatSettings(policies=("snapkv",)))) == prepared == ["full", "snapkv"]


@pytest.mark.model
def test_budget_above_context_and_bad_messages_keep_the_session(model: LoadedModel) -> None:
    context = model.facts.context_length
    with pytest.raises(KvlabError, match=f"exceeds the model's context of {context}"):
        ChatSession(model, ChatSettings(policies=("snapkv",), budget=context + 1))
    session = ChatSession(model, ChatSettings(policies=("streamingllm",), budget=16, max_new_tokens=2))
    session.run_turn("Hi.")
    before = [p.clone() for p in session.states["streamingllm"].positions]
    for bad, message in [("", "empty"), ("  \n ", "empty"), (None, "must be text"), (42, "must be text"),
                         ("x" * (MAX_MESSAGE_CHARS + 1), f"limit is {MAX_MESSAGE_CHARS}"),
                         ("7 " * (context + 800), f"context is {context}")]:
        with pytest.raises(KvlabError, match=message):
            session.run_turn(bad)
    assert len(session.turns) == 1 and session.total_tokens == session.turns[0].total_tokens
    assert all(torch.equal(a, b) for a, b in zip(before, session.states["streamingllm"].positions))


@pytest.mark.parametrize(
    "obj, message",
    [
        (42, "not int"),
        ("hello", "not str"),
        ({}, "no 'messages' list"),
        ({"messages": "hi"}, "'messages' must be a list"),
        ([], "no user message"),
        ([{"role": "user", "content": 5}], "'content' must be a string"),
        ([{"role": "robot", "content": "hi"}], "role 'robot'"),
        ([{"role": "user", "content": "hi", "answr": "x"}], "unknown field(s) 'answr'"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok", "answer": "42"}], "does not occur"),
    ],
)
def test_conversation_objects_refused(obj: object, message: str) -> None:
    with pytest.raises(KvlabError) as err:
        parse_conversation(obj)
    assert message in str(err.value)


def test_conversation_files_refused(files: dict[str, Path]) -> None:
    for name, message in [("empty", "empty.json is empty"), ("latin1", "not UTF-8 text (bad byte at offset"),
                          ("huge", "limited to 2 MB"), ("notconv", "unknown top-level field")]:
        with pytest.raises(KvlabError) as err:
            load_conversation(files[name])
        assert message in str(err.value) and files[name].name in str(err.value)


@pytest.mark.model
def test_session_files_refused(model: LoadedModel) -> None:
    cases = [({"turns": []}, "not a kvlab session file"), ([1, 2], "not a kvlab session file"),
             ({"kvlab_session": 1}, "incomplete or malformed"),
             ({"kvlab_session": 1, "settings": {"budget": "many"}, "turns": []}, "incomplete or malformed"),
             ({"kvlab_session": 1, "settings": {"policies": ["lru"]}, "turns": []}, "unknown policy")]
    for data, message in cases:
        with pytest.raises(KvlabError, match=message):
            replay_session(model, data)


def test_unknown_models_fail_fast_without_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(KvlabError, match="no model folder"):
        load_model(str(tmp_path / "nothing-here"), device="cpu")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(KvlabError, match="not in the local Hugging Face cache"):
        load_model("kvlab-test/no-such-model", device="cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # on a GPU machine too
    with pytest.raises(KvlabError, match="CUDA is not available"):
        load_model(device="cuda")
    with pytest.raises(KvlabError, match="unknown dtype"):
        load_model(device="cpu", dtype="float8")


def test_other_core_inputs_refused(tmp_path: Path) -> None:
    with pytest.raises(KvlabError, match="block size must be at least 1"):
        block_figures([torch.zeros(2, 3, dtype=torch.long)], 3, 0, 256)
    with pytest.raises(KvlabError, match="positions must be integers"):
        block_figures([torch.zeros(2, 3)], 3, 16, 256)
    with pytest.raises(KvlabError, match="not UTF-8 text"):
        decode_bytes(NOT_UTF8, "upload.py")
    with pytest.raises(KvlabError, match="the limit is"):
        decode_bytes(b"x" * (MAX_BYTES + 1), "big.py")
    with pytest.raises(KvlabError, match="is empty"):
        decode_bytes(b"  \n", "blank.py")
    bad = tmp_path / "edits.json"
    bad.write_text(json.dumps({"edits": [{"op": "move", "line": 1}]}))
    with pytest.raises(KvlabError, match="op must be one of"):
        load_script(bad)


# ---- the chat page (AppTest): bad uploads show st.error and leave the session as it was ----

def chat_page_with_a_session() -> AppTest:
    at = open_page("app_pages/chat.py")
    at.button(key="chat_script_load").click().run()  # the default scripted workload, no turn run yet
    assert not at.exception and not at.error
    return at


@pytest.mark.model  # the chat page loads the embedded model
@pytest.mark.parametrize(
    "content, message",
    [(NOT_UTF8, "not UTF-8 text"), (b"\x00\x01 binary", "not valid JSON"),
     (b"{not json", "not valid JSON"), (json.dumps({"title": "x"}).encode(), "unknown top-level field"),
     (json.dumps([{"role": "user", "content": ""}]).encode(), "empty user message"),
     (b" " * (2 * 1024 * 1024 + 1), "limited to 2 MB")],
)
def test_chat_page_bad_conversation_upload(content: bytes, message: str) -> None:
    at = chat_page_with_a_session()
    session, script = at.session_state["chat"], at.session_state["script"]
    at.file_uploader(key="chat_script_upload").set_value(("conv.json", content, "application/json")).run()
    at.button(key="chat_script_load").click().run()
    assert not at.exception
    assert any(message in e.value for e in at.error)
    assert at.session_state["chat"] is session and at.session_state["script"] is script


@pytest.mark.model
@pytest.mark.parametrize(
    "content, message",
    [(NOT_UTF8, "not UTF-8 text"), (json.dumps(CONV).encode(), "not a kvlab session file"),
     # a download cut short is UTF-8 but ends mid-record: refused with the line it breaks on
     (json.dumps({"kvlab_session": 1, "settings": {"budget": 64}}, indent=1)[:40].encode(),
      "not valid JSON (line 4")],
)
def test_chat_page_bad_session_restore(content: bytes, message: str) -> None:
    at = chat_page_with_a_session()
    session = at.session_state["chat"]
    at.file_uploader(key="chat_restore").set_value(("session.json", content, "application/json")).run()
    assert not at.exception
    assert any(message in e.value for e in at.error)
    assert at.session_state["chat"] is session


def test_every_option_of_every_command_says_what_it_is_and_its_default() -> None:
    from kvlab.cli import build_parser

    def parsers(parser: argparse.ArgumentParser):
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from parsers(sub)

    for parser in parsers(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._SubParsersAction):
                continue
            option = action.option_strings[0]
            assert action.help, f"{parser.prog} {option} has no help"
            if action.default not in (None, [], argparse.SUPPRESS) and action.default is not False:
                shown = formatter._expand_help(action)  # the help as --help prints it
                assert "default" in shown, f"{parser.prog} {option} does not say its default: {shown}"
    stream = next(p for p in parsers(build_parser()) if p.prog.endswith(" stream")).format_help()
    assert "(default: 1024)" in " ".join(stream.split())  # --budget's, said by the formatter
    ruler = next(p for p in parsers(build_parser()) if p.prog.endswith(" ruler")).format_help()
    assert "(default: 0)" in " ".join(ruler.split())  # --seed's: 0 is a default, though 0 == False
