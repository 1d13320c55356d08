"""`python -m kvlab bench --quick`: every row present with finite numbers (timings are never asserted)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from kvlab import __version__
from kvlab.cli import main
from kvlab.cli.interrupt import INTERRUPTED
from kvlab.engine.facts import LoadedModel
from kvlab.engine.reference import plain_rows_ratio, plain_step_seconds
from kvlab.engine.tensor_memory import TensorMemory
from kvlab.experiments.bench import BENCHES, code_text, prose_ids
from kvlab.experiments.bench_rows import QUICK, BenchRow, bench_table, processor
from kvlab.experiments.bench_stream import bench_stream
from kvlab.export import to_json

ROWS = ["full_turn", "five_policies", "evict_share", "follow_up_ttft", "first_turn_160", "follow_up_160",
        "rag_recompose", "rag_cacheblend", "edit_reprefill", "probe_memory", "quest_reads", "quest_step",
        "quest_attention", "quest_metadata", "kivi_memory", "stream_recompute", "stream_side_by_side", "arena_workers"]


@pytest.mark.model
def test_quick_bench_prints_and_writes_every_row(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "bench.json"
    threads = torch.get_num_threads()
    assert main(["bench", "--quick", "--threads", "1", "--out", str(out)]) == 0
    assert torch.get_num_threads() == threads  # the command restores the process's setting
    data = json.loads(out.read_text())
    assert data["quick"] is True and data["config"]["runs"] == 1 and data["machine"]["torch_threads"] == 1
    assert data["kvlab_version"] == __version__ and data["saved_at"].endswith("UTC")  # stamped as every record
    assert data["machine"]["few_row_products"] in ("linear", "oneDNN")
    rows = {r["key"]: r for r in data["rows"]}
    assert list(rows) == ROWS
    for key, row in rows.items():
        assert math.isfinite(row["value"]) and row["value"] > 0, key
        assert len(row["samples"]) >= 1 and all(math.isfinite(s) for s in row["samples"]), key
        assert row["passed"] == (row["value"] <= row["target"] if row["op"] == "<=" else row["value"] >= row["target"])
    assert "same reply: True" in rows["full_turn"]["detail"]  # the baseline decoded exactly the turn's tokens
    assert "failed" not in rows["rag_cacheblend"]["detail"] and "failed" not in rows["five_policies"]["detail"]
    assert "failed" not in rows["first_turn_160"]["detail"] and "failed" not in rows["follow_up_160"]["detail"]
    assert "failed" not in rows["arena_workers"]["detail"] and "2 cells" in rows["arena_workers"]["detail"]
    for key in ("first_turn_160", "follow_up_160"):  # the machine's own floor beside the ratio
        assert re.search(r"a plain decoding step of five rows over 64 tokens costs \d+\.\d\d× one row's here",
                         rows[key]["detail"]), rows[key]["detail"]
    assert rows["evict_share"]["value"] < 100
    assert rows["quest_metadata"]["value"] == 2 / 16  # a min and a max key per page of 16, exactly
    assert rows["quest_reads"]["value"] < 1 and rows["kivi_memory"]["value"] < 1
    printed = capsys.readouterr().out
    for row in rows.values():
        assert row["label"] in printed
    assert "targets met" in printed and "torch threads" in printed


def test_row_pass_rule_both_directions() -> None:
    assert BenchRow("a", "a", 1.10, "×", "<=", 1.10).passed
    assert not BenchRow("a", "a", 1.11, "×", "<=", 1.10).passed
    assert BenchRow("b", "b", 4.0, "×", ">=", 4.0).passed
    assert not BenchRow("b", "b", 3.99, "×", ">=", 4.0).passed
    assert not BenchRow("c", "c", float("nan"), "MB", "<=", 100.0).passed


def test_the_table_shows_each_rows_spread_or_that_it_is_one_run() -> None:
    rows = [BenchRow("a", "a", 2.0, "×", "<=", 2.5, samples=[1.8, 2.0, 2.6]),
            BenchRow("b", "b", 3.0, "%", "<=", 4.0, samples=[3.0])]
    assert bench_table(rows)["spread"].tolist() == ["1.80×–2.60×", "one run"]


def test_tensor_memory_counts_new_storages_not_views() -> None:
    outside = torch.ones(1000)
    with TensorMemory() as mem:
        a = torch.zeros(1000)  # 4000 bytes
        view = a[:10]  # shares a's storage
        b = outside * 2  # 4000 bytes more
        del b
        c = outside[:500].clone()  # 2000 bytes; the peak stays at 8000
    assert mem.peak == 8000
    assert mem.live == 6000
    del a, view, c
    assert mem.live == 0


@pytest.mark.model
def test_bench_inputs_have_the_requested_size(model: LoadedModel) -> None:
    assert len(prose_ids(model, 777)) == 777
    text = code_text(model, 300)
    n = len(model.encode(text))
    assert 250 < n <= 300 and text.endswith("\n")


def test_a_plain_step_runs_the_rows_and_steps_it_times(tiny: LoadedModel) -> None:
    batches: list[tuple[int, int]] = []
    hook = tiny.model.register_forward_pre_hook(lambda _m, _a, kw: batches.append(tuple(kw["input_ids"].shape)),
                                                with_kwargs=True)
    try:
        seconds = plain_step_seconds(tiny, list(range(100, 120)), 3, 4)
    finally:
        hook.remove()
    assert batches == [(3, 20)] + [(3, 1)] * 4 and seconds > 0  # the prefill, then four one-token steps of 3 rows
    batches.clear()
    ratio = plain_rows_ratio(tiny, list(range(100, 110)), 2, runs=2, steps=1)
    assert math.isfinite(ratio) and ratio > 0 and not batches  # the hook is gone


def test_the_stream_rows_pair_streamingllm_with_recompute_and_four_policies_with_one(tiny: LoadedModel) -> None:
    cfg = dataclasses.replace(QUICK, stream_cache=24, stream_tokens=90, stream_runs=2)
    seen: list[float] = []
    rows = {r.key: r for r in bench_stream(tiny, cfg, lambda frac, _: seen.append(frac))}
    assert list(rows) == ["stream_recompute", "stream_side_by_side"]
    for r in rows.values():
        assert len(r.samples) == 2 and all(math.isfinite(s) and s > 0 for s in r.samples)
        assert "90 tokens of the default text, cache 24" in r.detail
    assert seen == sorted(seen) and 0 < seen[-1] <= 1


def test_a_row_that_cannot_run_says_why_and_shows_no_number(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvlab.experiments.bench import bench_workers

    monkeypatch.delitem(sys.modules, "kvlab.experiments.workers", raising=False)  # imported afresh, as on an
    monkeypatch.setitem(sys.modules, "ray", None)  # image without Ray
    [r] = bench_workers(None, QUICK)  # type: ignore[arg-type]  # it stops before touching the model
    assert r.key == "arena_workers" and not r.samples and not r.passed
    assert r.detail.startswith("not measured: Ray cannot be imported")
    table = bench_table([r])
    assert table["value"].tolist() == ["not measured"] and table["spread"].tolist() == ["no runs"]
    assert json.loads(to_json(r.as_dict()))["value"] is None


def test_the_command_fails_when_a_row_was_not_measured(tiny: LoadedModel, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    rows = [BenchRow("a", "a", 1.0, "×", "<=", 2.0, samples=[1.0]),
            BenchRow("b", "b", float("nan"), "×", ">=", 1.7, "not measured: Ray cannot be imported")]
    monkeypatch.setattr("kvlab.cli.bench.load_model", lambda *a, **k: tiny)
    monkeypatch.setattr("kvlab.cli.bench.run_bench", lambda *a, **k: iter([rows] + [[]] * (len(BENCHES) - 1)))
    assert main(["bench", "--quick", "--out", str(tmp_path / "b.json")]) == 1
    assert "not measured (see the table's 'how'): b" in capsys.readouterr().err
    rows.pop()
    assert main(["bench", "--quick", "--out", str(tmp_path / "b.json")]) == 0
    assert json.loads((tmp_path / "b.json").read_text())["interrupted"] is False


def test_ctrl_c_keeps_the_benchmarks_that_finished(tiny: LoadedModel, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture) -> None:
    def stopped_in_the_second(*args, **kwargs):
        yield [BenchRow("a", "a", 1.0, "×", "<=", 2.0, samples=[1.0])]
        raise KeyboardInterrupt

    monkeypatch.setattr("kvlab.cli.bench.load_model", lambda *a, **k: tiny)
    monkeypatch.setattr("kvlab.cli.bench.run_bench", stopped_in_the_second)
    out = tmp_path / "b.json"
    assert main(["bench", "--quick", "--out", str(out)]) == INTERRUPTED
    record = json.loads(out.read_text())
    assert record["interrupted"] is True and [r["key"] for r in record["rows"]] == ["a"]
    captured = capsys.readouterr()
    assert f"bench stopped in benchmark 2 of {len(BENCHES)} (turns); {out} holds the rows of the 1 that finished" \
        in captured.err and "1/1 targets met" in captured.out

    def stopped_in_the_first(*args, **kwargs):
        raise KeyboardInterrupt
        yield

    out.unlink()
    monkeypatch.setattr("kvlab.cli.bench.run_bench", stopped_in_the_first)
    assert main(["bench", "--quick", "--out", str(out)]) == INTERRUPTED and not out.exists()
    assert f"bench stopped in benchmark 1 of {len(BENCHES)} (chat) and wrote no result" in capsys.readouterr().err


def test_the_bench_names_the_cpu_model() -> None:
    name = processor()
    cpuinfo = Path("/proc/cpuinfo")
    models = [line for line in cpuinfo.read_text().splitlines() if line.startswith("model name")] \
        if cpuinfo.exists() else []
    assert name and (not models or models[0].endswith(name))  # "Intel(R) Xeon(R) …", not the architecture alone
