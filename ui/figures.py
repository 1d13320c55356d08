"""Every figure a page draws in one run, downloadable at once as a zip of standalone HTML files.

Pages draw with ``st.plotly_chart`` (or a column's ``plotly_chart``) in tabs and columns; the recorder
wraps that one call, so the pages stay unchanged: ``page_start`` opens a new list each run and a page
ends with ``download_all_figures(name)``.
"""

from __future__ import annotations

import io
import re
import zipfile

import plotly.graph_objects as go
import streamlit as st
from streamlit.delta_generator import DeltaGenerator

from kvlab.viz.titles import fit_titles

_KEY = "_page_figures"  # session state: the figures the running page has drawn so far, in order


def figure_name(index: int, fig: go.Figure) -> str:
    """A file name for the ``index``-th figure (from 1): its number and its title, made safe."""
    title = re.sub(r"<[^>]+>", " ", fig.layout.title.text or "figure")  # plotly titles may hold <br>, <sub>
    slug = re.sub(r"[^A-Za-z0-9]+", "-", title).strip("-").lower()[:60] or "figure"
    return f"{index:02d}-{slug}.html"


def figures_zip(figures: list[go.Figure], offline: bool = False) -> bytes:
    """A zip holding one standalone HTML file per figure, in drawing order.

    ``offline`` puts plotly.js inside each file (about 4.6 MB each); otherwise files load it from the CDN.
    """
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for i, fig in enumerate(figures, start=1):
            html = fig.to_html(include_plotlyjs=True if offline else "cdn", full_html=True)
            archive.writestr(figure_name(i, fig), html)
    return buffer.getvalue()


def _install() -> None:
    """Wrap ``plotly_chart`` once per process so every chart a page draws has titles that fit (``fit_titles``) and
    is recorded."""
    original = DeltaGenerator.plotly_chart
    if getattr(original, "_records", False):
        return

    def plotly_chart(self: DeltaGenerator, figure_or_data, *args, **kwargs):
        if isinstance(figure_or_data, go.Figure):
            fit_titles(figure_or_data)  # a page may be as narrow as 440 px beside the sidebar
            if (drawn := st.session_state.get(_KEY)) is not None:
                drawn.append(figure_or_data)
        return original(self, figure_or_data, *args, **kwargs)

    plotly_chart._records = True
    DeltaGenerator.plotly_chart = plotly_chart
    # ``st.plotly_chart`` was bound to the main container at import; rebind it to the wrapper
    st.plotly_chart = st._main.plotly_chart


def start_page() -> None:
    """Begin recording this run's figures (``page_start`` calls it before the page draws anything)."""
    _install()
    st.session_state[_KEY] = []


def page_figures() -> list[go.Figure]:
    """The figures this run of the page has drawn so far."""
    return list(st.session_state.get(_KEY) or [])


def download_all_figures(page: str) -> None:
    """Sidebar buttons that download every figure this run drew, as one zip (with plotly.js from the CDN or inside)."""
    figures = page_figures()
    if not figures:
        return
    box = st.sidebar.container(border=True)
    box.caption("The figure on this page, as an interactive HTML file in a zip" if len(figures) == 1 else
                f"The {len(figures)} figures on this page, one interactive HTML file each, in one zip")
    # callables: the zip is built only when clicked, from this run's figures
    box.download_button("Download all figures", lambda: figures_zip(figures), f"kvlab-{page}-figures.zip",
                        "application/zip", key=f"{page}_figures_zip", on_click="ignore", icon=":material/download:",
                        help="Each file loads plotly.js from its CDN: small, needs the internet to open.")
    box.download_button("Offline zip (plotly.js inside)", lambda: figures_zip(figures, offline=True),
                        f"kvlab-{page}-figures-offline.zip", "application/zip", key=f"{page}_figures_zip_offline",
                        on_click="ignore", icon=":material/download:",
                        help="plotly.js inside each file (about 4.6 MB each): opens without the internet.")
