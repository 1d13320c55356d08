"""Timings that are honest (issue 13 item 4): several runs give a median with its spread, one run says so."""

from __future__ import annotations

import pytest

from kvlab.engine.facts import LoadedModel
from kvlab.engine.timing import time_call
from kvlab.viz.edits import timeline_figure
from kvlab.viz.rag import tradeoff_figure
from kvlab.workloads.code.edits import reuse_edit, start_state
from kvlab.workloads.code.session import edits_frame
from kvlab.workloads.rag.corpus import load_corpus
from kvlab.workloads.rag.run import RagLab, RagSettings, results_table, summary_table

CODE = "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"


def test_time_call_keeps_median_fastest_and_slowest() -> None:
    calls: list[int] = []
    timing, result = time_call(lambda: calls.append(1) or len(calls), repeats=5)
    assert result == 5 and timing.runs == 5
    assert 0 <= timing.low <= timing.median <= timing.high and timing.spread == timing.high - timing.low


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
    fig = tradeoff_figure(summary, "one question")
    assert len(fig.data) == len(summary) and all(t.mode == "markers" and t.error_x.array for t in fig.data)


def test_edit_timings_carry_their_spread(tiny: LoadedModel) -> None:
    _, result = reuse_edit(tiny, start_state(tiny, CODE), CODE + "# end\n", repeats=3)
    assert result.runs == 3 and result.reprefill_spread_ms >= 0 and result.full_spread_ms >= 0
    fig = timeline_figure(edits_frame([result]))
    assert fig.data[1].error_y.array is not None


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
