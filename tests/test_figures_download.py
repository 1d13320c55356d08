"""Download all figures of a page at once: the zip holds one standalone HTML file per figure the page drew."""

from __future__ import annotations

import io
import json
import zipfile

import plotly.graph_objects as go
import pytest
from page_helpers import open_page

from ui.figures import figure_name, figures_zip


def names_in(data: bytes) -> list[str]:
    return zipfile.ZipFile(io.BytesIO(data)).namelist()


def test_the_zip_holds_one_html_file_per_figure_in_drawing_order() -> None:
    figs = [go.Figure(go.Bar(y=[1, 2]), layout={"title": {"text": t}})
            for t in ("KL to Full, per turn", "KL to Full, per turn", "h2o: <b>kept</b> tokens")]
    data = figures_zip(figs)
    assert names_in(data) == ["01-kl-to-full-per-turn.html", "02-kl-to-full-per-turn.html", "03-h2o-kept-tokens.html"]
    html = zipfile.ZipFile(io.BytesIO(data)).read("03-h2o-kept-tokens.html").decode()
    assert 'src="https://cdn.plot.ly' in html and "kept" in html
    offline = zipfile.ZipFile(io.BytesIO(figures_zip(figs[:1], offline=True))).read(names_in(data)[0]).decode()
    assert 'src="https://cdn.plot.ly' not in offline and len(offline) > 1_000_000  # plotly.js inside
    assert figure_name(7, go.Figure()) == "07-figure.html"


@pytest.mark.model  # the chat page loads the embedded model
def test_the_chat_page_offers_every_figure_it_shows_with_the_retained_map_animated() -> None:
    at = open_page("app_pages/chat.py")
    at.multiselect(key="chat_policies").set_value(["streamingllm", "h2o"])
    at.number_input(key="chat_budget").set_value(32)
    at.number_input(key="chat_max_new").set_value(4)
    at.chat_input[0].set_value("My boat key number is 40917. Remember it, please.").run()
    at.chat_input[0].set_value("What is my boat key number?").run()
    assert not at.exception and not at.error
    shown = at.get("plotly_chart")
    recorded = at.session_state["_page_figures"]
    assert len(recorded) == len(shown) >= 7  # sinks, profile, 2 retained maps, bytes, block map, fidelity
    assert len(names_in(figures_zip(recorded))) == len(shown)
    assert any("Download all figures" in b.proto.label for b in at.sidebar.get("download_button"))
    specs = [json.loads(chart.proto.spec) for chart in shown]
    animated = [s for s in specs if s.get("frames")]
    assert len(animated) == 2 and all(len(s["frames"]) == 2 for s in animated)  # one per policy, a frame per turn
    replies = " ".join(m.value for m in at.markdown)
    assert "<mark" in replies or "same as Full" in replies  # each policy's reply against Full's
