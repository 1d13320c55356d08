"""Training-free cross-layer K/V sharing (CLA, YOCO): the layouts and the layer-by-layer forward."""
