"""kvlab: which KV-cache algorithm fits which workload? Run with `make run`."""

import streamlit as st

st.set_page_config(page_title="kvlab", page_icon=":material/science:", layout="wide")

PAGES = [
    st.Page("pages/home.py", title="Home", icon=":material/home:", default=True),
    st.Page("pages/chat.py", title="Multi-turn chat", icon=":material/forum:"),
    st.Page("pages/rag.py", title="RAG & RoPE drift", icon=":material/library_books:"),
    st.Page("pages/code_edits.py", title="Code edits & CLA", icon=":material/code:"),
    st.Page("pages/arena.py", title="Policy arena", icon=":material/leaderboard:"),
]

st.navigation(PAGES).run()
