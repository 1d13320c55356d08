"""Several sessions on the one shared model at once: no cross-talk; save → JSON → replay is identical."""

from __future__ import annotations

import json
import threading
from typing import Iterator

import pytest
import torch

from kvlab.engine.facts import LoadedModel
from kvlab.workloads.chat.records import TurnResult
from kvlab.workloads.chat.replay import replay_session, session_to_json
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.settings import ChatSettings

SETTINGS = ChatSettings(policies=("streamingllm", "snapkv"), budget=32, max_new_tokens=5)
CONVERSATIONS = [
    ["My locker combination is 31-07-22. Please remember it.", "What is my locker combination?"],
    ["Name three rivers in Europe and the seas they flow into."],
    ["The boat key number is 40917 and the shed code is 5521. Repeat the shed code."],
]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """Three Python threads each driving a 2-thread OpenMP pool oversubscribe 2 cores badly (minutes per
    turn on a busy machine); what is tested here is kvlab's shared state, which threads do not change."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run_alone(lm: LoadedModel, messages: list[str]) -> ChatSession:
    session = ChatSession(lm, SETTINGS)
    for message in messages:
        session.run_turn(message)
    return session


def assert_same_turns(a: list[TurnResult], b: list[TurnResult]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.user, x.reply, x.total_tokens, x.segments) == (y.user, y.reply, y.total_tokens, y.segments)
        assert x.policies.keys() == y.policies.keys()
        for name, p in x.policies.items():
            q = y.policies[name]
            assert p.error is None and q.error is None
            assert p.reply == q.reply
            assert p.retained == q.retained
            assert p.cache_tokens == q.cache_tokens and p.kv_bytes == q.kv_bytes and p.blocks == q.blocks
            assert p.kl == pytest.approx(q.kl, abs=1e-6) and p.top1 == q.top1
            for row_p, row_q in zip(p.sink_mass, q.sink_mass):
                assert row_p == pytest.approx(row_q, abs=1e-6)


@pytest.mark.model
def test_three_sessions_at_once_equal_each_run_alone(model: LoadedModel) -> None:
    alone = [run_alone(model, messages) for messages in CONVERSATIONS]
    results: list[ChatSession | None] = [None] * len(CONVERSATIONS)
    errors: list[BaseException] = []
    start = threading.Barrier(len(CONVERSATIONS))

    def worker(i: int) -> None:
        try:
            start.wait()
            results[i] = run_alone(model, CONVERSATIONS[i])
        except BaseException as exc:  # surfaced in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(CONVERSATIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    for solo, together in zip(alone, results):
        assert together is not None
        assert_same_turns(solo.turns, together.turns)
    # the three conversations really differ, so a mix-up would have shown
    assert len({s.turns[0].reply for s in alone}) == len(alone)


@pytest.mark.model
def test_save_json_replay_gives_identical_records(model: LoadedModel) -> None:
    session = ChatSession(model, ChatSettings(policies=("h2o", "pyramidkv"), budget=24, max_new_tokens=4),
                          system="You are a terse assistant.")
    session.run_turn("My vault code is 27182.")
    session.run_turn("What is my vault code?", golden="Your vault code is 27182.", prefill="Your vault code is",
                     answer="27182")
    data = json.loads(json.dumps(session_to_json(session)))
    again = replay_session(model, data)
    assert again.settings == session.settings and again.system == session.system
    assert_same_turns(session.turns, again.turns)
    assert again.turns[1].reply_source == "golden" and again.turns[1].policies["full"].correct is not None
    assert json.loads(json.dumps(session_to_json(again)))["turns"][1]["answer"] == "27182"
