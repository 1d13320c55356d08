"""The code-edit page, driven headless with AppTest on a short pasted file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from kvlab.files import MB
from kvlab.paths import EDITS_DIR
from kvlab.workloads.code.edits import load_script
from kvlab.workloads.code.source import MAX_BYTES

pytestmark = pytest.mark.model  # the app loads the embedded model

APP = str(Path(__file__).resolve().parents[1] / "app.py")
PAGE = "app_pages/code_edits.py"


def _page(source: str = "Paste") -> AppTest:
    """The page on a short pasted file (the default project file would cost a 1.5k-token prefill), or on ``source``."""
    at = AppTest.from_file(APP, default_timeout=300)
    at.switch_page(PAGE)
    at.session_state["ce_source_kind"] = source
    return at.run()


def _editor(at: AppTest):
    return next(t for t in at.text_area if str(t.key).startswith("ce_editor_"))


def _script(at: AppTest):
    """The scripted-sequence choice of the file in the cache (each source keeps its own)."""
    return at.selectbox(key=f"ce_script:{at.session_state['ce_session'].source}")


def _table(at: AppTest, column: str):
    return next(df.value for df in at.dataframe if column in df.value.columns)


def test_the_upload_widget_states_the_limit_the_page_checks():
    at = _page("Upload")
    assert not at.exception
    assert [u.proto.max_upload_size_mb for u in at.get("file_uploader")] == [MAX_BYTES // MB]


def test_code_edit_page_flow():
    at = _page()
    assert not at.exception
    tokens = len(at.session_state["ce_session"].state.ids)
    assert tokens > 10
    assert any("upper bound" in w.value for w in at.warning)  # the page says sharing was never trained
    assert len(at.get("plotly_chart")) == 3  # cost shares + similarity heatmap + curve (no edits yet)
    assert any("deeper half of the layer pairs averages a cosine of" in c.value for c in at.caption)

    # a scripted sequence (generic.json fits any file) with prefix reuse
    assert _script(at).value == "generic.json"
    listed = next(m.value for m in at.markdown if "1. late: insert a comment at 90%" in m.value)
    assert listed.count("\n") == 6 and "7. end: append a comment · *insert at 100%*" in listed  # every edit, in order
    at.button(key="ce_play").click().run()
    assert not at.exception and not at.error
    assert "ce_playing" not in at.session_state  # played to the end: no warning of a cut-short sequence
    assert not any("The sequence stopped after" in w.value for w in at.warning)
    assert "ce_play" not in [b.key for b in at.button]  # played: its edits would not fit the file they made
    assert any(c.value.startswith("Every edit of generic.json has been played") for c in at.caption)
    edits = _table(at, "reuse_pct")
    assert len(edits) == 7 and (edits["max_logit_diff"] <= 1e-3).all()
    assert edits.loc[edits["label"] == "top: insert a header", "reuse_pct"].item() == 0.0
    number = r"\d+(\.\d+)?"  # 3 significant digits, not a float's 16
    assert all(re.fullmatch(rf"{number}( · {number})*", cell) for cell in edits["speedups"])
    assert len(at.get("plotly_chart")) == 4  # + the timeline

    # a manual edit in the editor at the very end keeps almost everything
    editor = _editor(at)
    editor.set_value(editor.value + "print(area(2, 3))\n")
    at.button(key="ce_apply").click().run()
    assert not at.exception
    edits = _table(at, "reuse_pct")
    assert len(edits) == 8 and edits["reuse_pct"].iloc[-1] > 80

    # measured sharing: CLA-2 and YOCO against Full
    at.multiselect(key="ce_schemes").set_value(["cla2", "yoco"]).run()
    at.button(key="ce_measure").click().run()
    assert not at.exception and not at.error
    summary = _table(at, "kl_mean")
    assert list(summary["scheme"]) == ["Full", "CLA-2", "YOCO"]
    assert list(summary.columns[:4]) == ["scheme", "prefill_time_ratio", "reprefill_time_ratio", "kl_mean"]  # cited
    assert summary["kl_mean"].iloc[0] == 0.0 and summary["compute_share"].iloc[1] < 1.0


def test_sharing_measured_before_any_edit_leaves_out_the_re_prefill_columns_and_says_how_to_get_them():
    at = _page()
    at.multiselect(key="ce_schemes").set_value(["cla2"]).run()
    # said in words as counted: no "scheme(s)", no "its 0 edit(s)"
    assert any(c.value.startswith("Measures Full and 1 scheme on the file, 3 rounds each:") for c in at.caption)
    at.button(key="ce_measure").click().run()
    assert not at.exception and not at.error
    summary = _table(at, "kl_mean")
    assert list(summary["scheme"]) == ["Full", "CLA-2"] and "prefill_time_ratio" in summary
    assert "reprefill_time_ratio" not in summary and "reprefill_s" not in summary  # no edit: nothing was timed
    assert any("Make an edit above and measure again" in c.value for c in at.caption)


def test_a_sequence_that_stops_says_why_and_keeps_its_edits():
    at = _page()
    _script(at).set_value("lru_scheduler.json").run()  # its edits name lines of a 200-line file
    assert any(r"delete Job.\_\_repr\_\_ ·" in m.value for m in at.markdown)  # shown as written, not in bold
    at.button(key="ce_play").click().run()
    assert not at.exception
    assert any(e.value.startswith("The sequence stopped:") and "outside" in e.value for e in at.error)
    assert not at.session_state["ce_session"].results  # the first edit already failed: nothing was applied

    at.radio(key="ce_source_kind").set_value("Installed module").run()  # another file opens on its own script
    assert _script(at).value == "generic.json" and not at.error


def test_bad_input_keeps_the_session():
    at = _page()
    pasted = at.session_state["ce_session"].state

    at.text_area(key="ce_paste").set_value("x = 1\n" * 3000).run()  # far beyond the 8k context
    assert not at.exception
    assert any("context" in e.value and "The cache below still holds `pasted`, loaded before" in e.value
               for e in at.error)
    assert at.session_state["ce_session"].state is pasted  # the cached file is still the pasted one

    at.radio(key="ce_source_kind").set_value("Installed module").run()  # json.scanner by default
    module = at.session_state["ce_session"].state
    assert module is not pasted and "scanner" in at.session_state["ce_session"].source
    at.text_input(key="ce_module").set_value("no_such_module_kvlab").run()
    assert not at.exception
    said = next(e.value for e in at.error if "no installed module" in e.value)
    assert "'no_such_module_kvlab'. The cache below still holds `" in said  # two sentences, the file in a code span
    assert at.session_state["ce_session"].state is module
    at.text_input(key="ce_module").set_value("json").run()  # a package: its source is json/__init__.py
    assert any("json/__init__.py)`" in m.value for m in at.markdown)  # a code span: markdown keeps the underscores


def test_a_sequence_cut_short_by_another_click_says_so_on_the_next_run():
    at = _page()
    at.session_state["ce_playing"] = (0, 9)  # as a click leaves it before the first of 9 edits was measured
    at.run()
    assert not at.exception
    said = ("The sequence stopped after 0 of its 9 edits: another click ran the page again while it played. Play "
            "it again to measure the rest.")
    assert [w.value for w in at.warning].count(said) == 1
    at.run()
    assert said not in [w.value for w in at.warning]  # said once


@pytest.mark.parametrize(("asked", "said"), [
    (True, "Stopped, as asked, after 0 of the sequence's 9 edits; the edits measured are below. Play it again to "
           "measure the rest."),
    (False, "The sequence stopped after 0 of its 9 edits: another click ran the page again while it played. Play it "
            "again to measure the rest."),
])
def test_stop_during_a_sequence_says_it_was_asked(asked: bool, said: str):
    at = _page()
    at.session_state["ce_playing"] = (0, 9)  # as Stop's click leaves it: the run that played was ended
    at.session_state["ce_stop_asked"] = asked
    at.run()
    assert not at.exception
    assert [m.value for m in (*at.info, *at.warning)].count(said) == 1
    assert "ce_stop_asked" not in at.session_state


@pytest.mark.parametrize(("asked", "said"), [
    (True, "The measurement of sharing stopped before it finished, as asked, so no number of it is kept. Measure "
           "again to see them."),
    (False, "The measurement of sharing stopped before it finished: another click or a page change ran the page "
            "again while it ran, so no number of it is kept. Measure again to see them."),
])
def test_a_measurement_ended_early_says_so_and_keeps_nothing(asked: bool, said: str):
    at = _page()
    at.session_state["ce_measuring"] = True
    at.session_state["ce_stop_asked"] = asked
    at.run()
    assert not at.exception and [m.value for m in (at.info if asked else at.warning)].count(said) == 1
    assert at.session_state["ce_session"].sharing is None
    at.run()
    assert said not in [m.value for m in (*at.info, *at.warning)]  # said once


def test_a_sequence_stopped_part_way_goes_on_from_its_next_edit():
    """A walk found Play after a Stop starting the sequence over on the edited file, where its edits no longer fit."""
    at = _page()
    session = at.session_state["ce_session"]
    for edit in load_script(EDITS_DIR / "generic.json").edits[:5]:  # as a Stop after 5 of 7 leaves it
        session.apply(edit, 1, "generic.json")
    at.run()
    assert any(c.value.startswith("Plays the 2 edits left of 7 edits") for c in at.caption)
    at.button(key="ce_play").click().run()
    assert not at.exception and not at.error
    edits = _table(at, "reuse_pct")
    labels = [e.label for e in load_script(EDITS_DIR / "generic.json").edits]
    assert list(edits["label"]) == labels  # the 6th and 7th played after the first five, none twice
    assert "ce_play" not in [b.key for b in at.button]
    at.button(key="ce_restart").click().run()  # the file as loaded, its sequence to play again
    assert not at.exception and not at.session_state["ce_session"].results and at.button(key="ce_play")


def test_a_sequence_is_not_offered_on_a_file_edited_apart_from_it():
    """A walk applied edits by hand, then Play: the sequence's first edit did not find its line ("line 205 does not
    hold the expected text"), though the page had offered all 9."""
    at = _page()
    _editor(at).set_value(_editor(at).value + "# by hand\n")
    at.button(key="ce_apply").click().run()
    assert not at.exception and len(at.session_state["ce_session"].results) == 1
    assert "ce_play" not in [b.key for b in at.button] and at.button(key="ce_restart")
    assert any("edited apart from generic.json" in c.value for c in at.caption)
    assert any(c.value == "Summed over the re-prefill of this session's edit." for c in at.caption)
