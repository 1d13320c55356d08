"""Experiments over the workloads: the arena grid (in process or on Ray), its report, the benchmarks."""
