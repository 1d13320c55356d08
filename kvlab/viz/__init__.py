"""Plotly figures: pure functions from data to go.Figure."""

SYMBOLS = ["circle", "square", "diamond", "triangle-up", "cross", "x", "star", "hexagon"]  # told apart without colour
# Traces at equal values (every policy at KL 0, or finding no answer) would hide all but the last one drawn, so each
# trace (``offsetgroup``) puts its markers beside the others' around the shared x: plotly's grouped scatter
SIDE_BY_SIDE = {"scattermode": "group", "scattergap": 0.5}
