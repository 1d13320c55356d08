import streamlit as st

st.title("kvlab")
st.write("Which KV-cache algorithm fits which workload?")
