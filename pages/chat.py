import streamlit as st

from ui.common import model_sidebar

model = model_sidebar()
st.title("Multi-turn chat")
