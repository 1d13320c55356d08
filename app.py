"""kvlab: which KV-cache algorithm fits which workload? Run with `make run`."""

import streamlit as st

from ui.pages import PAGES
from ui.plugins import register_plugins

st.set_page_config(page_title="kvlab", page_icon=":material/science:", layout="wide")
register_plugins()  # before any page lists the policies

home = st.Page("app_pages/home.py", title="Home", icon=":material/home:", default=True)
st.navigation([home] + [st.Page(p.path, title=p.title, icon=p.icon) for p in PAGES]).run()
