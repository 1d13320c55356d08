"""Wall-clock timing for measurements shown as ratios (never asserted in tests)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch

T = TypeVar("T")

# said next to every timing taken once: one run on a shared, busy machine is noise, not a measurement
SINGLE_RUN_NOTE = ("Timed once: on a busy machine a single run is not a speed measurement; "
                   "ask for several runs to see the median and the spread.")


@dataclass(frozen=True)
class Timing:
    """Seconds over repeated runs of the same call: the median, the fastest and the slowest."""

    median: float
    low: float
    high: float
    runs: int

    @property
    def spread(self) -> float:
        """Slowest minus fastest run (0 for a single run, which tells nothing about noise)."""
        return self.high - self.low


def synchronize() -> None:
    """Wait for queued GPU work, so the clock reads when the work is done, not when it was launched."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elif torch.backends.mps.is_available():
        torch.mps.synchronize()


def clock() -> float:
    """``time.perf_counter`` after the device has finished its queued work: every kvlab timer reads this."""
    synchronize()
    return time.perf_counter()


def host_clock() -> float:
    """``time.perf_counter`` for work that runs in other processes (Ray workers): this process queued no
    device work, so there is nothing to wait for, and synchronising would only open a device context here."""
    return time.perf_counter()


def time_call(fn: Callable[[], T], repeats: int = 1) -> tuple[Timing, T]:
    """Timing of ``repeats`` calls of ``fn`` and the last call's result."""
    times: list[float] = []
    for _ in range(max(1, repeats)):
        t0 = clock()
        result = fn()
        times.append(clock() - t0)
    return Timing(statistics.median(times), min(times), max(times), len(times)), result
