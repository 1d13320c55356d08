"""kvlab: which KV-cache algorithm fits which workload? Run with `make run`."""

import streamlit as st

st.set_page_config(page_title="kvlab", page_icon="🧪", layout="wide")

PAGES = [
    st.Page("pages/home.py", title="Home", icon="🏠", default=True),
    st.Page("pages/chat.py", title="Multi-turn chat", icon="💬"),
    st.Page("pages/rag.py", title="RAG & RoPE drift", icon="📚"),
    st.Page("pages/code_edits.py", title="Code edits & CLA", icon="🧑‍💻"),
]

st.navigation(PAGES).run()
