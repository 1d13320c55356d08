"""A standalone HTML report of a RAG run: the summary table and the RAG page's figures.

The q·k drift figure is measured for one layer and query head, chosen like the page's (defaults: the
page's too); plotly.js is embedded once, inline, so the file opens offline.
"""

from __future__ import annotations

import html

import pandas as pd

from kvlab.engine.facts import LoadedModel
from kvlab.experiments.html import figures_html, page, table_html
from kvlab.viz import rag as viz
from kvlab.workloads.rag.corpus import Corpus
from kvlab.workloads.rag.drift import drift_angles, measure_drift

DRIFT_DELTAS = list(range(0, 2049, 32))  # offsets Δp of the drift figures, in tokens


def rag_report(lm: LoadedModel, corpus: Corpus, summary: pd.DataFrame, deviation: pd.DataFrame,
               prefix_simulation: pd.DataFrame, layer: int = 2, head: int = 0, notes: tuple[str, ...] = ()) -> str:
    """The report's HTML, ``notes`` under its title (what ran, when, how far its times hold, whether it was cut
    short); the drift figures are measured on ``corpus``'s first document at ``layer`` and ``head``."""
    drift = measure_drift(lm, corpus.documents[0].text, layer, head, DRIFT_DELTAS)
    angles = drift_angles(lm, layer, DRIFT_DELTAS)
    over = f"mean over {int(summary['questions'].max())} questions"
    figures = [viz.tradeoff_figure(summary, over), viz.deviation_figure(deviation, over),
               viz.rotation_heatmap(angles, DRIFT_DELTAS, layer),
               viz.qk_drift_figure(drift, layer, head), viz.prefix_reuse_figure(prefix_simulation)]
    title = f"kvlab RAG report — {lm.facts.name}"
    said = "".join(f"<p class='note'>{html.escape(note)}</p>" for note in notes)
    return page(f"<h1>{html.escape(title)}</h1>{said}{table_html(summary)}{figures_html(figures)}", title)
