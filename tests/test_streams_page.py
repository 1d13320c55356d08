"""The Streams page under Streamlit's AppTest: a short background stream on the embedded model, and bad input."""

from __future__ import annotations

import pytest
from page_helpers import open_page
from streamlit.testing.v1 import AppTest

pytestmark = pytest.mark.model  # the app loads the embedded model


def streams_app() -> AppTest:
    at = open_page("app_pages/streams.py", timeout=300)
    assert not at.exception
    return at


def set_stream(at: AppTest, tokens: int, budget: int, chunk: int, policies: list[str], sinks: str | None) -> None:
    at.number_input(key="stream_tokens").set_value(tokens)
    at.number_input(key="stream_budget").set_value(budget)
    at.number_input(key="stream_chunk").set_value(chunk)
    at.multiselect(key="stream_policies").set_value(policies)
    at.checkbox(key="stream_ablate").set_value(sinks is not None)
    if sinks is not None:
        at.text_input(key="stream_sinks").set_value(sinks)


def test_a_short_stream_draws_the_curve_the_ablation_and_downloads() -> None:
    at = streams_app()
    assert not at.get("plotly_chart") and "stream_job" not in at.session_state
    set_stream(at, 100, 32, 32, ["full", "window", "streamingllm", "recompute"], "0,4")
    at.button(key="stream_run").click().run()
    assert not at.exception and not at.error
    job = at.session_state["stream_job"]
    job.join(900)  # three chunks; minutes only on a crowded machine
    assert not job.running and job.error is None
    at.run()
    assert not at.exception and not at.error
    assert len(at.get("plotly_chart")) == 2  # the perplexity curve and the sink ablation
    assert any(s.value.startswith("100 tokens of") and "through 4 runners" in s.value and "99 of them scored" in s.value
               for s in at.success)  # the tokens asked for; the first has no prediction
    summary = at.main.dataframe[0].value
    labels = list(summary["label"])  # the runners by their labels: the policy's name column is the CSV's
    assert len(labels) == 4 and labels[0] == "dense (Full)" and labels[-1] == "sliding window + recompute"
    assert "policy" not in summary and "error" not in summary  # no runner failed: a column of blanks says nothing
    assert "ppl_past_context" not in summary  # 100 tokens: no query passed the trained context
    assert (summary["tokens"] == 99).all()
    segments = at.main.dataframe[1].value  # one segment of 256, short: it says how many tokens it holds
    assert list(segments[["start", "end", "tokens"]].itertuples(index=False, name=None)) == [(1, 99, 99)]
    ablation = at.main.dataframe[2].value
    assert list(ablation["cache"]) == ["0 + 32", "4 + 28"]
    assert len(at.main.get("download_button")) == 3  # the sidebar holds the figures zip
    assert any("inside" in c.value and "trained context" in c.value for c in at.caption)
    assert not any("form has changed" in i.value for i in at.info)
    at.number_input(key="stream_budget").set_value(64)
    at.radio(key="stream_mode").set_value("original").run()
    changed = [i.value for i in at.info if "form has changed" in i.value]
    assert len(changed) == 1 and "cache: 32 → 64; positions: rerotated → original)" in changed[0], changed
    assert len(at.get("plotly_chart")) == 2  # the results stay, said to be the stream's


@pytest.mark.parametrize("tokens, budget, sinks, words", [
    (100, 96, None, "needs at least"),  # too short a text for the cache
    (200, 48, "0,48", "no room"),
    (200, 48, "0,x", "whole numbers"),
    (200, 48, "0,,4", "an empty item between two commas"),
    # out of range: refused with the value typed (a bounded widget would keep an older one)
    (200, 99_999, None, "exceeds the model's context of 8192"),
    (200, 0, None, "cache size"),
    (0, 48, None, "a stream takes 2 to 1,000,000 tokens, not 0"),
    (10**9, 48, None, "a stream takes 2 to 1,000,000 tokens"),
    (200, 48, None, "chunk"),
])
def test_bad_input_is_refused_in_words_and_starts_nothing(tokens, budget, sinks, words) -> None:
    at = streams_app()
    set_stream(at, tokens, budget, 0 if words == "chunk" else 32, ["full", "streamingllm"], sinks)
    at.button(key="stream_run").click().run()
    assert not at.exception
    assert any(words in e.value for e in at.error)
    assert "stream_job" not in at.session_state


def test_an_upload_is_required_when_my_own_file_is_chosen() -> None:
    at = streams_app()
    at.radio(key="stream_source").set_value("upload").run()
    set_stream(at, 200, 48, 32, ["streamingllm"], None)
    at.button(key="stream_run").click().run()
    assert any("upload a text file" in e.value for e in at.error)
    assert "stream_job" not in at.session_state


def test_a_curve_window_below_one_token_is_refused_in_words() -> None:
    at = streams_app()
    set_stream(at, 200, 48, 32, ["full", "streamingllm"], None)
    at.number_input(key="stream_window").set_value(0)
    at.button(key="stream_run").click().run()
    assert not at.exception and any("the curve's window must be at least 1 token, not 0" in e.value for e in at.error)
    assert "stream_job" not in at.session_state


def test_a_cancelled_stream_says_how_much_of_it_was_scored() -> None:
    """A walk read "Cancelled after 128 of 399 tokens" over "129 tokens … 128 of them scored" for 400 asked."""
    at = streams_app()
    set_stream(at, 400, 32, 16, ["streamingllm"], None)
    at.button(key="stream_run").click().run()
    job = at.session_state["stream_job"]
    while job.running and job.fraction == 0:
        job.join(0.05)
    job.cancel()
    job.join(300)
    at.run()
    scored = job.result.scored
    assert not at.exception and 0 < scored < 399
    said = f"Cancelled after scoring {scored:,} of the 399 tokens the stream would score"
    assert at.warning[0].value.startswith(said)
