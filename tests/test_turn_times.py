"""A turn's times: one wall-clock time per turn, each policy's own work apart from its share of the batch."""

from __future__ import annotations

import pytest

from kvlab.engine.facts import LoadedModel
from kvlab.workloads.chat.records import PolicyTurn, TurnResult, turn_table
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.settings import ChatSettings


def test_own_work_is_apart_from_the_even_share_of_the_batch(tiny: LoadedModel) -> None:
    session = ChatSession(tiny, ChatSettings(policies=("full", "snapkv", "kvzip"), budget=8, max_new_tokens=3))
    turn = session.run_turn("The locker code is 4417 and the spare key hangs behind the door.")
    full, snapkv, kvzip = (turn.policies[n] for n in ("full", "snapkv", "kvzip"))
    assert full.shared_s > 0 and full.shared_s == pytest.approx(snapkv.shared_s, rel=1e-9)  # one batch, split evenly
    assert full.own_s == full.evict_s and snapkv.own_s == snapkv.evict_s > 0  # no pass of their own
    assert kvzip.extra_prefill_tokens > 0 and kvzip.own_s == kvzip.evict_s + kvzip.extra_prefill_s > snapkv.own_s
    assert turn.turn_s >= max(p.time_s for p in turn.policies.values())
    assert turn.turn_s <= sum(p.time_s for p in turn.policies.values()) + 0.5  # what the turn did is what they spent
    table = turn_table([turn])
    assert set(table["turn_s"]) == {turn.turn_s}
    assert table.set_index("policy")["own_s"].to_dict() == {n: p.own_s for n, p in turn.policies.items()}


def test_a_record_from_before_the_split_reads_its_time_as_share_and_own_work() -> None:
    old = {"policy": "kvzip", "time_s": 3.0, "evict_s": 0.25, "extra_prefill_s": 1.5, "extra_prefill_tokens": 40}
    rec = PolicyTurn.from_dict(old)
    assert (rec.shared_s, rec.own_s, rec.time_s) == (1.25, 1.75, 3.0)
    turn = TurnResult.from_dict({"index": 0, "user": "u", "reply": "r", "reply_source": "full", "prefill": "",
                                 "answer": None, "total_tokens": 3, "segments": [], "profile": [],
                                 "policies": {"kvzip": old}})
    assert turn.turn_s is None and turn.policies["kvzip"] == rec
