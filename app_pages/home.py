"""Home: what the lab answers and where to look."""

import streamlit as st

from ui.common import model_sidebar
from ui.pages import PAGES

model_sidebar()
st.title("kvlab")
st.subheader("Which KV-cache algorithm fits which workload?")
st.markdown(
    "kvlab drives a real language model through four workloads and shows, as it runs, what each KV-cache policy "
    "keeps, frees, re-rotates or recomputes — and what that costs in fidelity, memory and time. Every chart comes "
    "from a live run of the model in the sidebar."
)
LINK_WIDTH = 200  # px: "Start here: Lessons" with its icon
for page in PAGES:
    # the link keeps the width of the widest label, whole at any window width; the question takes the rest
    with st.container(horizontal=True, vertical_alignment="center", wrap=False):
        st.page_link(page.path, label=page.link or page.title, icon=page.icon, width=LINK_WIDTH)
        st.markdown(page.question)
st.markdown(
    "Policies are compared against **Full**, which is exact (its logits equal a plain forward). Fidelity is the KL "
    "divergence of next-token distributions and the top-1 agreement with Full while every cache is fed the same reply."
)
