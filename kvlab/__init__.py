"""kvlab: which KV-cache algorithm fits which workload, measured on a real model."""

__version__ = "0.24.0"  # stamped on every saved run (kvlab.saved)
