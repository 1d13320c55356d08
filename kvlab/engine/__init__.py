"""The engine: the loaded model, kvlab's attention, per-layer KV caches and the forward/decode loops.

It imports nothing from policies, workloads, experiments, figures or the CLI.
"""
