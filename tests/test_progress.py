"""The time left that progress bars and the background job panel show."""

from __future__ import annotations

import threading

import pytest

from kvlab.cli.bars import progress_bar
from kvlab.engine.progress import time_left, with_time_left
from kvlab.experiments import background
from kvlab.experiments.background import BackgroundJob


@pytest.mark.parametrize(("fraction", "elapsed", "said"), [
    (0.0, 10.0, ""),  # nothing done: no pace to go by
    (0.01, 100.0, ""),  # under 2 %
    (0.5, 2.0, ""),  # under 3 s
    (1.0, 50.0, ""),  # done
    (0.5, 20.0, "about 20 s left"),
    (0.9, 9.0, "about 5 s left"),  # never "about 0 s"
    (0.25, 60.0, "about 3 min left"),
    (0.1, 600.0, "about 1 h 30 min left"),
    (0.5, 58.0, "about 1 min left"),  # 58 s rounds to 60: said in minutes
])
def test_time_left_goes_by_the_pace_so_far(fraction: float, elapsed: float, said: str) -> None:
    assert time_left(fraction, elapsed) == said


def test_time_left_counts_down_through_a_step_still_running() -> None:
    assert time_left(0.5, 60.0, since_s=20.0) == "about 40 s left"
    assert time_left(0.5, 60.0, since_s=61.0) == "running longer than the pace so far"


def test_with_time_left_counts_from_its_creation() -> None:
    now, seen = [100.0], []
    progress = with_time_left(lambda f, m: seen.append((f, m)), now=lambda: now[0])
    progress(0.0, "starting")
    now[0] = 130.0
    progress(0.5, "question 2 of 4")
    assert seen == [(0.0, "starting"), (0.5, "question 2 of 4 · about 30 s left")]


def test_a_background_job_says_its_time_left_and_counts_it_down_while_a_step_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = [50.0]
    for name in ("clock", "host_clock"):  # one time base: the job starts on one, the UI reads the other
        monkeypatch.setattr(background, name, lambda: now[0])
    go, release = threading.Event(), threading.Event()

    class Job(BackgroundJob):
        def work(self) -> None:
            go.wait(5)
            self.progress(0.25, "turn 1")
            release.wait(5)

    job = Job().start()
    try:
        assert job.time_left == ""
        now[0] = 110.0
        go.set()
        while job.fraction < 0.25:
            release.wait(0.01)
        assert job.time_left == "about 3 min left"  # a quarter in 60 s: 180 s to go
        now[0] = 230.0  # the next turn runs long: the estimate counts down, not up with the wait
        assert job.time_left == "about 1 min left"
        now[0] = 300.0
        assert job.time_left == "running longer than the pace so far"
    finally:
        release.set()
        job.join(5)


def test_a_terminal_bar_of_shares_shows_no_rate() -> None:
    """A walk read "12.40%/s" and "1.50s/%" beside the stream's and the edit's bars."""
    bar, progress = progress_bar("stream", 100, "%")
    try:
        progress(0.25, "token 32 of 119")
        line = str(bar)
        assert line.startswith("stream:  25%|") and "token 32 of 119" in line
        assert "%/s" not in line and "s/%" not in line and "it/s" not in line
    finally:
        bar.close()
