"""Plotly figures: pure functions from data to go.Figure."""
