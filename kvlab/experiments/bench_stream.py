"""Stream benchmarks: what StreamingLLM's bounded cache costs per token against the exact sliding window that
recomputes its keys, and four policies streamed side by side against one.

Rows:

- ``stream_recompute``: the sliding window with recomputation's time over StreamingLLM's (4 sinks) on the same
  stream, at a cache of ``stream_cache`` tokens; both run in one stream, chunk after chunk, so each chunk times
  the two back to back. StreamingLLM's paper reports 22.2× per token on a GPU at cache 1024.
- ``stream_side_by_side``: four eviction policies streamed side by side over StreamingLLM alone, in alternating
  runs (one, four, four, one, …).
"""

from __future__ import annotations

import statistics

from kvlab.engine.facts import LoadedModel
from kvlab.engine.progress import Progress, part_of
from kvlab.experiments.bench_rows import BenchConfig, BenchRow, row
from kvlab.workloads.stream.run import StreamResult, run_stream
from kvlab.workloads.stream.settings import RECOMPUTE, StreamSettings
from kvlab.workloads.stream.text import default_text, stream_ids

SIDE_BY_SIDE = ("streamingllm", "window", "h2o", "tova")


def _stream(lm: LoadedModel, ids: list[int], cfg: BenchConfig, policies: tuple[str, ...],
            progress: Progress | None) -> StreamResult:
    result = run_stream(lm, ids, StreamSettings(policies=policies, budget=cfg.stream_cache), progress)
    if failed := {n: t.error for n, t in result.traces.items() if t.error}:
        raise RuntimeError(f"a benchmark stream failed: {failed}")
    return result


def bench_stream(lm: LoadedModel, cfg: BenchConfig, progress: Progress | None = None) -> list[BenchRow]:
    """StreamingLLM against recompute, and four policies side by side against one, on the default text."""
    ids = stream_ids(lm.encode, default_text(), cfg.stream_tokens)
    steps = 3 * cfg.stream_runs
    speedups, side = [], []
    rates = {"streamingllm": [], RECOMPUTE: []}
    for run in range(cfg.stream_runs):
        step = 3 * run
        paired = _stream(lm, ids, cfg, ("streamingllm", RECOMPUTE),
                         progress and part_of(progress, step / steps, (step + 1) / steps))
        traces = paired.traces
        speedups.append(traces[RECOMPUTE].time_s / traces["streamingllm"].time_s)
        for name in rates:
            rates[name].append(len(traces[name].nll) / traces[name].time_s)
        order = (("streamingllm",), SIDE_BY_SIDE) if run % 2 == 0 else (SIDE_BY_SIDE, ("streamingllm",))
        took = {}
        for i, policies in enumerate(order, start=1):
            span = progress and part_of(progress, (step + i) / steps, (step + i + 1) / steps)
            took[len(policies)] = _stream(lm, ids, cfg, policies, span).time_s
        side.append(took[len(SIDE_BY_SIDE)] / took[1])
    where = f"{len(ids)} tokens of the default text, cache {cfg.stream_cache}, chunks of 64, re-rotated positions"
    median = {name: statistics.median(r) for name, r in rates.items()}
    return [
        row("stream_recompute", "Sliding window + recompute / StreamingLLM, time per streamed token",
                  speedups, "×", ">=", 1.0, f"{where}; {median['streamingllm']:.1f} vs {median[RECOMPUTE]:.1f} "
                  "tokens/s (each its own forwards); the paper: 22.2× per token on a GPU at cache 1024"),
        row("stream_side_by_side", f"{len(SIDE_BY_SIDE)} policies streamed side by side / StreamingLLM alone",
                  side, "×", "<=", 2.0, f"{where}; {', '.join(SIDE_BY_SIDE)} in one batch, alternating runs"),
    ]
