"""``python -m kvlab bench``: speed and memory ratios against plain runs of the same model."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from kvlab.cli.bars import progress_bar
from kvlab.cli.interrupt import INTERRUPTED
from kvlab.cli.options import (
    add_model_options,
    add_threads_option,
    check_runs,
    check_threads,
    out_file,
    torch_threads,
)
from kvlab.engine.facts import LoadedModel
from kvlab.engine.linear import FEW_ROWS
from kvlab.engine.model import load_model
from kvlab.experiments.bench import BENCHES, run_bench
from kvlab.experiments.bench_rows import FULL, QUICK, BenchConfig, BenchRow, bench_table, machine, results_json
from kvlab.export import to_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark kvlab against plain transformers runs (ratios, medians)")
    p.add_argument("--quick", action="store_true", help="short inputs and one run (for CI)")
    p.add_argument("--runs", type=int, default=None, help="runs per timed ratio; the median counts "
                                                          f"(default {FULL.runs}, quick {QUICK.runs})")
    add_threads_option(p)
    add_model_options(p)
    p.add_argument("--out", default="bench_result.json", help="result JSON path (default %(default)s)")
    p.set_defaults(func=run)


def _measure(lm: LoadedModel, cfg: BenchConfig) -> tuple[list[BenchRow], int]:
    """The rows of every benchmark that finished, and how many finished (fewer than all where Ctrl-C stopped it)."""
    bar, progress = progress_bar("bench", 100, "%")  # each benchmark an equal share, whatever its length
    rows: list[BenchRow] = []
    done = 0
    try:
        with bar:
            for finished in run_bench(lm, cfg, progress):
                rows, done = rows + finished, done + 1
    except KeyboardInterrupt:  # the benchmark under way is lost; those done are minutes of work, kept
        pass
    return rows, done


def run(args: argparse.Namespace) -> int:
    cfg = QUICK if args.quick else FULL
    if args.runs is not None:
        check_runs(args.runs)
        cfg = replace(cfg, runs=args.runs)
    check_threads(args.threads)
    out = out_file(args.out)
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    with torch_threads(args.threads) as threads:
        rows, done = _measure(lm, cfg)
    named = BENCHES[min(done, len(BENCHES) - 1)].__name__.removeprefix("bench_").replace("_", " ")
    stopped = f"bench stopped in benchmark {done + 1} of {len(BENCHES)} ({named})"
    if not done:
        print(f"\nkvlab: interrupted: {stopped} and wrote no result", file=sys.stderr)
        return INTERRUPTED
    record = results_json(lm, cfg, rows, args.quick, threads) | {"interrupted": done < len(BENCHES)}
    out.write_text(to_json(record, indent=1), encoding="utf-8")
    info = machine(lm, threads)
    print(f"{info['model']} on {info['device']} ({info['dtype']}), {info['processor']}, {info['cpu_count']} CPUs, "
          f"{info['torch_threads']} torch threads, products of ≤ {FEW_ROWS} rows by {info['few_row_products']}, "
          f"torch {info['torch']}, transformers {info['transformers']}")
    print(bench_table(rows).to_string(index=False))
    print(f"{sum(r.passed for r in rows)}/{len(rows)} targets met; wrote {out}")
    if done < len(BENCHES):
        print(f"kvlab: interrupted: {stopped}; {out} holds the rows of the {done} that finished", file=sys.stderr)
        return INTERRUPTED
    unmeasured = [r.key for r in rows if not r.samples]
    if unmeasured:
        print(f"not measured (see the table's 'how'): {', '.join(unmeasured)}", file=sys.stderr)
    return 1 if unmeasured else 0
