"""SCBench sessions (issue 21 item 3): files in SCBench's schema load as sessions, run in both modes on the
tiny random Llama, are scored by SCBench's per-task metric and cut in the middle to fit; bad records are
refused with the field named."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import pytest

from kvlab.cli import chat as chat_command
from kvlab.cli import main
from kvlab.engine.facts import LoadedModel
from kvlab.errors import KvlabError
from kvlab.experiments.plan import ArenaSettings
from kvlab.experiments.runner import run_arena
from kvlab.workloads.chat.conversation import conversation_to_json, parse_conversation
from kvlab.workloads.chat.files import load_workloads, workloads_from_bytes
from kvlab.workloads.chat.metrics import score_reply
from kvlab.workloads.chat.scbench import TASKS, ScbenchTask, fit_to_context, hub_records, task_of

KV = [
    {"id": 0, "context": '{"a1b2": "c3d4", "e5f6": "g7h8", "i9j0": "k1l2"}',
     "multi_turns": [{"input": 'Key: "a1b2"\nThe value associated with the specified key is: ', "answer": "c3d4"},
                     {"input": 'Key: "e5f6"\nThe value associated with the specified key is: ', "answer": "g7h8"}]},
    {"id": 7, "context": '{"zz11": "yy22"}',
     "multi_turns": [{"input": 'Key: "zz11"\nThe value is: ', "answer": "yy22"}]},
]
CHOICE = [
    {"id": "b1", "context": "Mara sailed north with two dogs. Later she sold the boat to Ivo.",
     "multi_turns": [
         {"input": "Who bought the boat?", "answer": "Ivo", "options": ["Mara", "Ivo", "The dogs", "Nobody"]},
         {"input": "Where did Mara sail?", "answer": "North", "options": ["South", "East", "North", "West"]}]},
]
PASSKEY = [
    {"id": 3, "context": "The grass is green. The pass key is 71432. Remember it. The sky is blue.",
     "multi_turns": [{"input": "What is the pass key?", "answer": "71432"},
                     {"input": "Repeat the pass key.", "answer": ["71432"]}]},
]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_records_become_sessions_with_the_tasks_prompt_and_metric(tmp_path: Path) -> None:
    kv = load_workloads(write_jsonl(tmp_path / "scbench_kv.jsonl", KV))
    assert [c.name for c in kv] == ["scbench_kv-0", "scbench_kv-7"]
    first, second = kv[0].turns
    assert first.user.startswith("Extract the value corresponding to the specified key in the JSON object below.")
    assert KV[0]["context"] in first.user and first.user.endswith(KV[0]["multi_turns"][0]["input"])
    assert second.user == KV[0]["multi_turns"][1]["input"]  # a later turn is its question alone
    assert (first.golden, first.answer, first.metric) == ("c3d4", "c3d4", "contains")
    assert kv[0].truncatable and "metric contains" in kv[0].description

    choice = load_workloads(write_jsonl(tmp_path / "scbench_choice_eng.jsonl", CHOICE))[0]
    assert [t.metric for t in choice.turns] == ["option", "option"]
    assert [t.answer for t in choice.turns] == ["B\nIvo", "C\nNorth"]
    assert "A. Mara\nB. Ivo" in choice.turns[0].user and choice.turns[1].user.startswith("Question: Where")

    passkey = load_workloads(write_jsonl(tmp_path / "scbench_passkey.jsonl", PASSKEY))[0]
    assert [t.metric for t in passkey.turns] == ["first_number", "first_number"]
    unknown = load_workloads(write_jsonl(tmp_path / "my-sessions.jsonl", KV))[0]
    assert unknown.name == "my-sessions-0" and unknown.turns[0].user.startswith(KV[0]["context"])
    assert task_of("scbench_kv.jsonl") == "scbench_kv" and task_of("notes.jsonl") is None


def test_one_record_by_id_and_every_format(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "scbench_kv.jsonl", KV)
    assert [c.name for c in load_workloads(path, record="7")] == ["scbench_kv-7"]
    with pytest.raises(KvlabError, match="no record with id '9'; its ids: 0, 7"):
        load_workloads(path, record="9")
    as_json = tmp_path / "scbench_kv.json"
    as_json.write_text(json.dumps(KV))
    parquet = tmp_path / "scbench_kv.parquet"
    pd.DataFrame(KV).to_parquet(parquet)
    assert load_workloads(as_json) == load_workloads(path) == load_workloads(parquet)


@pytest.mark.parametrize("record, field", [
    ({"context": "x", "multi_turns": [{"input": "q", "answer": "a"}]}, "record 1 has no 'id'"),
    ({"id": 1, "multi_turns": [{"input": "q", "answer": "a"}]}, "record 1 has no 'context'"),
    ({"id": 1, "context": "x", "multi_turns": []}, r"record 1 \(id 1\): 'multi_turns' must be a non-empty list"),
    ({"id": 1, "context": "x", "multi_turns": [{"input": "q"}]}, r"multi_turns\[0\] has no 'answer'"),
    ({"id": 1, "context": "x", "multi_turns": [{"input": "q", "answer": "a"}, {"answer": "b"}]},
     r"multi_turns\[1\] has no 'input'"),
    ({"id": 1, "context": "x", "multi_turns": [{"input": "q", "answer": {"a": 1}}]}, "'answer' must be a non-empty"),
    ({"id": 1, "context": 5, "multi_turns": [{"input": "q", "answer": "a"}]}, "'context' must be a non-empty string"),
    ({"id": 1, "context": "x", "multi_turns": [{"input": "q", "answer": "a", "options": ["a", "b"]}]},
     "'options' must be a list of four strings"),
])
def test_malformed_records_are_refused_with_the_field_named(tmp_path: Path, record: dict, field: str) -> None:
    good = {"id": 0, "context": "c", "multi_turns": [{"input": "q", "answer": "a"}]}
    path = write_jsonl(tmp_path / "scbench_kv.jsonl", [record, good])
    with pytest.raises(KvlabError, match=field) as err:
        load_workloads(path)
    assert str(err.value).startswith("scbench_kv.jsonl: ")


def test_bad_files_are_refused_in_words(tmp_path: Path) -> None:
    with pytest.raises(KvlabError, match="line 2 is not valid JSON"):
        workloads_from_bytes(b'{"id": 1, "context": "c", "multi_turns": []}\n{oops\n', "s.jsonl")
    with pytest.raises(KvlabError, match="not UTF-8"):
        workloads_from_bytes(b"\xff\xfe\x00", "s.jsonl")
    for empty in (b"", b"\n\n"):  # named once, in neither format's words alone (it said "holds no SCBench record")
        with pytest.raises(KvlabError, match="^e.jsonl holds no record: a JSONL workload has one conversation"):
            workloads_from_bytes(empty, "e.jsonl")
    with pytest.raises(KvlabError, match="not a readable parquet file"):
        workloads_from_bytes(b"PAR1 not really", "s.parquet")
    with pytest.raises(KvlabError, match="choice_eng.jsonl: .*the 'answer' is not one of its 'options'"):
        bad = [{**CHOICE[0], "multi_turns": [{**CHOICE[0]["multi_turns"][0], "answer": "Zed"}]}]
        load_workloads(write_jsonl(tmp_path / "scbench_choice_eng.jsonl", bad))


def test_hub_loading_without_datasets_is_one_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets now raises ImportError
    with pytest.raises(KvlabError, match="needs the datasets package, which is not installed"):
        hub_records("scbench_kv")
    with pytest.raises(KvlabError, match="unknown SCBench task 'scbench_nope'"):
        hub_records("scbench_nope")


@pytest.mark.parametrize("answer, reply, metric, right", [
    ("c3d4", "The value is C3D4.", "contains", True),
    ("c3d4", "The value is c3d5.", "contains", False),
    ("JQZRT\nAOPLE", "JQZRT, AOPLE and more", "contains", True),
    ("JQZRT\nAOPLE", "JQZRT only", "contains", False),
    ("Ivo Petrov\nIvo", "It was ivo.", "contains_any", True),
    ("71432", "The pass key is 71432.", "first_number", True),
    ("71432", "It is 7 or 71432", "first_number", False),
    ("B\nIvo", "B. Ivo", "option", True),
    ("B\nIvo", " A", "option", False),
    ("B\nIvo", "Ivo", "option", True),
    ("C\nNorth", "the answer is: C", "option", True),
    ("C\nNorth", "hmm, maybe D then", "option", False),
])
def test_scbench_metrics(answer: str, reply: str, metric: str, right: bool) -> None:
    assert score_reply(answer, reply, metric) is right


def test_metric_round_trips_through_kvlab_json_and_is_checked() -> None:
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "B. Ivo", "answer": "B\nIvo", "metric": "option"}]
    conv = parse_conversation(messages)
    assert conv.turns[0].metric == "option"
    assert parse_conversation(conversation_to_json(conv)) == conv
    with pytest.raises(KvlabError, match="message 2: unknown metric 'fuzzy'; choose from contains, contains_any"):
        parse_conversation([messages[0], {**messages[1], "metric": "fuzzy"}])
    with pytest.raises(KvlabError, match="'metric' needs an 'answer'"):
        parse_conversation([messages[0], {"role": "assistant", "content": "x", "metric": "option"}])


@pytest.mark.slow
def test_both_modes_run_and_score_by_the_tasks_metric(tiny: LoadedModel, tmp_path: Path) -> None:
    convs = load_workloads(write_jsonl(tmp_path / "scbench_choice_eng.jsonl", CHOICE))
    convs += load_workloads(write_jsonl(tmp_path / "scbench_passkey.jsonl", PASSKEY))
    settings = ArenaSettings(policies=("full", "streamingllm"), budgets=(32,), max_new_tokens=3,
                             modes=("multi-turn", "single-shot"))
    table = run_arena(tiny, convs, settings)
    assert set(table["mode"]) == {"multi-turn", "single-shot"} and table["error"].isna().all()
    assert set(table.loc[table.workload == "scbench_choice_eng-b1", "metric"]) == {"option"}
    assert set(table.loc[table.workload == "scbench_passkey-3", "metric"]) == {"first_number"}
    for row in table.itertuples():
        assert row.scored and row.correct == score_reply(row.answer, row.reply, row.metric)
    assert len(table[(table["mode"] == "single-shot") & (table["turn"] == 2)]) == 4  # 2 sessions × 2 policies


@pytest.mark.slow
def test_a_long_context_is_cut_in_the_middle_to_fit(tiny: LoadedModel, tmp_path: Path) -> None:
    words = " ".join(f"w{i}" for i in range(4000))  # about 12k tokens; the tiny model holds 2048
    record = {"id": 1, "context": f"HEAD-MARK {words} TAIL-MARK",
              "multi_turns": [{"input": "What is the pass key?", "answer": "12345"},
                              {"input": "Say it again.", "answer": "12345"}]}
    conv = load_workloads(write_jsonl(tmp_path / "scbench_passkey.jsonl", [record]))[0]
    fitted = fit_to_context(conv, tiny, max_new_tokens=8)
    first = fitted.turns[0].user
    assert first.startswith("There is an important info hidden") and "HEAD-MARK" in first
    assert "TAIL-MARK" in first and first.endswith("What is the pass key?")
    assert "w2000 " not in first and len(first) < len(conv.turns[0].user)
    assert "cut in the middle" in fitted.notice and "tiny-llama's context of 2048" in fitted.notice
    table = run_arena(tiny, [fitted], ArenaSettings(policies=("full",), budgets=(64,), max_new_tokens=8))
    assert table["error"].isna().all() and table["total_tokens"].max() <= 2048
    short = load_workloads(write_jsonl(tmp_path / "scbench_kv.jsonl", KV))[0]
    assert fit_to_context(short, tiny, 8) is short  # what fits is not touched


@pytest.mark.slow
def test_chat_command_runs_a_record_and_says_what_it_cut(tiny: LoadedModel, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(chat_command, "load_model", lambda *a, **k: tiny)
    long = {"id": 5, "context": " ".join(f"w{i}" for i in range(4000)),
            "multi_turns": [{"input": "Key?", "answer": "zz"}]}
    path = write_jsonl(tmp_path / "scbench_kv.jsonl", [*KV, long])
    out = tmp_path / "r.json"
    assert main(["chat", "--conversation", str(path), "--record", "5", "--policies", "full", "--budget", "32",
                 "--max-new-tokens", "2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["conversation"] == "scbench_kv-5" and "cut in the middle" in data["notice"]
    assert data["turns"][0]["metric"] == "contains"
    assert "cut in the middle" in capsys.readouterr().err
    assert main(["chat", "--conversation", str(path), "--record", "99", "--out", str(out)]) == 2
    assert "no record with id '99'" in capsys.readouterr().err


def test_a_mixed_tasks_turns_are_scored_by_their_own_tasks_metric_and_an_unknown_one_not_at_all(
        tmp_path: Path) -> None:
    mixed = [{"id": 1, "context": "def add(a, b): return a + b\n" + KV[0]["context"], "multi_turns": [
        {"input": "Repeat the function that adds.", "answer": "def add(a, b): return a + b", "task": "scbench_repoqa"},
        {"input": 'Key: "a1b2"\nThe value is: ', "answer": "c3d4", "task": "scbench_kv"},
        {"input": "What is the pass key?", "answer": "71432", "task": "scbench_nope"}]}]
    [conv] = load_workloads(write_jsonl(tmp_path / "scbench_repoqa_and_kv.jsonl", mixed))
    repoqa, kv, unknown = conv.turns
    assert repoqa.answer is None and (kv.answer, kv.metric) == ("c3d4", "contains")
    assert unknown.answer is None  # not "contains" by default: a metric kvlab cannot name is no score
    assert "2 turn(s) not scored" in conv.description and "or their task unknown" in conv.description


def test_every_task_names_a_metric_kvlab_scores_by_and_a_misspelt_one_is_refused() -> None:
    assert {t.metric for t in TASKS.values()} <= {"contains", "first_number", "option", "contains_any", None}
    assert task_of("scbench_repoqa_and_kv.jsonl") == "scbench_repoqa_and_kv" and task_of("scbench_x.jsonl") is None
    with pytest.raises(KvlabError, match="unknown metric 'contain'"):
        ScbenchTask("scbench_new", "New", "a new task", "contain")
