"""The progress panel of a page's background job (``kvlab.experiments.background``): a bar, Cancel, one redraw."""

from __future__ import annotations

from typing import Callable

import streamlit as st

from kvlab.engine.progress import with_left
from kvlab.experiments.background import BackgroundJob


def job_panel(prefix: str, text: Callable[[BackgroundJob], str], cancelling: str) -> None:
    """Tick the job kept at ``{prefix}_job`` once a second while it runs; once it stops, one full rerun draws
    its results (the run that draws them marks it ``{prefix}_drawn``, so the timer does not rerun again)."""
    state = st.session_state
    job: BackgroundJob | None = state.get(f"{prefix}_job")
    if job is not None and not job.running:
        state[f"{prefix}_drawn"] = job

    @st.fragment(run_every=1.0 if job is not None and job.running else None)
    def panel() -> None:
        current: BackgroundJob | None = state.get(f"{prefix}_job")
        if current is None:
            return
        if current.running:
            st.progress(min(current.fraction, 1.0), text=with_left(text(current), current.time_left))
            if st.button("Cancel", key=f"{prefix}_cancel", disabled=current.cancel_event.is_set()):
                current.cancel()
                st.caption(cancelling)
        elif state.get(f"{prefix}_drawn") is not current:
            st.rerun()

    panel()
