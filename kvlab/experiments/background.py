"""A piece of work in a background thread for the app: progress, Cancel and the error, never the UI."""

from __future__ import annotations

import threading
from typing import Self

from kvlab.engine.progress import time_left
from kvlab.engine.timing import clock, host_clock
from kvlab.errors import KvlabError


class BackgroundJob:
    """Runs ``work()`` in a daemon thread; the page polls ``fraction`` and ``label`` and reads ``error``.

    Subclasses implement ``work`` (reading ``cancel_event`` and reporting through ``progress``) and keep its
    results in their own fields. The thread only writes fields, so it never touches the UI.
    """

    thread_name = "kvlab-job"

    def __init__(self) -> None:
        self.cancel_event = threading.Event()
        self.fraction, self.label = 0.0, "starting"  # share of the work done, what runs next
        self.error: str | None = None
        self.started = clock()
        self._moved = (0.0, self.started)  # the share done and when it was reported, one object for the UI thread
        self.elapsed_s = 0.0
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)

    def work(self) -> None:
        raise NotImplementedError

    def start(self) -> Self:
        self._thread.start()
        return self

    def progress(self, fraction: float, label: str) -> None:
        if fraction != self._moved[0]:
            self._moved = (fraction, host_clock())
        self.fraction, self.label = fraction, label

    def _run(self) -> None:
        try:
            self.work()
        except Exception as exc:  # reported on the page; a failed run must not kill the app
            self.error = str(exc) if isinstance(exc, KvlabError) else f"{type(exc).__name__}: {exc}"
        finally:
            self.elapsed_s = clock() - self.started

    def cancel(self) -> None:
        self.cancel_event.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def time_left(self) -> str:
        """The time left, as ``kvlab.engine.progress.time_left`` says it ('' too early to tell), counting down while a
        step runs; read by the UI thread, so on ``host_clock`` (``started``'s time base), which does not wait on the
        device."""
        fraction, at = self._moved
        return time_left(fraction, at - self.started, host_clock() - at)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()
