"""Streamlit helpers shared by the pages (the only package besides app_pages/ that imports streamlit)."""
