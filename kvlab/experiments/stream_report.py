"""A standalone HTML report of a stream: what ran, the summary and segment tables, the figures, the sink ablation.

plotly.js is embedded once, inline, so the file opens offline.
"""

from __future__ import annotations

import html

from kvlab.experiments.html import figures_html, page, table_html
from kvlab.viz.stream import perplexity_figure, sink_ablation_figure
from kvlab.workloads.stream.run import HEADERS, QUIET, StreamResult
from kvlab.workloads.stream.sinks import SinkAblation


def stream_report(result: StreamResult, text_name: str, segment: int, window: int,
                  ablation: SinkAblation | None = None) -> str:
    """The report's HTML: ``segment`` tokens per table row, the curve's perplexity over the last ``window``
    (fewer on a short stream: ``StreamResult.curve_window``)."""
    s = result.settings
    facts = (f"{result.model}, trained context {result.context_length:,} tokens · text: {text_name} · "
             f"{result.scored:,} tokens scored · cache {s.budget:,} · chunk {s.chunk} · "
             f"positions {s.position_mode} · {result.time_s:.0f} s, one run"
             + (" · cancelled before the end" if result.cancelled else ""))
    window = result.curve_window(window)
    figures = [perplexity_figure(result.running(window), result.context_length, s.budget, window)]
    parts = [f"<h1>kvlab stream report</h1><p>{html.escape(facts)}</p>", "<h2>Summary</h2>",
             table_html(result.summary(), headers=HEADERS, quiet=QUIET), f"<h2>Perplexity per {segment:,} tokens</h2>",
             table_html(result.segment_table(segment), headers=HEADERS)]
    if ablation is not None:
        figures.append(sink_ablation_figure(ablation.table()))
        parts += [f"<h2>Sink ablation at a cache of {ablation.cache:,}</h2>",
                  table_html(ablation.table(), f"{ablation.result.time_s:.0f} s, one run", HEADERS, QUIET)]
    return page("".join(parts) + figures_html(figures), "kvlab stream report")
