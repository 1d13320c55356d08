"""What a user picked stays picked when they go to another page and come back."""

from __future__ import annotations

import pytest
from page_helpers import open_page

pytestmark = pytest.mark.model  # the pages load the embedded model

HUB = "Hub id or local folder"


def test_the_model_choice_and_a_pages_settings_survive_a_walk_through_the_other_pages() -> None:
    at = open_page("app_pages/chat.py", timeout=300)
    at.number_input(key="chat_max_new").set_value(24)
    at.multiselect(key="chat_policies").set_value(["window"])
    at.sidebar.selectbox(key="model_dtype").set_value("float32").run()
    at.sidebar.radio(key="model_source").set_value(HUB).run()  # no id typed yet: the session keeps its model
    assert not at.exception
    for page in ("app_pages/rag.py", "app_pages/home.py", "app_pages/chat.py"):
        at.switch_page(page).run()
        assert not at.exception
        assert at.sidebar.radio(key="model_source").value == HUB, page
        assert at.sidebar.selectbox(key="model_dtype").value == "float32", page
        assert any("Still on" in w.value for w in at.sidebar.warning), page
    assert at.number_input(key="chat_max_new").value == 24
    assert at.multiselect(key="chat_policies").value == ["window"]


def test_text_typed_in_the_code_editor_and_not_applied_survives_a_page_switch() -> None:
    at = open_page("app_pages/code_edits.py", timeout=300)
    at.session_state["ce_source_kind"] = "Paste"
    at.run()
    editor = next(t for t in at.text_area if str(t.key).startswith("ce_editor_"))
    typed = editor.value + "print('typed, not applied')\n"
    editor.set_value(typed).run()
    at.switch_page("app_pages/home.py").run()
    at.switch_page("app_pages/code_edits.py").run()
    assert not at.exception
    assert next(t for t in at.text_area if str(t.key).startswith("ce_editor_")).value == typed
    at.button(key="ce_apply").click().run()  # applied: the editor holds the new cached text
    assert not at.exception and len(at.session_state["ce_session"].results) == 1
    assert next(t for t in at.text_area if str(t.key).startswith("ce_editor_")).value == typed
