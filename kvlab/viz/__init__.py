"""Plotly figures: pure functions from data to go.Figure."""

# Lines at equal values (every policy at 0 answers, three strategies at Full's 0 deviation) would hide all but the
# last one drawn, so each trace (``offsetgroup``) puts its markers and bars beside the others' around the shared x:
# plotly's grouped scatter, on linear and category axes (a log axis would spread them unevenly)
SIDE_BY_SIDE = {"scattermode": "group", "scattergap": 0.5}
SYMBOLS = ["circle", "square", "diamond", "triangle-up", "cross", "x", "star", "hexagon"]  # told apart without colour
