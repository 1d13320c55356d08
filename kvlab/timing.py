"""Wall-clock timing for measurements shown as ratios (never asserted in tests)."""

from __future__ import annotations

import statistics
import time
from typing import Callable, TypeVar

T = TypeVar("T")


def time_call(fn: Callable[[], T], repeats: int = 1) -> tuple[float, T]:
    """Median seconds over ``repeats`` calls of ``fn`` and the last call's result."""
    times: list[float] = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result
