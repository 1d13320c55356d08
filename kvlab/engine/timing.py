"""Wall-clock timing for measurements shown as ratios (never asserted in tests)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import torch

from kvlab.errors import Stopped

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

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Timing:
        """The timing of runs that took ``seconds`` (at least one)."""
        return cls(statistics.median(seconds), min(seconds), max(seconds), len(seconds))


@dataclass
class Rounds:
    """One side of calls timed in rounds: seconds per round, what ``settle`` made of the last call's result (the
    result itself without one), or the error that stopped it."""

    seconds: list[float] = field(default_factory=list)
    result: Any = None
    error: Exception | None = None


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
    """``time.perf_counter`` without waiting on the device: for work that runs in other processes (Ray workers),
    where this process queued no device work and synchronising would only open a device context, and for the time
    left that a progress bar shows while work runs (the UI thread must not wait on another thread's device work)."""
    return time.perf_counter()


def time_call(fn: Callable[[], T], repeats: int = 1) -> tuple[Timing, T]:
    """Timing of ``repeats`` calls of ``fn`` and the last call's result."""
    times: list[float] = []
    for _ in range(max(1, repeats)):
        t0 = clock()
        result = fn()
        times.append(clock() - t0)
    return Timing.of(times), result


def time_rounds(calls: Mapping[str, Callable[[], Any]], rounds: int, required: Collection[str] = (),
                settle: Callable[[str, Any, bool], Any] | None = None) -> dict[str, Rounds]:
    """Every call timed once a round, for ``rounds`` rounds, the order turned by one each round.

    A load that comes and goes then falls on every side alike, and the runs with the same index were taken
    close together, so their ratios pair like with like (timing all of A's runs and then all of B's lets a busy
    spell land on one side only). A call that raises keeps its error and sits out the later rounds, unless it is
    ``required``: then its error ends the measurement at once, as a ``Stopped`` (a cancel) does.

    ``settle(name, result, last_round)``, where given, runs untimed after every successful call, and the side keeps
    what it returns instead of the result: a large result can be reduced (or dropped) before the next call runs,
    so no more than one side's work is held at a time. An error in ``settle`` counts as the call's (its round's
    seconds stay, but a side with an error has no timing). Round 0 runs the sides in the order given, so the first
    side's first result is settled before any other call.
    """
    names = list(calls)
    sides = {name: Rounds() for name in names}
    for r in range(max(1, rounds)):
        turn = r % max(1, len(names))
        for name in names[turn:] + names[:turn]:
            side = sides[name]
            if side.error is not None:
                continue
            side.result = None  # the previous round's result is not kept while this one runs
            try:
                t0 = clock()
                result = calls[name]()
                side.seconds.append(clock() - t0)
                side.result = result if settle is None else settle(name, result, r == max(1, rounds) - 1)
            except Stopped:
                raise
            except Exception as exc:  # noqa: BLE001 — one side failing must not take the others down
                if name in required:
                    raise
                side.error = exc.with_traceback(None)  # its frames would keep the failed call's result alive
            finally:
                result = None  # settled or failed, the raw result must not live on through the next call
    return sides


def paired_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """``numerator[i] / denominator[i]`` for runs taken in the same round (``time_rounds``); none where the two
    sides do not have the same number of runs, since then they were not paired."""
    if len(numerator) != len(denominator):
        return []
    return [a / b for a, b in zip(numerator, denominator) if b > 0]
