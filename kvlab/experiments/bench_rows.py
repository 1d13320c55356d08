"""What a benchmark run is made of: its sizes (``BenchConfig``), its rows (``BenchRow``, each a median over paired
runs with a target), the printed table and the JSON the command writes."""

from __future__ import annotations

import math
import os
import platform
import statistics
from dataclasses import asdict, dataclass, field

import pandas as pd
import torch
import transformers

from kvlab.engine.facts import LoadedModel
from kvlab.engine.linear import cpuinfo, few_rows_library
from kvlab.saved import stamp


@dataclass(frozen=True)
class BenchConfig:
    """Input sizes and repetitions of one benchmark run."""

    runs: int = 5
    turn_tokens: int = 1024  # user message of the chat turns
    new_tokens: int = 32  # reply tokens of the chat turns
    budget: int = 256  # per-layer budget of the evicting policies
    contexts: tuple[int, ...] = (1024, 2048, 4096)  # first-turn messages of the turn-by-turn rows
    turn_runs: int = 5  # a 4k pair of chats takes most of a minute on a CPU; 3 runs moved their medians by ±0.3
    rag_docs: int = 4
    code_tokens: int = 2048  # size of the edited file
    memory_tokens: int = 2048  # prefill length of the attention-statistics memory row
    decode_steps: int = 24  # Quest's step rows: a step takes about 65 ms at 2k tokens and one pair's ratio moves ±0.1
    grid_budgets: tuple[int, ...] = (16, 24, 32, 48)  # the Ray workers row's grid: one cell per budget
    grid_turns: int = 3
    grid_runs: int = 3  # each run starts Ray twice, so fewer than the other rows
    stream_cache: int = 1024  # the stream rows' cache (StreamingLLM's Table 1 size) and recompute window
    stream_tokens: int = 1536  # tokens each stream row reads: the cache filled, then evicting
    stream_runs: int = 3  # a stream run takes a minute or more on a CPU, so fewer than the other rows


FULL = BenchConfig()
QUICK = BenchConfig(runs=1, turn_tokens=160, new_tokens=8, budget=64, contexts=(160,), turn_runs=1, code_tokens=512,
                    memory_tokens=512, decode_steps=2, grid_budgets=(16, 32), grid_turns=1, grid_runs=1,
                    stream_cache=128, stream_tokens=384, stream_runs=1)


@dataclass
class BenchRow:
    """One measured figure, its target and how it was obtained."""

    key: str
    label: str
    value: float
    unit: str  # "×", "%" or "MB"
    op: str  # "<=" or ">=": how value must compare with target
    target: float
    detail: str = ""
    samples: list[float] = field(default_factory=list)  # per-run values the median came from

    @property
    def passed(self) -> bool:
        ok = self.value <= self.target if self.op == "<=" else self.value >= self.target
        return math.isfinite(self.value) and ok

    def as_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def row(key: str, label: str, samples: list[float], unit: str, op: str, target: float, detail: str) -> BenchRow:
    """A row whose value is the median of ``samples`` (NaN where there are none: the row then fails)."""
    value = statistics.median(samples) if samples else float("nan")
    return BenchRow(key, label, value, unit, op, target, detail, samples)


def bench_table(rows: list[BenchRow]) -> pd.DataFrame:
    """The printed table: value (the median of the runs' ratios), the runs' spread, target and pass/fail per row."""
    def fmt(value: float, unit: str) -> str:
        if not math.isfinite(value):
            return "not measured"
        return f"{value:.2f}{unit}" if unit == "×" else f"{value:.2f} {unit}"

    def spread(r: BenchRow) -> str:  # a median of one run has none: say so rather than draw a range of one
        if len(r.samples) > 1:
            return f"{fmt(min(r.samples), r.unit)}–{fmt(max(r.samples), r.unit)}"
        return "one run" if r.samples else "no runs"
    return pd.DataFrame([{
        "benchmark": r.label, "value": fmt(r.value, r.unit), "spread": spread(r),
        "target": f"{'≤' if r.op == '<=' else '≥'} {fmt(r.target, r.unit)}", "pass": "pass" if r.passed else "FAIL",
        "runs": len(r.samples), "how": r.detail} for r in rows])


def processor() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what ``platform`` knows: the ratios move between CPUs of
    one architecture, so a result names its CPU."""
    return cpuinfo("model name") or platform.processor() or platform.machine()


def machine(lm: LoadedModel, threads: int) -> dict:
    """Where the numbers were measured."""
    return {
        "platform": platform.platform(), "processor": processor(),
        "cpu_count": os.cpu_count(), "torch_threads": threads, "torch": torch.__version__,
        "transformers": transformers.__version__, "model": lm.facts.name, "device": lm.facts.device,
        "dtype": lm.facts.dtype, "few_row_products": few_rows_library(lm.model),
    }


def results_json(lm: LoadedModel, cfg: BenchConfig, rows: list[BenchRow], quick: bool, threads: int) -> dict:
    """The JSON the command writes: machine, configuration and every row with its samples."""
    return {"kvlab_bench": 1, **stamp(lm.facts.name), "quick": quick, "machine": machine(lm, threads),
            "config": asdict(cfg),
            "rows": [r.as_dict() for r in rows]}
