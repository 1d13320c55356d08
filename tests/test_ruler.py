"""RULER-style tasks (issue 21 item 4), generated with the embedded tokenizer alone: reproducible by seed,
needles where the generator says, lengths within 2 % of the request, both variants, and the command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from kvlab.cli import main
from kvlab.errors import KvlabError
from kvlab.workloads.chat.files import load_workloads
from kvlab.workloads.chat.metrics import references
from kvlab.workloads.chat.ruler import FAMILIES, TASKS, generate
from kvlab.workloads.chat.ruler_text import NOISE


@pytest.fixture(scope="module")
def encode(tokenizer: PreTrainedTokenizerBase):
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


def counted(encode, sample) -> int:
    """RULER's count, recomputed here: every message and answer prefix, plus the tokens to generate."""
    gen = FAMILIES[TASKS[sample.task].family].tokens_to_generate
    return sum(len(encode(t.user)) + len(encode(" " + t.prefill)) + gen for t in sample.conversation.turns)


@pytest.mark.slow
def test_the_same_seed_gives_the_same_samples(encode) -> None:
    for task in ("niah_single_2", "vt", "cwe", "fwe"):
        a = generate(task, 1024, 2, seed=3, encode=encode)
        b = generate(task, 1024, 2, seed=3, encode=encode)
        assert [s.conversation for s in a] == [s.conversation for s in b]
        assert a[0].conversation.turns != a[1].conversation.turns  # each sample draws its own
        other = generate(task, 1024, 1, seed=4, encode=encode)[0]
        assert other.conversation.turns[0].answer != a[0].conversation.turns[0].answer


@pytest.mark.parametrize("task", [t for t, spec in TASKS.items() if spec.family in ("niah", "vt")])
def test_the_needles_are_where_the_generator_says(encode, task: str) -> None:
    sample = generate(task, 1024, 1, seed=1, encode=encode)[0]
    first = sample.conversation.turns[0].user
    a = TASKS[task].args
    assert len(sample.needles) == (max(a["n_k"], a["n_q"]) * a["n_v"] if "n_k" in a else a["num_hops"] + 1)
    for needle in sample.needles:
        assert first[needle.char:needle.char + len(needle.text)] == needle.text
        assert needle.token == len(encode(first[:needle.char]))
    planted = " ".join(n.text for n in sample.needles)
    assert all(ref in planted for ref in references(sample.conversation.turns[0].answer))
    if task == "niah_single_1":
        assert first.count(NOISE) > 10  # RULER's repeated noise sentences


@pytest.mark.slow
@pytest.mark.parametrize("task", list(TASKS))
def test_lengths_are_within_two_percent_of_the_request(encode, task: str) -> None:
    sample = generate(task, 4096, 1, seed=0, encode=encode)[0]
    assert sample.tokens == counted(encode, sample)
    assert 0.98 * 4096 <= sample.tokens <= 4096


def test_cwe_past_its_word_list_gives_the_longest_sample_it_can_and_says_so() -> None:
    [sample] = generate("cwe", 8192, 1, seed=0, encode=str.split)  # a word a token: the list runs out before 8192
    assert 4096 < sample.tokens < 8192 and f"{sample.tokens} tokens of 8192 requested" in \
        sample.conversation.description


def test_cwe_too_short_for_its_ten_words_is_refused_not_asked_of_fewer(encode) -> None:
    """A walk's cwe at 512 tokens listed one word six times and asked for the 10 most common."""
    with pytest.raises(KvlabError, match="cwe with its questions needs more than 600 tokens"):
        generate("cwe", 600, 1, seed=0, encode=encode)
    [sample] = generate("cwe", 800, 1, seed=0, encode=encode)
    assert len(sample.conversation.turns[0].answer.split("\n")) == 10


def test_the_multi_turn_variant_asks_one_query_per_turn(encode) -> None:
    single = generate("niah_multiquery", 1024, 1, seed=2, encode=encode)[0]
    multi = generate("niah_multiquery", 1024, 1, seed=2, encode=encode, multi_turn=True)[0]
    one = single.conversation.turns
    assert len(one) == 1 and len(references(one[0].answer)) == 4 and one[0].prefill.startswith("The special magic")
    turns = multi.conversation.turns
    assert len(turns) == 4 and all(len(references(t.answer)) == 1 for t in turns)
    assert all(t.user.startswith("What is the special magic number for") for t in turns[1:])
    assert sorted(r for t in turns for r in references(t.answer)) == sorted(references(one[0].answer))
    assert all(t.golden.startswith(t.prefill) and t.answer in t.golden for t in turns)
    assert 0.98 * 1024 <= multi.tokens <= 1024 and multi.tokens == counted(encode, multi)
    vt = generate("vt", 1024, 1, seed=0, encode=encode, multi_turn=True, questions=3)[0]
    assert len(vt.conversation.turns) == 3 and len(vt.needles) == 15
    assert vt.conversation.turns[1].user.startswith("Question: Find all variables that are assigned the value")


@pytest.mark.parametrize("kwargs, message", [
    (dict(task="niah_nope"), "unknown RULER task 'niah_nope'"),
    (dict(task="cwe", questions=2), "cwe asks one question"),
    (dict(task="vt", questions=2), "use the multi-turn variant"),
    (dict(task="niah_single_1", length=100), "outside what kvlab generates for a RULER task: 256 to 131,072"),
    (dict(task="niah_single_1", length=10_000_000), "outside what kvlab generates"),
    (dict(task="niah_multikey_1", questions=50), "at most 40 needles"),
    # a walk got "cwe-512-mt-s0-0: 1 turn(s)": a multi-turn variant of one turn, named as one
    (dict(task="cwe", multi_turn=True), "cwe asks one question, so it has no multi-turn variant"),
    (dict(task="niah_single_1", multi_turn=True), "its multi-turn variant would be one turn: ask 2 or more"),
    # a CLI walk: the value refused was not said, a negative seed named a sample "s-1", and "a longer length" said
    # not how long
    (dict(task="niah_single_1", questions=0), "questions must be between 1 and 64, not 0"),
    (dict(task="niah_single_1", seed=-1), "the seed must be 0 or more, not -1"),
    (dict(task="vt", length=512, multi_turn=True, questions=2),
     r"vt with its questions needs more than 512 tokens \(its smallest sample here takes [\d,]+\); ask for [\d,]+ or"),
])
def test_bad_requests_are_refused_in_words(encode, kwargs: dict, message: str) -> None:
    args = {"length": 1024, "samples": 1, "seed": 0, "encode": encode} | kwargs
    with pytest.raises(KvlabError, match=message):
        generate(**args)


@pytest.mark.slow
def test_the_command_writes_workloads_and_a_manifest(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "niah.jsonl"
    assert main(["tasks", "ruler", "--task", "niah_multikey_1", "--length", "1024", "--samples", "2", "--seed", "5",
                 "--out", str(out)]) == 0
    convs = load_workloads(out)
    assert [c.name for c in convs] == ["niah_multikey_1-1024-s5-0", "niah_multikey_1-1024-s5-1"]
    manifest = [json.loads(line) for line in out.with_suffix(".manifest.jsonl").read_text().splitlines()]
    for conv, record in zip(convs, manifest):
        first = conv.turns[0].user
        assert record["name"] == conv.name and record["answers"] == [references(conv.turns[0].answer)]
        assert all(first[n["char"]:].startswith(n["text"]) for n in record["needles"])
        assert 0.98 * 1024 <= record["tokens"] <= 1024
    assert "wrote" in capsys.readouterr().out
    assert load_workloads(out, record="niah_multikey_1-1024-s5-1") == convs[1:]
    one = tmp_path / "vt.json"
    assert main(["tasks", "ruler", "--task", "vt", "--length", "1024", "--multi-turn", "--questions", "2",
                 "--out", str(one)]) == 0
    assert len(load_workloads(one)[0].turns) == 2
    assert main(["tasks", "ruler", "--task", "vt", "--length", "1024", "--samples", "2", "--out", str(one)]) == 2
    assert "a .json file holds one sample" in capsys.readouterr().err


def test_samples_past_the_models_context_are_written_with_a_note(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "long.json"
    assert main(["tasks", "ruler", "--task", "niah_single_1", "--length", "9000", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "longer than the trained context of SmolLM2-135M-Instruct (8,192 tokens)" in err and out.exists()
    assert main(["tasks", "ruler", "--task", "niah_single_1", "--length", "8000", "--out", str(out)]) == 0
    assert capsys.readouterr().err == ""
