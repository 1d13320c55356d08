"""A stream (and its sink ablation) in a background thread, so a page can show progress and a Cancel button."""

from __future__ import annotations

import threading

from kvlab.engine.facts import LoadedModel
from kvlab.engine.progress import part_of
from kvlab.engine.timing import clock
from kvlab.errors import KvlabError
from kvlab.workloads.stream.run import StreamResult, StreamSettings, run_stream
from kvlab.workloads.stream.sinks import SinkAblation, sink_ablation


class StreamJob:
    """``run_stream`` then, when ``sinks`` are given, ``sink_ablation`` at the same cache; the page polls
    ``fraction`` and ``label`` and reads ``result`` and ``ablation``. The thread never touches the UI."""

    def __init__(self, lm: LoadedModel, ids: list[int], settings: StreamSettings, text_name: str,
                 sinks: tuple[int, ...] | None = None) -> None:
        self.lm, self.ids, self.settings, self.text_name, self.sinks = lm, ids, settings, text_name, sinks
        self.cancel_event = threading.Event()
        self.fraction, self.label = 0.0, "starting"
        self.result: StreamResult | None = None
        self.ablation: SinkAblation | None = None
        self.error: str | None = None
        self.started = clock()
        self.elapsed_s = 0.0
        self._thread = threading.Thread(target=self._run, name="kvlab-stream", daemon=True)

    def start(self) -> "StreamJob":
        self._thread.start()
        return self

    def _progress(self, fraction: float, label: str) -> None:
        self.fraction, self.label = fraction, label

    def _run(self) -> None:
        split = 0.5 if self.sinks is not None else 1.0  # the ablation streams the same tokens once more
        try:
            stream = part_of(self._progress, 0.0, split)
            self.result = run_stream(self.lm, self.ids, self.settings,
                                     lambda f, m: stream(f, f"stream: {m}"), self.cancel_event)
            if self.sinks is not None and not self.result.cancelled:
                ablation = part_of(self._progress, split, 1.0)
                s = self.settings
                self.ablation = sink_ablation(self.lm, self.ids, s.budget, self.sinks, s.chunk, s.position_mode,
                                              lambda f, m: ablation(f, f"sink ablation: {m}"), self.cancel_event)
        except Exception as exc:  # reported on the page; a failed run must not kill the app
            self.error = str(exc) if isinstance(exc, KvlabError) else f"{type(exc).__name__}: {exc}"
        finally:
            self.elapsed_s = clock() - self.started

    def cancel(self) -> None:
        self.cancel_event.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set()
