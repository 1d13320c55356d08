"""``kvlab bench --profile``: a follow-up's phases add up to its time, and its counts are what the turn does."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from device_reads import Reads

from kvlab.cli import main
from kvlab.engine.facts import LoadedModel
from kvlab.experiments import turn_profile
from kvlab.experiments.turn_profile import OpTime, SideProfile, profile_follow_up, profile_text
from kvlab.workloads.chat.settings import ChatSettings

SIDES = [("full",), ("full", "h2o", "streamingllm")]


def test_phases_add_up_to_the_follow_up_and_progress_moves_forward(tiny: LoadedModel) -> None:
    seen: list[float] = []
    profiles = profile_follow_up(tiny, SIDES, context_tokens=40, new_tokens=3, budget=16, runs=1,
                                 progress=lambda done, _: seen.append(done))
    assert [p.policies for p in profiles] == SIDES
    for p in profiles:
        assert len(p.seconds) == 1 and p.seconds[0] > 0
        assert math.isclose(sum(p.phases.values()), p.seconds[0], rel_tol=1e-9)  # marks to the end, nothing lost
        assert {"prefilling your message", "decoding the replies", "feeding the reply"} <= set(p.phases)
        assert p.kernels == 0  # a CPU launches no kernels
        assert p.ops and all(o.calls > 0 for o in p.ops)
        assert [o.host_ms for o in p.ops] == sorted((o.host_ms for o in p.ops), reverse=True)
    assert "evicting after your message" in profiles[1].phases
    assert seen == sorted(seen) and 0 <= seen[0] and seen[-1] < 1


def test_device_reads_are_the_values_the_follow_up_reads(tiny: LoadedModel) -> None:
    """The profiled count equals a dispatch-level count of the same follow-up on a fresh session."""
    settings = ChatSettings(policies=SIDES[1], budget=16, max_new_tokens=3)
    user = tiny.decode(turn_profile.prose_ids(tiny, 40)) + turn_profile.TURN_REQUEST
    profiled = profile_follow_up(tiny, SIDES[1:], context_tokens=40, new_tokens=3, budget=16, runs=1)[0]
    session = turn_profile.ChatSession(tiny, settings)
    session.run_turn(user)
    Reads.count = 0
    with Reads():
        session.run_turn(turn_profile.FOLLOW_UP)
    assert Reads.count > 0 and profiled.device_reads == Reads.count


def test_the_text_puts_the_sides_phases_side_by_side() -> None:
    ops = [OpTime("aten::mm", 10, 5.0, 0.0)]
    full = SideProfile(("full",), [1.0, 1.2, 1.1], {"decoding the replies": 0.8, "evicting after the reply": 0.001},
                       ops, 22, 0)
    many = SideProfile(SIDES[1], [2.0, 2.4, 2.2], {"decoding the replies": 1.2, "evicting after the reply": 0.05},
                       ops, 66, 0)
    text = profile_text([full, many], 1024, "cpu (float32)")
    assert "A follow-up after 1024 tokens on cpu (float32)" in text and "median of 3 runs" in text
    assert "3 policies: full, h2o, streamingllm" in text
    decoding = next(line for line in text.splitlines() if line.startswith("decoding the replies"))
    assert "0.800 s" in decoding and "1.200 s" in decoding and "1.50×" in decoding
    evicting = next(line for line in text.splitlines() if line.startswith("evicting after the reply"))
    assert "×" not in evicting  # no ratio over a phase of a millisecond
    whole = next(line for line in text.splitlines() if line.startswith("whole follow-up"))
    assert "1.100 s" in whole and "2.00×" in whole and "(2.00–2.40 s)" in text
    assert "3 policies, one profiled follow-up" in text and "66 values read from the device" in text
    assert "device ms" not in text  # no device timed the operators


@pytest.mark.model
def test_the_cli_prints_and_writes_the_profile(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "profile.json"
    assert main(["bench", "--profile", "--policies", "h2o", "--context", "64", "--runs", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [s["policies"] for s in data["sides"]] == [["full"], ["full", "h2o"]]
    assert data["context_tokens"] == 64 and data["text"] in capsys.readouterr().out
    assert all(s["phases"]["decoding the replies"] > 0 for s in data["sides"])
