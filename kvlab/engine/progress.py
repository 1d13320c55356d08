"""The one progress-callback type: every long run (model download, lesson, RAG question, edit replay,
arena grid, benchmark) reports through it, so a page bar or a terminal bar can follow any of them."""

from typing import Callable

from kvlab.engine.timing import host_clock

Progress = Callable[[float, str], None]
"""``progress(fraction, message)``: the share of the run done, in [0, 1], and what runs now."""


def part_of(progress: Progress, start: float, end: float) -> Progress:
    """``progress`` for a step that covers ``start``…``end`` of a longer run: its 0…1 maps onto that span."""
    return lambda fraction, message: progress(start + (end - start) * fraction, message)


def time_left(fraction: float, elapsed_s: float, since_s: float = 0.0) -> str:
    """'about 3 min left' from the share of a run done and the seconds it took to get there, as if the rest ran at
    the same pace; '' while too little is done to tell (under 2 % or 3 s) and once it is done. ``since_s``: the
    seconds since that share was reported, a step still running: the time left counts down through it (a pace
    taken over the waiting too would count up), and a step that outlasts the estimate is said to."""
    if not (0.02 <= fraction < 1) or elapsed_s < 3:
        return ""
    left = elapsed_s * (1 - fraction) / fraction - since_s
    if left < 0:
        return "running longer than the pace so far"
    seconds = max(5, round(left / 5) * 5)
    if seconds < 60:
        return f"about {seconds} s left"
    minutes = round(seconds / 60)
    return f"about {minutes} min left" if minutes < 60 else f"about {minutes // 60} h {minutes % 60} min left"


def with_left(message: str, left: str) -> str:
    """A progress message with the time left (``time_left``) after it, where there is one."""
    return f"{message} · {left}" if left else message


def with_time_left(progress: Progress, now: Callable[[], float] = host_clock) -> Progress:
    """``progress`` whose message ends with the time left (``time_left``), counted from this call."""
    started = now()

    def report(fraction: float, message: str) -> None:
        progress(fraction, with_left(message, time_left(fraction, now() - started)))

    return report
