"""Saved runs open without the model: stamps, JSON refusals, chat sessions, RAG runs and lesson runs read back."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from kvlab import __version__
from kvlab.cli.printing import print_replay
from kvlab.engine.facts import LoadedModel
from kvlab.errors import KvlabError
from kvlab.experiments.arena_record import arena_from_json
from kvlab.experiments.plan import ArenaSettings
from kvlab.experiments.runner import run_arena
from kvlab.experiments.seed_table import seed_cells
from kvlab.experiments.tables import accuracy_grid, fidelity_vs_budget, memory_equal, mode_drop, one_mode, results_json
from kvlab.export import to_json
from kvlab.lessons.base import Lesson, Verdict
from kvlab.lessons.record import lesson_from_json, lesson_record
from kvlab.saved import UNKNOWN, ReplayCheck, Stamp, differences, read_json, same_number, stamp, stamp_of
from kvlab.workloads.chat.conversation import Conversation, Turn
from kvlab.workloads.chat.records import float32_digits, position_runs, positions_of
from kvlab.workloads.chat.replay import replay_session, session_to_json
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.session_file import record_from_json, record_of, replay_differences
from kvlab.workloads.chat.settings import ChatSettings
from kvlab.workloads.rag.corpus import Question
from kvlab.workloads.rag.record import rag_from_json, rag_record
from kvlab.workloads.rag.run import QuestionResult, StrategyResult, results_table


def test_a_stamp_says_when_which_model_and_version_and_old_files_read_unknown() -> None:
    s = stamp_of(stamp("tiny-llama"))
    assert (s.model, s.kvlab_version) == ("tiny-llama", __version__) and s.saved_at.endswith("UTC")
    old = stamp_of({"kvlab_session": 1})
    assert (old.saved_at, old.model, old.kvlab_version) == (UNKNOWN,) * 3
    assert old.label() == "saved unknown · model unknown · kvlab unknown"


def test_every_replay_is_told_in_one_wording_on_the_pages_and_the_cli(capsys: pytest.CaptureFixture) -> None:
    made = Stamp("2026-12-07 06:00 UTC", "smollm2", "0.9")
    same = ReplayCheck([], "every row", made, "smollm2")
    assert same.headline() == ("Replay identical on smollm2: every row equals the file's (saved 2026-12-07 06:00 UTC · "
                               "model smollm2 · kvlab 0.9), timings aside")
    assert print_replay(same, "runs/a.json") is False
    assert capsys.readouterr().out.startswith("Replay identical on smollm2: every row equals runs/a.json's (")
    other = ReplayCheck(["turn 2: KL"], "every row", made, "gemma3-270m")
    assert other.headline().endswith("; the file was made on smollm2, so differences are expected")
    assert replace(other, model="smollm2").headline() == ("The replay on smollm2 differs from the file (saved "
                                                          "2026-12-07 06:00 UTC · model smollm2 · kvlab 0.9)")
    assert print_replay(other, "a.json") is True
    err = capsys.readouterr().err
    assert err.startswith("kvlab: error: the replay on gemma3-270m differs from a.json (")
    assert err.endswith("\n  turn 2: KL\n")


@pytest.mark.parametrize("raw, message", [
    (b"\xff\xfe{}", "not UTF-8 text"),
    (json.dumps({"kvlab_session": 1, "turns": [1, 2]}, indent=1)[:30].encode(), "not valid JSON (line 3,"),
    (b"", "that session file is empty"),
    (b" \n", "that session file is empty"),
])
def test_a_file_that_is_not_json_is_refused_with_where_it_breaks(raw: bytes, message: str) -> None:
    with pytest.raises(KvlabError, match=message.replace("(", r"\(")):
        read_json(raw, "session file")


@pytest.fixture(scope="module")
def saved(tiny: LoadedModel) -> tuple[ChatSession, dict]:
    settings = ChatSettings(policies=("full", "streamingllm"), budget=16, max_new_tokens=3)
    session = ChatSession(tiny, settings, "Be brief.")
    session.run_turn("My locker code is 4127.", golden="Noted.", answer=None)
    session.run_turn("What is my locker code?")
    return session, json.loads(json.dumps(session_to_json(session)))


def test_a_session_file_opens_with_every_record_and_no_model(saved: tuple[ChatSession, dict]) -> None:
    session, data = saved
    live, opened = record_of(session), record_from_json(data)  # record_from_json takes no model: nothing runs
    assert opened.settings == live.settings and opened.system == "Be brief."
    assert [t.to_dict() for t in opened.turns] == json.loads(json.dumps([t.to_dict() for t in live.turns]))
    assert opened.texts == live.texts and len(opened.texts) == session.total_tokens
    assert opened.windows == live.windows
    assert opened.stamp.model == session.lm.facts.name and opened.stamp.kvlab_version == __version__


@pytest.mark.parametrize("positions, runs", [
    ([], []), ([5], [5]), ([0, 1], [0, 1]), (list(range(300)), [[0, 300]]),
    ([0, 1, 2, 3, 7, 9, 10, 11, 20], [[0, 4], 7, [9, 12], 20]), ([4, 3, 2, 5, 6, 7], [4, 3, 2, [5, 8]]),
])
def test_kept_positions_are_written_as_runs_and_read_back_exactly(positions: list[int], runs: list) -> None:
    assert position_runs(positions) == runs
    assert positions_of(json.loads(json.dumps(runs))) == positions
    assert positions_of(positions) == positions  # files written before runs hold plain positions


@pytest.mark.parametrize("bad", [[[1, 2, 3]], ["7"], [[1.5, 3]], [None]])
def test_a_malformed_run_is_refused(bad: list) -> None:
    with pytest.raises(TypeError, match="number or a \\[first, end\\] run"):
        positions_of(bad)


def test_the_profile_is_written_with_float32s_digits_and_reads_back_the_same_float32s() -> None:
    values = (np.random.default_rng(0).random(1000, dtype=np.float32) ** 6).tolist() + [0.0, 1.0]
    written = float32_digits(values)
    assert np.array_equal(np.asarray(written, dtype=np.float32), np.asarray(values, dtype=np.float32))
    assert len(json.dumps(written)) < 0.65 * len(json.dumps(values))


def test_a_session_file_holds_full_s_kept_positions_as_one_run_per_head(saved: tuple[ChatSession, dict]) -> None:
    session, data = saved
    assert data["kvlab_session"] == 2
    full = data["turns"][-1]["policies"]["full"]["retained"]
    assert full == [[[[0, session.total_tokens]]] * len(heads) for heads in full]
    old = json.loads(json.dumps(data))  # the same session as format 1 wrote it: plain positions
    old["kvlab_session"] = 1
    for turn in old["turns"]:
        for p in turn["policies"].values():
            p["retained"] = [[positions_of(h) for h in heads] for heads in p["retained"]]
    assert [t.to_dict() for t in record_from_json(old).turns] == [t.to_dict() for t in record_from_json(data).turns]


def test_an_old_file_opens_labelled_unknown_without_token_texts(saved: tuple[ChatSession, dict]) -> None:
    _, data = saved
    old = {k: v for k, v in data.items() if k not in ("saved_at", "model", "kvlab_version", "tokens", "layer_windows")}
    opened = record_from_json(old)
    assert opened.stamp.label() == "saved unknown · model unknown · kvlab unknown"
    assert opened.texts is None and opened.windows == () and len(opened.turns) == 2


@pytest.mark.parametrize("broken, message", [
    ({"kvlab_session": 3}, "a kvlab session file of format 3, which this kvlab \\(formats 1, 2\\) cannot read"),
    ({"kvlab_sessions": 2}, "not a kvlab session file"),
    ({"kvlab_session": 1, "settings": {"policies": ["full"]}, "turns": []}, "holds no turn"),
    ({"kvlab_session": 1, "settings": {"policies": ["full"]}, "turns": [{"index": 0}]}, "incomplete or malformed"),
    ({"kvlab_session": 1, "settings": {"policies": ["nosuch"]}, "turns": []}, "nosuch"),
])
def test_a_malformed_session_file_is_refused_in_words(broken: dict, message: str) -> None:
    with pytest.raises(KvlabError, match=message):
        record_from_json(broken)


def test_a_replay_is_checked_against_the_file(tiny: LoadedModel, saved: tuple[ChatSession, dict]) -> None:
    _, data = saved
    opened = record_from_json(data)
    again = replay_session(tiny, data)
    assert replay_differences(opened.turns, again.turns) == []
    changed = [replace(t, policies=dict(t.policies)) for t in opened.turns]
    changed[1].policies["streamingllm"] = replace(changed[1].policies["streamingllm"], reply="something else",
                                                  kl=(changed[1].policies["streamingllm"].kl or 0) + 0.1)
    assert replay_differences(changed, again.turns) == ["turn 2, streamingllm: reply, KL differ"]
    assert replay_differences(opened.turns[:1], again.turns) == ["turns saved 1, replayed 2"]
    undefined = [replace(t, policies={n: replace(p, kl=math.nan) for n, p in t.policies.items()}) for t in again.turns]
    assert replay_differences(undefined, undefined) == []  # NaN on both sides: the same record
    every = [replace(t, reply="x", policies={n: replace(p, reply="x") for n, p in t.policies.items()})
             for t in opened.turns]
    found = replay_differences(every * 2, again.turns * 2)  # each turn's reply and its two policies': 12 places
    assert len(found) == 9 and found[-1] == "… and 4 more"


def rag_results() -> list[QuestionResult]:
    question = Question(id="q01", question="Who keeps the lighthouse?", answer="Mara", docs=("d03",))
    rows = [StrategyResult("full", 0.2, 1.0, 300, 1.0, 0, 0.0, 1.0, " Mara", True, [0.0, 0.0], [0.0, 0.0], None,
                           0.19, 0.21, 3, 280, 20),
            StrategyResult("naive", 0.05, 4.0, 20, 0.07, 0, 0.4, 0.5, " Tom", False, [0.3, 0.4], [0.2, 0.5], None,
                           0.04, 0.06, 3, 0, 20),
            StrategyResult("promptcache", error="RuntimeError: out of positions")]
    return [QuestionResult(question, [("d03", 7.5), ("d01", 2.25)], 300, " Mara", rows)]


def test_a_rag_run_opens_from_its_file_with_its_stamp() -> None:
    made = stamp_of(stamp("SmolLM2-135M"))
    data = json.loads(to_json(rag_record(rag_results(), made)))
    results, opened = rag_from_json(data)
    assert opened == made
    assert results_table(results).equals(results_table(rag_results()))  # every table and chart drawn from it
    assert results[0].question == rag_results()[0].question and results[0].retrieved == [("d03", 7.5), ("d01", 2.25)]
    # a file saved before the stamp (a bare list) opens, labelled unknown; a reopened file keeps its stamp
    old, unknown = rag_from_json([r.as_dict() for r in rag_results()])
    assert unknown.label() == "saved unknown · model unknown · kvlab unknown" and len(old) == 1
    assert rag_record(results, opened)["saved_at"] == made.saved_at


@pytest.mark.parametrize("broken, message", [
    ({"kvlab_session": 1}, "not a kvlab RAG run"),
    ({"kvlab_rag": 1, "questions": []}, "holds no question"),
    ({"kvlab_rag": 1, "questions": [{"question": {"id": "q", "question": "?"}}]}, "incomplete or malformed"),
])
def test_a_malformed_rag_file_is_refused_in_words(broken: dict, message: str) -> None:
    with pytest.raises(KvlabError, match=message):
        rag_from_json(broken)


LESSON = Lesson("sinks", "Attention sinks", "the first tokens draw attention", "one conversation",
                run=lambda lm, progress: {}, verdict=lambda r: Verdict("supports", f"{r['share']:.0%} on token 0"),
                figures=lambda r: [])


def test_a_lesson_run_opens_from_its_file_and_its_verdict_is_drawn_from_the_result() -> None:
    made = stamp_of(stamp("SmolLM2-135M"))
    result = {"share": 0.42, "model": "SmolLM2-135M"}
    data = json.loads(to_json(lesson_record(LESSON, result, LESSON.verdict(result), made)))
    lesson, opened, when = lesson_from_json(data, {"sinks": LESSON})
    assert lesson is LESSON and opened == result and when == made
    assert data["verdict"] == {"outcome": "supports", "text": "42% on token 0"}
    old = {k: v for k, v in data.items() if k in ("lesson", "claim", "preset", "verdict", "result")}
    assert lesson_from_json(old, {"sinks": LESSON})[2].label() == "saved unknown · model unknown · kvlab unknown"


@pytest.mark.parametrize("broken, message", [
    ({"kvlab_session": 1}, "not a kvlab lesson run"),
    ({"lesson": "nosuch", "result": {}}, "'nosuch' is not one of this kvlab's: sinks"),
    ({"lesson": ["sinks"], "result": {}}, "\\['sinks'\\] is not one of this kvlab's"),
    ({"lesson": "sinks", "result": {"other": 1}}, "does not fit the lesson “Attention sinks” \\(KeyError"),
])
def test_a_lesson_file_that_does_not_fit_is_refused_in_words(broken: dict, message: str) -> None:
    with pytest.raises(KvlabError, match=message):
        lesson_from_json(broken, {"sinks": LESSON})


def test_an_arena_run_opens_from_its_json_with_every_summary_as_the_run_drew_it(tiny: LoadedModel) -> None:
    conv = Conversation("vault", "two questions", None, (
        Turn("The vault code is 4127.", golden="Noted.", answer=None),
        Turn("What is the vault code?", prefill="The vault code is", answer="4127")))
    settings = ArenaSettings(policies=("streamingllm", "window"), budgets=(8, 16), max_new_tokens=2,
                             modes=("multi-turn", "single-shot"))
    table = run_arena(tiny, [conv], settings)
    data = json.loads(to_json({**results_json(table, settings, "tiny-llama", ["vault"]), **stamp("tiny-llama")}))
    saved = arena_from_json(data)
    assert saved.settings == settings and saved.workloads == ["vault"] and saved.stamp.model == "tiny-llama"
    for summary in (lambda t: accuracy_grid(one_mode(t)), lambda t: fidelity_vs_budget(one_mode(t)),
                    lambda t: memory_equal(one_mode(t)), mode_drop, seed_cells):
        pd.testing.assert_frame_equal(summary(saved.table), summary(table), check_dtype=False)
    assert arena_from_json({k: v for k, v in data.items() if k != "saved_at"}).stamp.saved_at == UNKNOWN
    with pytest.raises(KvlabError, match="holds no result rows"):
        arena_from_json({**data, "rows": []})
    with pytest.raises(KvlabError, match="not a kvlab arena run"):
        arena_from_json({"kvlab_rag": 1})
    # a plug-in's policy not loaded here: the file is sound, the message says how to load the plug-in
    unloaded = {**data, "settings": {**data["settings"], "policies": ["full", "sinkvote"]}}
    with pytest.raises(KvlabError, match=r"^this run used 'sinkvote', which is not among the policies loaded here: "
                                         r"a plug-in's\? Load its file first \(--policy-file"):
        arena_from_json(unloaded)
    with pytest.raises(KvlabError, match="conversations are malformed"):
        arena_from_json({**data, "conversations": [{"turns": "none"}]})


def test_differences_name_each_place_a_rerun_differs_timings_aside() -> None:
    saved = {"edits": [{"reused": 10, "reprefill_ms": 5.0, "kl": 0.25}], "ttft": {"full": 1.0}, "reply": "yes",
             "nan": float("nan"), "turn_s": 3.0}
    again = {"edits": [{"reused": 11, "reprefill_ms": 9.0, "kl": 0.25 + 1e-9}], "ttft": {"full": 2.0},
             "reply": "no", "nan": float("nan"), "turn_s": 4.0}
    assert differences(saved, saved) == []
    assert differences(saved, again) == ["the record.edits[0].reused: 10 in the file, 11 in the re-run",
                                         "the record.reply: 'yes' in the file, 'no' in the re-run"]
    assert differences([1, 2], [1]) == ["the record: 2 items in the file, 1 in the re-run"]
    assert differences({"a": 1}, {"b": 1}) == ["the record.a: only in the file", "the record.b: only in the re-run"]
    assert differences(list(range(20)), list(range(1, 21)), most=3)[-1] == "… and 17 more"
    assert same_number(None, None) and not same_number(None, 0.0) and not same_number(0.0, None)  # no score ≠ 0


def test_a_scripted_session_replays_with_its_script_and_its_turns_to_come(tiny: LoadedModel) -> None:
    """A walk found a replayed scripted session without its script: its remaining turns could not be played."""
    script = Conversation(name="jars", description="three turns", system="Be brief.", turns=(
        Turn(user="Shelf 3 holds jar 103.", golden="Noted."), Turn(user="Shelf 4 holds jar 104.", golden="Noted."),
        Turn(user="What does shelf 3 hold?", golden="Jar 103.", answer="103")))
    session = ChatSession(tiny, ChatSettings(policies=("full", "streamingllm"), budget=16, max_new_tokens=3),
                          script.system, script=script)
    session.run_turn(script.turns[0].user, golden=script.turns[0].golden)
    data = json.loads(json.dumps(session_to_json(session)))
    again = replay_session(tiny, data)
    assert again.script == script and len(again.turns) == 1  # the turns to come are there to play
    assert replay_differences(record_from_json(data).turns, again.turns) == []
    live = json.loads(json.dumps(session_to_json(ChatSession(tiny, ChatSettings(policies=("full",)), None))))
    assert live["script"] is None  # a live chat has none
    data["script"]["messages"][1]["content"] = "Shelf 9 holds jar 109."
    with pytest.raises(KvlabError, match="script does not begin with the turns it saved"):
        replay_session(tiny, data)
