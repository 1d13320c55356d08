"""A stream (and its sink ablation) in a background thread, so a page can show progress and a Cancel button."""

from __future__ import annotations

from kvlab.engine.facts import LoadedModel
from kvlab.engine.progress import part_of
from kvlab.errors import KvlabError
from kvlab.experiments.background import BackgroundJob
from kvlab.workloads.stream.run import StreamResult, run_stream
from kvlab.workloads.stream.settings import StreamSettings, stream_work
from kvlab.workloads.stream.sinks import SinkAblation, ablation_settings, parse_sinks, sink_ablation


class StreamJob(BackgroundJob):
    """``run_stream`` then, when ``sinks`` are given, ``sink_ablation`` at the same cache; the page polls
    ``fraction`` and ``label`` and reads ``result`` and ``ablation``. The thread never touches the UI."""

    thread_name = "kvlab-stream"

    def __init__(self, lm: LoadedModel, ids: list[int], settings: StreamSettings, text_name: str,
                 sinks: tuple[int, ...] | None = None, text_digest: str | None = None) -> None:
        super().__init__()
        self.lm, self.ids, self.settings, self.text_name, self.sinks = lm, ids, settings, text_name, sinks
        self.text_digest = text_digest  # an uploaded text's ``text_digest``: two files of one name tell apart
        self.result: StreamResult | None = None
        self.ablation: SinkAblation | None = None

    def work(self) -> None:
        ablate, s = self.sinks is not None, self.settings
        first = stream_work(s, len(self.ids))
        again = stream_work(ablation_settings(s.budget, self.sinks, s.chunk, s.position_mode), len(self.ids)) \
            if ablate else 0  # the ablation streams the same tokens once more, a cache per sink count
        split = first / (first + again)
        stream, ablation = part_of(self.progress, 0.0, split), part_of(self.progress, split, 1.0)
        part = "part 1 of 2, stream" if ablate else "stream"
        self.result = run_stream(self.lm, self.ids, self.settings,
                                 lambda f, m: stream(f, f"{part}: {m}"), self.cancel_event)
        if ablate and not self.result.cancelled:
            s = self.settings
            self.ablation = sink_ablation(self.lm, self.ids, s.budget, self.sinks, s.chunk, s.position_mode,
                                          lambda f, m: ablation(f, f"part 2 of 2, sink ablation: {m}"),
                                          self.cancel_event)

    def changed_from(self, text_name: str | None, tokens: int, asked: StreamSettings, sinks: str | None,
                     text_digest: str | None = None) -> list[str]:
        """What a form asks for that this finished stream did not run, each as "what: then → now" (``sinks``: the
        sink counts as typed, None for no ablation; an uploaded text is told by its name and ``text_digest``)."""
        s = self.settings
        if text_name == self.text_name and text_digest != self.text_digest:
            text_name = f"another file named {text_name}"
        try:
            counts = None if sinks is None else _counts(parse_sinks(sinks, asked.budget))
        except KvlabError:
            counts = sinks  # refused in words when Stream is pressed; here it differs all the same
        fields = (("text", self.text_name, text_name), ("tokens", len(self.ids), tokens),
                  ("cache", s.budget, asked.budget), ("chunk", s.chunk, asked.chunk),
                  ("positions", s.position_mode, asked.position_mode),
                  ("policies", ", ".join(s.policies), ", ".join(asked.policies)),
                  ("sink counts", _counts(self.sinks), counts))
        said = [f"{name}: {then or 'none'} → {now or 'none'}" for name, then, now in fields if then != now]
        return said + (["policy parameters"] if s.params != asked.params else [])

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set()


def _counts(sinks: tuple[int, ...] | None) -> str | None:
    """Sink counts as the form's field writes them ("0,4"); None where no ablation runs."""
    return None if sinks is None else ",".join(map(str, sinks))
