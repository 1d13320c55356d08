"""Plotly figures: pure functions from data to go.Figure."""

SYMBOLS = ["circle", "square", "diamond", "triangle-up", "cross", "x", "star", "hexagon"]  # told apart without colour
