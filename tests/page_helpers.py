"""Opening one page of the app under Streamlit's AppTest, as a user who lands on Home and clicks it."""

from __future__ import annotations

from pathlib import Path

from streamlit.testing.v1 import AppTest

APP = str(Path(__file__).resolve().parents[1] / "app.py")


def open_page(page: str, timeout: int = 600) -> AppTest:
    """The app with ``page`` (e.g. ``app_pages/chat.py``) opened and run once."""
    at = AppTest.from_file(APP, default_timeout=timeout)
    at.run()
    at.switch_page(page).run()
    return at
