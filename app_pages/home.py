"""Home: what the lab answers and where to look."""

import streamlit as st

from ui.common import model_sidebar

model_sidebar()
st.title("kvlab")
st.subheader("Which KV-cache algorithm fits which workload?")
st.markdown(
    "kvlab drives a real language model through four workloads and shows, as it runs, what each KV-cache policy "
    "keeps, frees, re-rotates or recomputes — and what that costs in fidelity, memory and time. Every chart comes "
    "from a live run of the model in the sidebar."
)
LINK_WIDTH = 200  # px: "Start here: Lessons" with its icon
PAGES = [
    ("app_pages/lessons.py", "Start here: Lessons", ":material/school:",
     "Each claim of the notes turned into a live experiment on the model, with a verdict drawn from the run."),
    ("app_pages/chat.py", "Multi-turn chat", ":material/forum:",
     "Do attention sinks exist in this model? What does StreamingLLM, H2O, SnapKV or PyramidKV keep after each "
     "turn, how much of it is freeable in paged blocks, and how far do their answers drift from the full cache as "
     "the conversation goes on?"),
    ("app_pages/rag.py", "RAG & RoPE drift", ":material/library_books:",
     "A document chunk was prefilled once at offset 0; what does reusing it at another offset cost (RoPE drift), "
     "and what do re-rotation, CacheBlend recompute, fixed ordering and reserved positions buy back?"),
    ("app_pages/code_edits.py", "Code edits & CLA", ":material/code:",
     "After an edit, how much of the cache survives (longest common token prefix), and what would cross-layer KV "
     "sharing (CLA, YOCO) really save on re-prefill?"),
    ("app_pages/arena.py", "Policy arena", ":material/leaderboard:",
     "Which policy keeps answering at which budget, turn after turn, over whole workloads?"),
    ("app_pages/streams.py", "Streams", ":material/stream:",
     "Streamed past the trained context, which bounded cache keeps the perplexity near recomputing every window, "
     "and what do attention sinks have to do with it (StreamingLLM's own experiment)?"),
]
for path, label, icon, question in PAGES:
    # the link keeps the width of the widest label, whole at any window width; the question takes the rest
    with st.container(horizontal=True, vertical_alignment="center", wrap=False):
        st.page_link(path, label=label, icon=icon, width=LINK_WIDTH)
        st.markdown(question)
st.markdown(
    "Policies are compared against **Full**, which is exact (its logits equal a plain forward). Fidelity is the KL "
    "divergence of next-token distributions and the top-1 agreement with Full while every cache is fed the same reply."
)
