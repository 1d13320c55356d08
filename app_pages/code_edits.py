"""Code edits: prefix reuse after an edit, and what cross-layer K/V sharing (CLA, YOCO) really saves."""

from __future__ import annotations

import streamlit as st

from kvlab.engine.timing import SINGLE_RUN_NOTE
from kvlab.errors import KvlabError
from kvlab.export import table_csv, to_json
from kvlab.files import MB
from kvlab.policies.memory import MIB
from kvlab.sharing.forward import sharing_refusal
from kvlab.sharing.schemes import OFFERED_SCHEMES, make_scheme, scheme_label
from kvlab.viz.edits import cost_share_figure, similarity_curve, similarity_heatmap, timeline_figure
from kvlab.workloads.code.costs import cost_table
from kvlab.workloads.code.edits import load_script
from kvlab.workloads.code.session import EditSession, deep_similarity
from kvlab.workloads.code.source import MAX_BYTES, code_files, decode_bytes, edit_scripts, module_source, read_file
from ui.common import as_written, marked_while_running, page_bar, page_start, say_cut_short, stop_button
from ui.figures import download_all_figures
from ui.tables import compact_table, short_number

SOURCES = ("Project file", "Upload", "Installed module", "Paste")
DEFAULT_FILE = "lru_scheduler.py"
PASTE_DEFAULT = "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"
# the tables' headers in words; the downloads keep the column names
HEADERS = {
    "index": "#", "label": "edit", "op": "operation", "old_tokens": "tokens before", "new_tokens": "tokens after",
    "lcp": "common prefix", "reused": "tokens reused", "suffix": "tokens prefilled again", "reuse_pct": "reuse %",
    "reprefill_ms": "re-prefill ms", "full_ms": "full prefill ms", "speedup": "speed-up",
    "reprefill_spread_ms": "re-prefill spread ms", "full_spread_ms": "full prefill spread ms",
    "max_logit_diff": "largest logit difference", "speedups": "speed-up of each run", "saved_ms": "ms saved",
    "saved_low_ms": "least a run saved (ms)", "saved_high_ms": "most a run saved (ms)",
    "kv_layers": "layers with K/V", "claim_share": "claimed share", "compute_share": "compute share",
    "kv_bytes_share": "K/V bytes share", "prefill_time_ratio": "prefill time ratio",
    "reprefill_time_ratio": "re-prefill time ratio", "kl_mean": "mean KL", "kl_max": "largest KL",
    "top1": "top-1 agreement", "prefill_s": "prefill s", "prefill_spread_s": "prefill spread s",
    "reprefill_s": "re-prefills s", "positions": "positions compared", "kv_mib_stored": "K/V stored (MiB)",
}

lm = page_start(
    "Code edits & cross-layer K/V sharing",
    "A code file is the whole prompt. After an edit, the longest common prefix of the old and new token ids "
    "keeps its K/V; only the suffix is prefilled again. Cross-layer sharing (CLA, YOCO) would shrink that "
    "re-prefill further: here it is costed from the model's real shapes and tried, without training, on the "
    "loaded model.",
)
ss = st.session_state


# --- 1. the code -------------------------------------------------------------------------------

def pick_source() -> tuple[str, str] | None:
    """(source key, text) from the chosen source, or None with an error shown."""
    choice = st.radio("Code source", SOURCES, horizontal=True, persist_state="session", key="ce_source_kind")
    try:
        if choice == "Project file":
            files = {p.name: p for p in code_files()}
            names = sorted(files)
            name = st.selectbox("File in data/code", names, index=names.index(DEFAULT_FILE),
                                persist_state="session", key="ce_file")
            return f"data/code/{name}", read_file(files[name])
        if choice == "Upload":
            upload = st.file_uploader("Upload a code file (UTF-8)", key="ce_upload", max_upload_size=MAX_BYTES // MB)
            if upload is None:
                st.info("Choose a file to upload.")
                return None
            return f"upload:{upload.name}", decode_bytes(upload.getvalue(), upload.name)
        if choice == "Installed module":
            name = st.text_input("Installed module (its source is read at run time)", "json.scanner",
                                 persist_state="session", key="ce_module")
            text, origin = module_source(name)
            return f"module:{name} ({origin})", text
        text = st.text_area("Paste code", PASTE_DEFAULT, height=160, persist_state="session", key="ce_paste")
        return "pasted", decode_bytes(text.encode("utf-8"), "the pasted code")
    except KvlabError as exc:
        said = str(exc)
        st.error(said + ("" if said.endswith((".", "?", "!")) else ".") + kept_note())
        return None


def kept_note() -> str:
    """What a refused source leaves: the file loaded before, where there is one, so its results below are not
    mistaken for the new one's."""
    # a code span, as the page names the file: markdown would read an upload's "upload:name" as it pleases
    return f" The cache below still holds `{ss.ce_session.source}`, loaded before." if "ce_session" in ss else ""


picked = pick_source()
if picked is not None and not (ss.get("ce_session") and ss.ce_session.is_for(lm, *picked)):
    try:
        with st.spinner("Prefilling the file…"):
            ss.ce_session = EditSession.start(lm, picked[1], picked[0])  # the previous session stays if it fails
            ss.ce_serial = ss.get("ce_serial", 0) + 1  # names its editor: an id() may return for another file
    except KvlabError as exc:
        st.error(str(exc) + kept_note())
if "ce_session" not in ss:
    st.stop()

session: EditSession = ss.ce_session
if not session.wait_idle(0):  # a run a click cut short still measures: what this run reads must include it
    with st.spinner("Finishing the edit or measurement the last click started…"):
        tick = st.empty()
        while not session.wait_idle(1):  # short waits: a later click ends this run at its next page call
            tick.empty()
state = session.state
n_tokens, n_lines = len(state.ids), len(state.text.splitlines())
st.markdown(f"`{session.source}` — {n_tokens:,} token{'s' * (n_tokens != 1)}, {n_lines:,} line"  # a path's __ stays
            f"{'s' * (n_lines != 1)} in the cache.")
repeats = st.slider("Timing runs per measurement (median)", 1, 5, 3, persist_state="session", key="ce_repeats",
                    help="Every prefill timed below runs this many times; tables show the median and the spread "
                         "(slowest − fastest).")


# --- 2. editing ----------------------------------------------------------------------------------

edit_col, script_col = st.columns([3, 2])
with edit_col:
    # a new key (another file, or one more edit) resets the editor to the cached text; text typed and not applied
    # stays across a page switch
    edited = st.text_area("Editor", state.text, height=360, persist_state="session",
                          key=f"ce_editor_{ss.get('ce_serial', 0)}_{len(session.results)}")
    if st.button("Apply editor changes", key="ce_apply"):
        if edited == state.text:
            st.info("The editor holds the cached text; change something first.")
        else:
            try:
                with st.spinner("Re-prefilling the suffix and a full prefill for comparison…"):
                    session.apply_text(edited, repeats)
                st.rerun()
            except KvlabError as exc:
                st.error(str(exc))

with script_col:
    scripts = {p.name: p for p in edit_scripts()}
    stem = session.source.rsplit("/", 1)[-1].removesuffix(".py") + ".json"
    names = sorted(scripts)
    script_name = st.selectbox("Scripted edit sequence (data/edits)", names,
                               index=names.index(stem) if stem in names else names.index("generic.json"),
                               persist_state="session",
                               key=f"ce_script:{session.source}")  # each source opens on its own script
    try:
        script = load_script(scripts[script_name])
        with st.container(height=220, key="ce_script_edits"):  # lines wrap in a narrow column; a table would cut them
            where = [f"line {e.line}" if e.line else f"at {e.at:.0%}" for e in script.edits]
            st.markdown("\n".join(f"{i}. {as_written(e.label)} · *{e.op} {at}*"
                                   for i, (e, at) in enumerate(zip(script.edits, where), 1)))
    except KvlabError as exc:
        script = None
        st.error(str(exc))
    asked = ss.pop("ce_stop_asked", False)
    if (cut := ss.pop("ce_playing", None)) is not None:  # (the sequence, its edits), set while it plays
        done = session.played(cut[0]) or 0
        rest = " Play it again to measure the rest." if done < cut[1] else " Every edit had been measured."
        if asked:
            st.info(f"Stopped, as asked, after {done} of the sequence's {cut[1]} edits; the edits measured are "
                    f"below.{rest}")
        else:
            st.warning(f"The sequence stopped after {done} of its {cut[1]} edits: another click ran the page again "
                       f"while it played.{rest}")
    # a sequence stopped part-way goes on from there, unless other edits came in (see ``EditSession.played``)
    start = session.played(script_name)
    left = script.edits[start:] if script is not None and start is not None else ()
    if script is not None and start is None:
        st.caption(f"The file has been edited apart from {script_name}, whose edits are written for the file as "
                   "loaded and as they leave it: start over to play them.")
    if left:  # what a click costs, before it is clicked
        n = len(state.ids)
        st.caption(f"Plays {'the ' + str(len(left)) + ' edits left of ' if start else ''}{len(script.edits)} edits: "
                   f"each re-prefilled and fully prefilled {repeats}× to time it, {2 * len(left) * repeats} forwards "
                   f"of up to {n:,} token{'s' * (n != 1)}.")
    elif script is not None:
        if start == len(script.edits):
            st.caption(f"Every edit of {script_name} has been played on this file.")
        if st.button("Start over from the file as loaded", key="ce_restart"):
            with st.spinner("Prefilling the file…"):
                ss.ce_session = EditSession.start(lm, session.texts[0], session.source)
                ss.ce_serial = ss.get("ce_serial", 0) + 1
            st.rerun()
    if left and st.button("Play sequence", key="ce_play"):
        stop_button("ce_play_stop", "ce_stop_asked", "Ends the sequence once the edit being measured is done; the "
                                                     "edits measured so far stay.")
        progress = page_bar()
        with marked_while_running("ce_playing", (script_name, len(script.edits))):
            try:
                for i, edit in enumerate(left, start + 1):
                    session.apply(edit, repeats, script_name, after=i - 1)
                    progress((i - start) / len(left), f"{i}/{len(script.edits)}: {as_written(edit.label)}")
            except KvlabError as exc:
                ss.ce_play_error = f"The sequence stopped: {exc}"  # shown after the rerun, which would wipe it now
        st.rerun()
    if stopped := ss.pop("ce_play_error", None):
        st.error(stopped)


# --- 3. timeline ---------------------------------------------------------------------------------

st.header("Prefix reuse per edit")
if session.results:
    table = session.table()
    st.plotly_chart(timeline_figure(table), width="stretch", key="ce_timeline")
    runs_short = [" · ".join(short_number("speedups", x) for x in xs) for xs in table["speedups"]]  # a list a cell
    data, config = compact_table(table.assign(speedups=runs_short), HEADERS, pinned="label")
    st.dataframe(data, hide_index=True, width="stretch", placeholder="—", column_config=config)
    worst = table["max_logit_diff"].max()
    st.caption(f"Largest last-token logit difference, reuse vs a full prefill of the new text: {worst:.2e} "
               "(float32 noise). Reuse % = tokens reused / tokens after the edit.")
    runs = int(table["runs"].min())
    st.caption(SINGLE_RUN_NOTE if runs == 1 else
               f"Times are medians of {runs} runs, each timing the re-prefill and a full prefill back to back. The "
               "bars on “time saved” span the run that saved least to the one that saved most; the spread columns, "
               "each side's fastest to slowest run. A bar that reaches below “no time saved” is no measured saving "
               "on this machine.")
    c1, c2 = st.columns(2)
    c1.download_button("Edits (CSV)", table_csv(table), "edits.csv", "text/csv", key="ce_dl_edits_csv",
                       on_click="ignore")
    c2.download_button("Edits (JSON)", to_json(table, indent=2), "edits.json", "application/json",
                       key="ce_dl_edits_json", on_click="ignore")
else:
    st.info("Edit the code or play a sequence to see how much of the cache each edit keeps.")


# --- 4. cost accounting --------------------------------------------------------------------------

st.header("What CLA and YOCO would save: cost accounting")
chosen = st.multiselect("Sharing schemes", OFFERED_SCHEMES, default=list(OFFERED_SCHEMES),
                        persist_state="session", key="ce_schemes",
                        format_func=scheme_label)
schemes = [make_scheme(n, lm.facts.n_layers) for n in chosen]
if session.results:
    spans = session.spans()
    st.caption(f"Summed over the re-prefill{'s' * (len(spans) != 1)} of this session's "
               f"{'edit' if len(spans) == 1 else f'{len(spans)} edits'}.")
else:
    at = st.slider("Edit position (% of the file)", 0, 99, 50, persist_state="session", key="ce_cost_at")
    prefix = len(state.ids) * at // 100
    spans = [(prefix, len(state.ids) - prefix)]
    st.caption(f"A hypothetical edit at {at}% of the file: {spans[0][0]:,} tokens reused, {spans[0][1]:,} "
               "re-prefilled.")
costs = cost_table(lm.facts, schemes, spans)
st.plotly_chart(cost_share_figure(costs), width="stretch", key="ce_costs")
st.markdown(
    "The notes claim that with cross-layer sharing *re-prefill drops from O(N_layers) to "
    "O(N_layers / sharing ratio)* (◆, the **claimed share**). The computed **compute share** is what is really "
    "saved: CLA skips only the K and V projections of non-producing layers (plus their K/V memory); their "
    "queries, attention and MLP still run. YOCO's prefill runs the upper half for the last token only."
)
# MiB as every other page counts K/V (Streamlit's "bytes" format counts in 1,000s: 75.5MB for 72.0 MiB)
shown = costs.assign(kv_mib_stored=costs["kv_bytes_stored"] / MIB)
data, config = compact_table(shown[["scheme", "kv_layers", "claim_share", "compute_share", "kv_bytes_share",
                                    "total_flops", "kv_mib_stored"]], HEADERS)
st.dataframe(data, hide_index=True, width="stretch",
             column_config=config | {"total_flops": st.column_config.NumberColumn("FLOPs", format="scientific")},
             placeholder="—")
st.download_button("Cost table (CSV)", table_csv(costs), "costs.csv", "text/csv", key="ce_dl_costs", on_click="ignore")


# --- 5. measured approximation -------------------------------------------------------------------

st.header("Measured: training-free sharing on the loaded model")
st.warning(
    "This model was pretrained without sharing: every layer expects its own K/V. Feeding it another layer's "
    "K/V measures how far it is from such a model, so the fidelity loss shown here is an upper bound on what a "
    "model trained with CLA or YOCO would lose. The time ratios are real."
)
shared = len({s.name for s in schemes} - {"full"})  # Full runs beside them in any case
n_runs = (shared + 1) * len(session.texts) * repeats
edits, n = len(session.texts) - 1, len(state.ids)
st.caption(f"Measures Full and {shared} scheme{'s' * (shared != 1)} on the file"
           + (f" and its {edits} edit{'s' * (edits != 1)}" if edits else "")
           + f", {repeats} round{'s' * (repeats != 1)} each: {n_runs} layer-by-layer forwards of up to {n:,} "
           f"token{'s' * (n != 1)}.")
if ss.pop("ce_measuring", False):  # Stop or another click ended the measurement
    say_cut_short("The measurement of sharing", asked, "no number of it is kept", "Measure again to see them.")
if refusal := sharing_refusal(session.lm):
    st.error(f"Measuring is not available: {refusal}.")
if st.button("Measure sharing on this session", key="ce_measure",
             disabled=not schemes or refusal is not None):
    stop, slot = st.empty(), st.empty()
    stop_button("ce_measure_stop", "ce_stop_asked", "Ends the measurement at its next step; nothing of it is kept.",
                stop)
    with marked_while_running("ce_measuring"):
        try:
            session.measure(schemes, repeats=repeats, progress=page_bar(container=slot))
        except KvlabError as exc:
            st.error(str(exc))
    stop.empty()  # the table below says it is done
    slot.empty()
if session.sharing is not None:
    summary, times = session.sharing
    edited = bool(summary["reprefill_s"].notna().any())  # re-prefills are timed over the session's edits
    first = ["scheme", "prefill_time_ratio", "reprefill_time_ratio", "kl_mean", "kl_max", "top1"]  # the caption's
    shown = summary[first + [c for c in summary.columns if c not in first]]
    if not edited:  # columns of "—" only
        shown = shown.drop(columns=["reprefill_time_ratio", "reprefill_s"])
    data, config = compact_table(shown, HEADERS, pinned="scheme")  # the scheme in view as it scrolls
    st.dataframe(data, hide_index=True, width="stretch", column_config=config, placeholder="—")
    if int(summary["runs"].min()) == 1:
        st.caption(SINGLE_RUN_NOTE)
    st.caption("Time ratios compare the same layer-by-layer loop with and without sharing (Full = 1): each is the "
               "median of the rounds' ratios, every round timing the scheme beside Full, while the seconds are each "
               "side's own median, so on a busy machine a ratio and the seconds beside it can disagree. KL and "
               f"top-1 compare next-token distributions over the last {int(summary['positions'].iloc[0])} "
               "positions of the original file with the unshared model."
               + ("" if edited else " Make an edit above and measure again to time the re-prefills with sharing."))
    c1, c2 = st.columns(2)
    c1.download_button("Sharing (CSV)", table_csv(summary), "sharing.csv", "text/csv", key="ce_dl_sh_csv",
                       on_click="ignore")
    c2.download_button("Sharing (JSON)", to_json({"summary": summary, "times": times}, indent=2),
                       "sharing.json", "application/json", key="ce_dl_sh_json", on_click="ignore")


# --- 6. adjacent-layer similarity ----------------------------------------------------------------

st.header("Adjacent-layer K/V similarity")
st.caption("MiniCache merges adjacent layers' K/V because they are similar in deep layers. Cosine similarity of "
           "each token's K (after RoPE: same rotation in both layers) and V between layer l and l+1, "
           "mean over the cached file's tokens.")
similarity = session.similarity()
# one above the other: side by side beside the sidebar of a 900 px window, each had about 200 px
st.plotly_chart(similarity_heatmap(similarity), width="stretch", key="ce_sim_heat")
st.plotly_chart(similarity_curve(similarity), width="stretch", key="ce_sim_curve")
deep = deep_similarity(similarity)
k_cos, v_cos = (round(deep[t], 2) + 0.0 for t in "KV")  # + 0.0: a cosine that rounds to zero prints 0.00, not -0.00
st.caption(f"Here the deeper half of the layer pairs averages a cosine of {k_cos:.2f} for K and "
           f"{v_cos:.2f} for V (1: the same vectors, 0: unrelated): the closer to 1, the less merging them would "
           "lose on this model.")
st.download_button("Similarity (CSV)", table_csv(similarity), "similarity.csv", "text/csv",
                   key="ce_dl_sim", on_click="ignore")

download_all_figures("code")
