"""Ctrl-C in a long command: the first stops the run where it can stop cleanly and keeps what finished."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

INTERRUPTED = 130  # the exit status of a command stopped by Ctrl-C (128 + SIGINT), files written or not


@contextmanager
def stop_on_interrupt(what: str) -> Iterator[threading.Event]:
    """An event the first Ctrl-C sets (``what`` says where the run stops); a second Ctrl-C aborts at once.

    Outside the main thread (a test's runner, say) signals cannot be caught, and the event is only set by hand; a
    Ctrl-C the caller ignores (a job started in the background) stays ignored.
    """
    cancel = threading.Event()
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield cancel
        return

    def handler(signum, frame) -> None:
        if cancel.is_set():
            raise KeyboardInterrupt
        cancel.set()
        print(f"\n{what} (Ctrl-C again to abort)", file=sys.stderr)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield cancel
    finally:
        signal.signal(signal.SIGINT, previous)
