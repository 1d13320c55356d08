"""Lessons: each claim of the notes as a guided live experiment with a verdict from the run."""

from __future__ import annotations

import json

import streamlit as st

from kvlab.engine.conversion import EMBEDDED_MODELS, GEMMA
from kvlab.errors import KvlabError
from kvlab.export import to_json
from kvlab.files import MB
from kvlab.lessons import LESSONS, Lesson, Verdict
from kvlab.lessons.record import lesson_from_json, lesson_record
from kvlab.saved import MAX_RECORD_BYTES, ReplayCheck, differences, now, read_json
from ui.common import marked_while_running, page_bar, page_start, say_cut_short, say_replay, stop_button
from ui.figures import download_all_figures
from ui.tables import compact_table

RUNNING, STOP_ASKED = "lesson_running", "lesson_stop_asked"  # a run in progress (its title); its Stop clicked
OUTCOME_HEAD = {"supports": "The run supports the claim", "contradicts": "The run contradicts the claim",
                "mixed": "The run partly supports the claim", "inconclusive": "No verdict"}

lm = page_start(
    "Lessons",
    "Each lesson takes one claim of the notes, runs a calibrated experiment on the model in the sidebar and "
    "says, from the run's own numbers, whether the claim holds here. Nothing is precomputed: every figure and "
    "verdict comes from the run you start.",
)
ss = st.session_state
results: dict[tuple[str, str], dict] = ss.setdefault("lesson_results", {})
opened: dict[str, tuple] = ss.setdefault("lesson_opened", {})  # lesson key -> (result, stamp) from a file
checks: dict[str, ReplayCheck] = ss.setdefault("lesson_checks", {})  # lesson key -> a file's run again


def open_file() -> None:
    """The uploader's callback (before the page draws, so the lesson picker can move to the file's lesson)."""
    upload = ss.get("lesson_open")
    if upload is None:
        return
    try:
        lesson, result, made = lesson_from_json(read_json(upload.getvalue(), "lesson run"), LESSONS)
    except KvlabError as exc:
        ss.lesson_open_error = str(exc)
        return
    opened[lesson.key] = (result, made)
    ss.lesson = lesson.key


def show_verdict(verdict: Verdict) -> None:
    # a verdict against the claim is a finding, not a failure: red is for what went wrong
    box = {"supports": st.success, "contradicts": st.warning}.get(verdict.outcome, st.info)
    box(f"**{OUTCOME_HEAD[verdict.outcome]}.** {verdict.text}")


def switch_to_gemma() -> None:
    """Pick the embedded windowed model in the sidebar (a callback: it runs before the sidebar is drawn)."""
    ss["model_source"] = EMBEDDED_MODELS[GEMMA].label


def run(lesson: Lesson) -> None:
    with marked_while_running(RUNNING, lesson.title), \
            st.status(f"Running: {lesson.title}", expanded=True) as status:
        stop_button("lesson_stop", STOP_ASKED, "Ends the run at its next step; nothing of it is kept.")
        try:
            result = lesson.run(lm, page_bar())
        except KvlabError as exc:
            status.update(label=f"Failed: {exc}", state="error")
            return
        status.update(label=f"Done: {lesson.title}", state="complete", expanded=False)
    results[(lm.facts.name, lesson.key)] = result
    if (saved := opened.pop(lesson.key, None)) is not None:  # the live run is what the page shows now
        checks[lesson.key] = ReplayCheck(differences(saved[0], json.loads(to_json(result))), "every number",
                                         saved[1], lm.facts.name)


with st.popover("Open a saved run"):
    st.file_uploader("A downloaded lesson run (JSON): its verdict, figures and table drawn from the file at once, "
                     "no run", type=["json"], key="lesson_open", on_change=open_file,
                     max_upload_size=MAX_RECORD_BYTES // MB)
if (problem := ss.pop("lesson_open_error", None)) is not None:
    st.error(problem)

keys = list(LESSONS)
key = st.radio("Lesson", keys, persist_state="session", key="lesson", horizontal=True,
               format_func=lambda k: f"{keys.index(k) + 1}. {LESSONS[k].title}")
lesson = LESSONS[key]
st.subheader(lesson.title)
st.markdown(f"**Claim.** {lesson.claim}")
st.markdown(f"**Preset.** {lesson.preset}")
asked, cut = ss.pop(STOP_ASKED, False), ss.pop(RUNNING, None)  # a run cut short (before this lesson may stop)
if cut:
    again = "Press Run" if cut == lesson.title else f"Open “{cut}” and press Run"
    say_cut_short(f"The run of “{cut}”", asked, "it has no verdict", f"{again} to run it again.")
if reason := lesson.unavailable(lm):
    st.info(reason)
    if lesson.key == "windows" and lm.facts.name != GEMMA:
        st.button("Switch to the embedded Gemma-3-270M", on_click=switch_to_gemma, key="lesson_switch")
    if key not in opened:  # a saved run still opens: it needs no model
        st.stop()
# One key for every lesson's Run: a click that lands while the page redraws after a lesson change still
# reaches this run (with a key per lesson, that click would name a widget no longer drawn, and be dropped).
if st.button("Run", type="primary", key="lesson_run", disabled=bool(reason)):
    run(lesson)

made = None
if key in opened:
    result, made = opened[key]
    st.info(f"**Opened from a file, no run**: the verdict, figures and table below are the file's "
            f"({made.label()}). **Run** runs the lesson again on the model in the sidebar and checks that every "
            "number but the timings comes out as in the file.")
else:
    result = results.get((lm.facts.name, key))
    if (check := checks.get(key)) is not None:
        say_replay(check)
if result is None:
    st.caption("Press Run: the experiment runs live on the model in the sidebar.")
    st.stop()
verdict = lesson.verdict(result)
show_verdict(verdict)
for i, fig in enumerate(lesson.figures(result)):
    st.plotly_chart(fig.figure, width="stretch", key=f"lesson_fig_{key}_{i}")
    st.caption(fig.reading)
if lesson.table is not None:
    table = lesson.table(result)
    data, config = compact_table(table, quiet=("error", "past the trained context"))  # a column unticked throughout
    st.dataframe(data, hide_index=True, width="stretch", placeholder="—", column_config=config)
record = lesson_record(lesson, result, verdict, made or now(lm.facts.name))
st.download_button("Download this run (JSON)", to_json(record, indent=1), f"lesson-{key}.json",
                   "application/json", key=f"lesson_dl_{key}", on_click="ignore")

download_all_figures(f"lesson-{key}")
