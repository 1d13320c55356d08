"""Streams: a long text past the trained context through policies side by side (StreamingLLM's own experiment)."""

from __future__ import annotations

import streamlit as st

from kvlab.errors import KvlabError
from kvlab.experiments.stream_job import StreamJob
from kvlab.experiments.stream_report import stream_report
from kvlab.export import table_csv, to_json
from kvlab.files import MB
from kvlab.viz.stream import perplexity_figure, sink_ablation_figure
from kvlab.workloads.stream.run import HEADERS, QUIET
from kvlab.workloads.stream.settings import (
    DEFAULT_POLICIES,
    RECOMPUTE,
    StreamSettings,
    check_length,
    label_of,
    stream_policies,
    streamable,
)
from kvlab.workloads.stream.sinks import SINKS, parse_sinks, stream_record
from kvlab.workloads.stream.text import (
    DEFAULT_TEXT_NAME,
    MAX_TEXT_BYTES,
    decode_text,
    default_text,
    stream_ids,
    text_digest,
)
from ui.common import page_start
from ui.figures import download_all_figures
from ui.jobs import job_panel
from ui.params import param_widgets
from ui.plugins import PLUGIN_HELP, policy_option
from ui.tables import compact_table, dashed

lm = page_start(
    "Streams",
    "StreamingLLM's own experiment: a long text fed in chunks through the policies side by side, each cache "
    "compressed to its size after every chunk, and the perplexity of every next token. Dense (Full) keeps every "
    "key, so past the model's trained context its positions are ones it never saw in training; sliding window "
    "with recomputation re-reads the window from the raw tokens for every chunk (exact but slow).",
)

state = st.session_state
job: StreamJob | None = state.get("stream_job")
running = job is not None and job.running
BUNDLED, UPLOAD = "bundled", "upload"
CURVE_WINDOW = 256  # the curve's default window: tokens its running perplexity is taken over


with st.expander("Stream", expanded=job is None):
    c1, c2 = st.columns([2, 3])
    source = c1.radio("Text", [BUNDLED, UPLOAD], persist_state="session", key="stream_source", horizontal=True,
                      format_func={BUNDLED: DEFAULT_TEXT_NAME, UPLOAD: "my own file"}.get)
    upload = c2.file_uploader(f"A UTF-8 text file (at most {MAX_TEXT_BYTES // MB} MB)", type=["txt", "md"],
                              key="stream_upload", disabled=source != UPLOAD, max_upload_size=MAX_TEXT_BYTES // MB)
    c3, c4, c5, c6 = st.columns(4)
    # no bounds on the widgets: a value out of range is refused in words (a bounded widget would keep its last
    # valid value while showing the one typed)
    tokens = c3.number_input("Tokens to stream", value=2048, step=512, persist_state="session", key="stream_tokens",
                             help=f"{lm.facts.name} was trained on {lm.facts.context_length:,} tokens: stream more "
                                  "to see dense attention leave its trained positions.")
    budget = c4.number_input("Cache size (tokens)", value=1024, persist_state="session", key="stream_budget")
    chunk = c5.number_input("Chunk (tokens per forward; 1 = token by token)", value=64,
                            persist_state="session", key="stream_chunk")
    mode = c6.radio("Positions", ["rerotated", "original"], persist_state="session", key="stream_mode", horizontal=True,
                    help="rerotated: keys rotated to their slot in the cache, the query at the cache length "
                         "(StreamingLLM's scheme: positions stay inside the cache). original: positions follow "
                         "the text, so past the trained context every policy's queries leave the trained range.")
    policies = st.multiselect("Policies and baselines", streamable(), default=list(DEFAULT_POLICIES),
                              persist_state="session", key="stream_policies",
                              format_func=lambda p: policy_option(p, label_of(p)), help=PLUGIN_HELP)
    params = param_widgets([p for p in policies if p != RECOMPUTE], "stream")
    # on a line of its own: in a third of a 900 px window's page it would read "Sink ablati…"
    ablate = st.checkbox("Sink ablation too", value=True, persist_state="session", key="stream_ablate",
                         help="StreamingLLM's Table 1: the same stream at the same cache with 0, 1, 2, 4, 8 sinks.")
    c8, c9 = st.columns(2)
    sinks_text = c8.text_input("Sink counts", ",".join(map(str, SINKS)),
                               persist_state="session", key="stream_sinks", disabled=not ablate)
    window = int(c9.number_input("Curve: perplexity over the last … tokens", value=CURVE_WINDOW, step=64,
                                 persist_state="session", key="stream_window"))

    text_name = DEFAULT_TEXT_NAME if source == BUNDLED else None if upload is None else upload.name
    digest = None
    if source != BUNDLED and upload is not None:  # hashed once per upload, not on every rerun of the page
        if state.get("stream_upload_digest", (None,))[0] != upload.file_id:
            state.stream_upload_digest = (upload.file_id, text_digest(upload.getvalue()))
        digest = state.stream_upload_digest[1]
    if st.button("Stream", type="primary", key="stream_run", disabled=running):
        try:
            if window < 1:
                raise KvlabError(f"the curve's window must be at least 1 token, not {window}")
            settings = StreamSettings(policies=tuple(policies), budget=int(budget), chunk=int(chunk),
                                      position_mode=mode, params=params)
            stream_policies(lm, settings)
            sinks = parse_sinks(sinks_text, settings.budget) if ablate else None
            if source == UPLOAD:
                if upload is None:
                    raise KvlabError("upload a text file, or stream the bundled text")
                text, name = decode_text(upload.getvalue(), upload.name), upload.name
            else:
                text, name = default_text(), DEFAULT_TEXT_NAME
            ids = stream_ids(lm.encode, text, int(tokens))
            if len(ids) < int(tokens):
                raise KvlabError(f"{name} has {len(ids):,} tokens, fewer than the {int(tokens):,} asked for")
            check_length(len(ids), settings)  # refused in words here, before a job starts
            state.stream_job = StreamJob(lm, ids, settings, name, sinks, digest).start()
        except KvlabError as exc:
            st.error(str(exc))
        else:
            st.rerun()  # redraw with the button disabled and the progress panel ticking


job_panel("stream", lambda j: j.label, "Cancelling: the stream stops after the chunk in progress…")

if job is None or job.running:
    st.stop()
if job.error:
    st.error(f"The stream stopped: {job.error}")
result = job.result
if result is None or result.scored == 0:
    st.info("No chunk finished, so there are no results.")
    st.stop()
if result.cancelled:
    st.warning(f"Cancelled after scoring {result.scored:,} of the {result.n_tokens - 1:,} tokens the stream would "
               "score (every token but the first): the results hold those.")

s = result.settings
runners = f"{len(s.policies)} runner{'s' if len(s.policies) > 1 else ''}"
(st.info if result.cancelled else st.success)(
    f"{result.scored + 1:,} tokens of {job.text_name} through {runners} in {result.time_s:.0f} s (one run), "
    f"{result.scored:,} of them scored (the first has no prediction; cache {s.budget:,}, chunk {s.chunk}, "
    f"{s.position_mode} positions).")
asked = StreamSettings(policies=tuple(policies), budget=int(budget), chunk=int(chunk), position_mode=mode,
                       params=params)
if changed := job.changed_from(text_name, int(tokens), asked, sinks_text if ablate else None, digest):
    st.info(f"**The form has changed since this stream ran** ({'; '.join(changed)}): the results below are that "
            "stream's. Press **Stream** to run the form's.")
summary = result.summary()
for row in summary[summary["error"].notna()].itertuples():
    st.error(f"**{row.label}** failed and was dropped (no score from then on): {row.error}")
if result.scored + 1 <= result.context_length:
    st.caption(f"The whole stream lies inside {result.model}'s trained context ({result.context_length:,} tokens): "
               "stream more tokens to see dense attention pass it.")
if window < 1:  # changed after the stream ran
    st.error(f"The curve's window must be at least 1 token, not {window}: the curve below is over the last "
             f"{CURVE_WINDOW} tokens.")
    window = CURVE_WINDOW
curve = result.curve_window(window)
if curve != window:
    st.caption(f"The stream scored {result.scored:,} tokens, fewer than two of the curve's windows ({window:,}): "
               f"the curve is the perplexity over the last {curve:,} tokens instead.")
st.plotly_chart(perplexity_figure(result.running(curve), result.context_length, s.budget, curve),
                width="stretch", key="stream_curve")
# the runner's label names it (the CSV keeps the policy's name)
data, config = compact_table(dashed(summary.drop(columns="policy")), HEADERS, quiet=QUIET)
st.dataframe(data, hide_index=True, width="stretch", placeholder="—", column_config=config)
segment = max(s.budget, 256)
st.subheader(f"Perplexity per {segment:,} tokens")
data, config = compact_table(result.segment_table(segment), HEADERS)
st.dataframe(data, hide_index=True, width="stretch", placeholder="—", column_config=config)

if job.ablation is not None:
    table = job.ablation.table()
    st.subheader(f"Sink ablation at a cache of {job.ablation.cache:,}")
    st.caption(f"{job.ablation.result.time_s:.0f} s, one run. StreamingLLM's Table 1 (Llama-2-13B, cache 1024): "
               "window 0 + 1024 perplexity 5158, 4 + 1020 5.40. A model that degrades without sinks rather than "
               "collapsing shows a gap here, not a blow-up.")
    st.plotly_chart(sink_ablation_figure(table), width="stretch", key="stream_sinks_fig")
    data, config = compact_table(dashed(table), HEADERS, quiet=QUIET)
    st.dataframe(data, hide_index=True, width="stretch", placeholder="—", column_config=config)
elif job.sinks is not None:
    st.info("The sink ablation did not run: the stream was cancelled first.")

downloads = st.container(horizontal=True)  # buttons as wide as their labels, wrapping: columns cut them at 900 px
downloads.download_button("Download per-token CSV", lambda: table_csv(result.token_file()), "kvlab-stream.csv",
                          "text/csv", key="stream_csv", on_click="ignore")
downloads.download_button(
    "Download JSON",
    lambda: to_json(stream_record(result, job.text_name, segment, job.ablation)),
    "kvlab-stream.json", "application/json", key="stream_json", on_click="ignore")
downloads.download_button("Download HTML report",
                          lambda: stream_report(result, job.text_name, segment, window, job.ablation),
                          "kvlab-stream.html", "text/html", key="stream_html", on_click="ignore")

download_all_figures("streams")
