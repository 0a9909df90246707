"""Figures: plots (matplotlib figures from arrays: patterns, heads, branches,
routing, patching, flows, the circuit graph and the dataset measures of
dclens.analysis.heads; each a plots.Figure, which shows itself inline in
Jupyter), heatmaps (the engine's PNG renders, PNG objects, inline too) and
explorer (the interactive HTML page, built on the analyses)."""
