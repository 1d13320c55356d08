"""Timings that are honest (issue 13 item 4): several runs give a median with its spread, one run says so."""

from __future__ import annotations

import gc
import itertools
import weakref

import pytest

from kvlab.engine import timing
from kvlab.engine.facts import LoadedModel
from kvlab.engine.timing import paired_ratios, time_call, time_rounds
from kvlab.errors import Stopped
from kvlab.viz.edits import timeline_figure
from kvlab.viz.rag import tradeoff_figure
from kvlab.workloads.code.edits import reuse_edit, start_state
from kvlab.workloads.code.session import edits_frame
from kvlab.workloads.rag.corpus import Question, load_corpus
from kvlab.workloads.rag.run import (
    QuestionResult,
    RagLab,
    RagSettings,
    StrategyResult,
    results_table,
    summary_table,
    timing_note,
)

CODE = "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"


def test_time_call_keeps_median_fastest_and_slowest() -> None:
    calls: list[int] = []
    timing, result = time_call(lambda: calls.append(1) or len(calls), repeats=5)
    assert result == 5 and timing.runs == 5
    assert 0 <= timing.low <= timing.median <= timing.high and timing.spread == timing.high - timing.low


def test_rounds_turn_the_order_and_a_failing_side_sits_out() -> None:
    order: list[str] = []

    def fails() -> None:
        order.append("c")
        raise RuntimeError("broken")

    sides = time_rounds({"a": lambda: order.append("a") or 1, "b": lambda: order.append("b") or 2, "c": fails}, 4)
    # each round starts one further on (a b c, b c a, c a b, a b c); c failed in round 1 and sits out
    assert order == ["a", "b", "c", "b", "a", "a", "b", "a", "b"]
    assert [len(sides[n].seconds) for n in "abc"] == [4, 4, 0]
    assert (sides["a"].result, sides["b"].result, str(sides["c"].error)) == (1, 2, "broken")
    assert paired_ratios([2.0, 4.0], [1.0, 2.0]) == [2.0, 2.0] and paired_ratios([2.0], [1.0, 2.0]) == []


def test_a_cancel_ends_the_rounds() -> None:
    def cancel() -> None:
        raise Stopped

    with pytest.raises(Stopped):
        time_rounds({"a": lambda: None, "b": cancel}, 3)


def test_a_required_side_that_fails_ends_the_rounds_at_once() -> None:
    order: list[str] = []

    def fails() -> None:
        order.append("full")
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        time_rounds({"full": fails, "a": lambda: order.append("a")}, 3, required={"full"})
    assert order == ["full"]  # no other side ran after it


def test_settle_reduces_each_result_before_the_next_call() -> None:
    class Work:  # a side's large result (a cache)
        def __init__(self, name: str) -> None:
            self.name = name

    alive: list[weakref.ref] = []

    def call(name: str) -> Work:
        gc.collect()
        assert not [r() for r in alive if r() is not None], f"an earlier result is still held while {name} runs"
        work = Work(name)
        alive.append(weakref.ref(work))
        return work

    def settle(name: str, result: Work, last_round: bool) -> int | None:
        if name == "b":
            raise ValueError("cannot score b")
        return len(result.name * 3) if last_round else None

    sides = time_rounds({n: (lambda n=n: call(n)) for n in "abc"}, 2, settle=settle)
    assert (sides["a"].result, sides["c"].result, str(sides["b"].error)) == (3, 3, "cannot score b")
    assert [len(sides[n].seconds) for n in "ac"] == [2, 2]


@pytest.mark.slow
def test_rag_ttft_is_a_median_with_its_range(tiny: LoadedModel) -> None:
    corpus = load_corpus()
    result = RagLab(tiny, corpus).run(corpus.questions[0], RagSettings(k=2, answer_tokens=2, runs=3))
    assert all(r.runs == 3 and r.ttft_low_s <= r.ttft_s <= r.ttft_high_s for r in result.results)
    table = results_table([result])
    assert {"TTFT min ms", "TTFT max ms", "timed runs"} <= set(table.columns)
    summary = summary_table([result])
    assert (summary["speed-up low"] <= summary["speed-up"]).all()
    assert (summary["speed-up"] <= summary["speed-up high"]).all()
    # every strategy timed in the same rounds as full prefill: the speed-up is the median of the rounds' ratios
    full, naive = result.results[0], next(r for r in result.results if r.strategy == "naive")
    assert len(naive.ttft_runs_s) == len(full.ttft_runs_s) == 3
    ratios = sorted(f / s for f, s in zip(full.ttft_runs_s, naive.ttft_runs_s))
    row, want = summary.set_index("strategy").loc["Naive reuse"], pytest.approx((ratios[1], ratios[0], ratios[2]))
    assert (row["speed-up"], row["speed-up low"], row["speed-up high"]) == want
    assert (naive.speedup, naive.speedup_low, naive.speedup_high) == want
    fig = tradeoff_figure(summary, "one question")
    assert len(fig.data) == len(summary) and all(t.mode == "markers" and t.error_x.array for t in fig.data)


def test_edit_timings_carry_their_spread(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    # the runs in the order they are timed (each pair turns its order): reuse 0.1, full 1.0; full 1.5, reuse 0.3;
    # reuse 0.2, full 1.2 s
    ticks = iter(itertools.accumulate([0.0, 0.1, 0.0, 1.0, 0.0, 1.5, 0.0, 0.3, 0.0, 0.2, 0.0, 1.2]))
    monkeypatch.setattr(timing, "clock", lambda: next(ticks))
    _, result = reuse_edit(tiny, start_state(tiny, CODE), CODE + "# end\n", repeats=3)
    assert result.runs == 3
    got = (result.reprefill_ms, result.reprefill_spread_ms, result.full_ms, result.full_spread_ms)
    assert got == pytest.approx((200, 200, 1200, 500))  # medians and slowest − fastest
    saved = (result.saved_ms, result.saved_low_ms, result.saved_high_ms)
    assert saved == pytest.approx((1000, 900, 1200))  # each pair's saving 900, 1200, 1000 ms
    fig = timeline_figure(edits_frame([result]))
    assert list(fig.data[1].error_y.array) == pytest.approx([200]) and list(fig.data[1].error_y.arrayminus) == \
        pytest.approx([100])


def test_clock_waits_for_the_device_before_reading_the_time(monkeypatch) -> None:
    import torch

    from kvlab.engine import timing

    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: events.append("sync"))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: events.append("clock") or 1.0)
    timing.clock()
    assert events == ["sync", "clock"]
    events.clear()
    timing.time_call(lambda: events.append("work"))
    assert events == ["sync", "clock", "work", "sync", "clock"]


def test_every_timer_reads_kvlabs_clock() -> None:
    """No module reads the time itself: on a GPU a bare perf_counter times kernel launches, not the work."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    stray = [f"{path.relative_to(root)}:{n}" for folder in ("kvlab", "app_pages", "ui")
             for path in sorted((root / folder).rglob("*.py")) if path.name != "timing.py"
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if any(t in line for t in ("perf_counter", "time.time(", "time.monotonic", "process_time"))]
    assert stray == []


def asked(full_runs: list[float], naive_runs: list[float]) -> QuestionResult:
    """One question's full prefill and naive reuse with these timed runs (seconds; empty: a file saved before rounds,
    whose medians are then the first run's)."""
    def side(key: str, runs: list[float], median: float) -> StrategyResult:
        return StrategyResult(key, ttft_s=median, ttft_low_s=0.9 * median, ttft_high_s=1.1 * median,
                              runs=len(runs) or 3, ttft_runs_s=runs)

    question = Question("q01", "What is the code?", "48213")
    return QuestionResult(question, [("d01", 1.0)], 100, "48213",
                          [side("full", full_runs, 1.0), side("naive", naive_runs, 0.25)])


def test_a_question_asked_twice_counts_twice_and_full_prefill_is_one() -> None:
    # the same question twice in a session: each run against its own full prefill, never a join on its id
    rounds = summary_table([asked([1.0, 2.0, 1.0], [0.5, 0.5, 0.25]), asked([1.0, 1.0, 1.0], [0.5, 0.25, 0.25])])
    full, naive = rounds.iloc[0], rounds.iloc[1]
    assert full["speed-up"] == 1.0 and full["speed-up low"] < 1 < full["speed-up high"]
    assert (naive["speed-up"], naive["speed-up low"], naive["speed-up high"]) == (4.0, 2.0, 4.0)  # 2/1, 3/.75, 2/.5
    saved_before = summary_table([asked([], []), asked([], [])])  # medians only
    assert saved_before.iloc[0]["speed-up"] == 1.0 and saved_before.iloc[1]["speed-up"] == 4.0
    assert saved_before.iloc[1]["speed-up low"] == pytest.approx(0.9 / 1.1 * 4)


def test_the_timing_note_says_rounds_only_where_the_summary_used_them() -> None:
    assert "median of the rounds' ratios" in timing_note([asked([1.0, 2.0, 1.0], [0.5, 0.5, 0.25])])
    mixed = timing_note([asked([1.0, 2.0, 1.0], [0.5, 0.5, 0.25]), asked([1.0] * 5, [0.5] * 5)])
    assert "different numbers of rounds" in mixed and "ratio of total medians" in mixed
    assert "median of 3–5 runs" in mixed
    assert "median of the rounds' ratios" not in mixed
    assert "pair the slowest runs" in timing_note([asked([], [])])  # a file saved before rounds
    once = timing_note([asked([1.0], [0.5]), asked([1.0] * 3, [0.5] * 3)])
    assert "Some questions here were timed once" in once and "not medians of rounds" in once
    for note in (mixed, timing_note([asked([1.0] * 3, [0.5] * 3)])):
        assert "Full prefill's own range is its slowest run over its fastest" in note
