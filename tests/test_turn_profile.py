"""``kvlab profile``: a follow-up's phases add up to its time, its counts are what the turn does, a failure shows."""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path

import pytest
from device_reads import Reads

from kvlab import __version__
from kvlab.cli import main
from kvlab.engine.facts import LoadedModel
from kvlab.experiments import turn_profile
from kvlab.experiments.turn_profile import OpTime, SideProfile, phase_name, profile_follow_up, profile_text
from kvlab.policies.h2o import H2O
from kvlab.workloads.chat.settings import ChatSettings

SIDES = [("full",), ("full", "h2o", "streamingllm")]


def test_phases_add_up_to_the_run_shown_and_progress_moves_forward(tiny: LoadedModel,
                                                                    capfd: pytest.CaptureFixture) -> None:
    seen: list[float] = []
    profiles = profile_follow_up(tiny, SIDES, context_tokens=40, new_tokens=3, budget=16, runs=3,
                                 progress=lambda done, _: seen.append(done))
    assert [p.policies for p in profiles] == SIDES
    for p in profiles:
        assert len(p.seconds) == 3 and min(p.seconds) > 0 and not p.errors
        # the phases shown are one run's, the run of median length: they add up to it, nothing lost
        assert math.isclose(sum(p.phases.values()), statistics.median_low(p.seconds), rel_tol=1e-9)
        assert list(p.phases)[-1] == "recording what each cache holds"  # the turn's tail is its own phase
        assert {"prefilling your message", "decoding the replies", "feeding the reply"} <= set(p.phases)
        assert p.kernels == 0 and p.waits == 0  # a CPU launches no kernels and the host never waits for it
        assert p.ops and all(o.calls > 0 for o in p.ops)
        assert [o.host_ms for o in p.ops] == sorted((o.host_ms for o in p.ops), reverse=True)
    assert "evicting after your message" in profiles[1].phases
    assert seen == sorted(seen) and seen[0] == 0 and seen[-1] == 1
    assert "USDT:" not in capfd.readouterr().err  # libkineto's trace lines at the profiler's start and stop


def test_standard_error_loses_only_the_profilers_trace_lines(capfd: pytest.CaptureFixture) -> None:
    with turn_profile._without_trace_lines():
        os.write(2, b"USDT:2026-12-07 00:28:14 3247:3247 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a warning from C++\n")
    assert capfd.readouterr().err == "a warning from C++\n"


def test_reads_are_the_values_the_follow_up_reads(tiny: LoadedModel) -> None:
    """On a CPU the profiled count equals a dispatch-level count of the same follow-up on a fresh session."""
    settings = ChatSettings(policies=SIDES[1], budget=16, max_new_tokens=3)
    user = tiny.decode(turn_profile.prose_ids(tiny, 40)) + turn_profile.TURN_REQUEST
    profiled = profile_follow_up(tiny, SIDES[1:], context_tokens=40, new_tokens=3, budget=16, runs=1)[0]
    session = turn_profile.ChatSession(tiny, settings)
    session.run_turn(user)
    Reads.count = 0
    with Reads():
        session.run_turn(turn_profile.FOLLOW_UP)
    assert Reads.count > 0 and profiled.reads == Reads.count


def test_a_policy_that_fails_is_named_not_measured(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: H2O, view: object) -> None:
        raise RuntimeError("scores broke")

    monkeypatch.setattr(H2O, "scores", broken)
    profiles = profile_follow_up(tiny, SIDES, context_tokens=40, new_tokens=3, budget=16, runs=1)
    assert profiles[0].errors == [] and profiles[1].errors == ["h2o: RuntimeError: scores broke"]
    failed = profiles[1]
    assert (failed.seconds, failed.phases, failed.ops, failed.reads) == ([], {}, [], None)  # no number for that side
    text = profile_text(profiles, 40, "tiny")
    assert "FAILED: h2o: RuntimeError: scores broke" in text
    whole = next(line for line in text.splitlines() if line.startswith("whole follow-up"))
    assert whole.split()[-1] == "FAILED" and "×" not in whole
    assert "3 policies: not profiled" in text and text.count("item/int/bool reads") == 1  # Full alone's only


def test_phase_names_drop_their_counts() -> None:
    assert phase_name("feeding the reply (17 tokens) to every cache that does not hold it yet") == "feeding the reply"
    assert phase_name("KVzip: repeating 18 new tokens (an extra prefill)") == "KVzip: repeating N new tokens"


def test_the_text_puts_the_sides_phases_side_by_side() -> None:
    ops = [OpTime("aten::mm", 10, 5.0, 0.0)]
    full = SideProfile(("full",), [1.0, 1.2, 1.1], {"decoding the replies": 0.8, "evicting after the reply": 0.001},
                       ops, 22, 0, 0, [])
    many = SideProfile(SIDES[1], [2.0, 2.4, 2.2], {"evicting after your message": 0.1, "decoding the replies": 1.2,
                                                   "evicting after the reply": 0.05}, ops, 66, 0, 0, [])
    text = profile_text([full, many], 1024, "SmolLM2 on cpu (float32)")
    lines = text.splitlines()
    assert lines[0] == "A follow-up after 1024 tokens of prose: SmolLM2 on cpu (float32)"
    assert "run of median length of 3" in text and "3 policies: full, h2o, streamingllm" in text
    rows = [line.split("  ")[0] for line in lines if line[:1].isalpha() and "  " in line]
    assert rows[:4] == ["evicting after your message", "decoding the replies", "evicting after the reply",
                        "whole follow-up"]  # the order they ran in, from the side that ran them all
    decoding = next(line for line in lines if line.startswith("decoding the replies"))
    assert "0.800 s" in decoding and "1.200 s" in decoding and "1.50×" in decoding
    assert "×" not in next(line for line in lines if line.startswith("evicting after the reply"))  # not over 1 ms
    whole = next(line for line in lines if line.startswith("whole follow-up"))
    assert "1.100 s" in whole and "2.00×" in whole and "(2.00–2.40 s)" in text
    assert "3 policies, one profiled follow-up" in text and "66 item/int/bool reads" in text
    assert "device ms" not in text and "kernels" not in text  # no device ran it
    single = profile_text([SideProfile(("full",), [1.0], {}, ops, 1, 0, 0, [])], 8, "x")
    assert "Timed once" in single and "(1.00–1.00 s)" not in single
    # a side that failed keeps no number; where every side did, the text has no time to show at all
    failed = [SideProfile(side, [], {}, [], None, None, None, ["h2o: RuntimeError: broke"]) for side in SIDES]
    none = profile_text(failed, 8, "x")
    assert "Every side failed: no time to show." in none and " s " not in none and "reads" not in none
    assert none.count("FAILED: h2o: RuntimeError: broke") == 2
    assert next(line for line in none.splitlines() if line.startswith("whole follow-up")).split()[-2:] == [
        "FAILED", "FAILED"]


@pytest.mark.model
def test_the_cli_prints_and_writes_the_profile(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "profile.json"
    assert main(["profile", "--policies", "h2o", "--context", "64", "--runs", "1", "--budget", "32", "--param",
                 "h2o.recent_ratio=0.25", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [s["policies"] for s in data["sides"]] == [["full"], ["full", "h2o"]]
    assert data["context_tokens"] == 64 and data["budget"] == 32 and data["new_tokens"] == 16
    assert data["kvlab_version"] == __version__ and data["saved_at"].endswith("UTC")
    assert data["params"]["h2o"]["recent_ratio"] == 0.25 and "budget 32 tokens" in data["text"]
    assert data["text"] in capsys.readouterr().out
    assert all(s["phases"]["decoding the replies"] > 0 and not s["errors"] for s in data["sides"])
