"""kvlab: which KV-cache algorithm fits which workload? Run with `make run`."""

import streamlit as st

from ui.plugins import register_plugins

st.set_page_config(page_title="kvlab", page_icon=":material/science:", layout="wide")
register_plugins()  # before any page lists the policies

PAGES = [
    st.Page("app_pages/home.py", title="Home", icon=":material/home:", default=True),
    st.Page("app_pages/lessons.py", title="Lessons", icon=":material/school:"),
    st.Page("app_pages/chat.py", title="Multi-turn chat", icon=":material/forum:"),
    st.Page("app_pages/rag.py", title="RAG & RoPE drift", icon=":material/library_books:"),
    st.Page("app_pages/code_edits.py", title="Code edits & CLA", icon=":material/code:"),
    st.Page("app_pages/arena.py", title="Policy arena", icon=":material/leaderboard:"),
    st.Page("app_pages/streams.py", title="Streams", icon=":material/stream:"),
]

st.navigation(PAGES).run()
