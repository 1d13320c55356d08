"""A stream (and its sink ablation) in a background thread, so a page can show progress and a Cancel button."""

from __future__ import annotations

from dataclasses import replace

from kvlab.engine.facts import LoadedModel
from kvlab.engine.progress import part_of
from kvlab.experiments.background import BackgroundJob
from kvlab.workloads.stream.run import StreamResult, StreamSettings, run_stream, stream_work
from kvlab.workloads.stream.sinks import SinkAblation, sink_ablation, sink_name


class StreamJob(BackgroundJob):
    """``run_stream`` then, when ``sinks`` are given, ``sink_ablation`` at the same cache; the page polls
    ``fraction`` and ``label`` and reads ``result`` and ``ablation``. The thread never touches the UI."""

    thread_name = "kvlab-stream"

    def __init__(self, lm: LoadedModel, ids: list[int], settings: StreamSettings, text_name: str,
                 sinks: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.lm, self.ids, self.settings, self.text_name, self.sinks = lm, ids, settings, text_name, sinks
        self.result: StreamResult | None = None
        self.ablation: SinkAblation | None = None

    def work(self) -> None:
        ablate = self.sinks is not None
        stream = stream_work(self.settings, len(self.ids))
        again = stream_work(replace(self.settings, policies=tuple(map(sink_name, self.sinks))), len(self.ids)) \
            if ablate else 0  # the ablation streams the same tokens once more, a cache per sink count
        split = stream / (stream + again)
        stream, ablation = part_of(self.progress, 0.0, split), part_of(self.progress, split, 1.0)
        part = "part 1 of 2, stream" if ablate else "stream"
        self.result = run_stream(self.lm, self.ids, self.settings,
                                 lambda f, m: stream(f, f"{part}: {m}"), self.cancel_event)
        if ablate and not self.result.cancelled:
            s = self.settings
            self.ablation = sink_ablation(self.lm, self.ids, s.budget, self.sinks, s.chunk, s.position_mode,
                                          lambda f, m: ablation(f, f"part 2 of 2, sink ablation: {m}"),
                                          self.cancel_event)

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set()
