"""The GPU check's pieces that run without a GPU: its tolerance rule, its test counts and its summary."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import TOL, TOLERANCES, close

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def test_close_scales_the_dtypes_tolerance_by_the_references_magnitude() -> None:
    # in whatever dtype the run tests (KVLAB_TEST_DTYPE): the tolerance times the reference's largest value
    ref = torch.tensor([0.5, -8.0])
    assert close(ref + 0.9 * TOL * 8, ref) and not close(ref + 1.1 * TOL * 8, ref)
    small = torch.tensor([0.1, 0.2])
    assert close(small + 0.9 * TOL * 0.2, small) and not close(small + 1.1 * TOL * 0.2, small)  # no floor of 1
    assert TOLERANCES["float32"] < TOLERANCES["float16"] < TOLERANCES["bfloat16"]


def test_the_summary_counts_tests_and_marks_failed_steps(tmp_path: Path) -> None:
    junit = tmp_path / "a.xml"
    junit.write_text('<testsuites><testsuite tests="10" failures="2" errors="1" skipped="3"/></testsuites>')
    assert gpu_check.test_counts(junit) == {"passed": 4, "failed": 2, "errors": 1, "skipped": 3}
    assert gpu_check.test_counts(tmp_path / "none.xml")["passed"] == 0
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps({"turns": [
        {"policies": {"full": {"kl": 0.0, "correct": True}, "h2o": {"kl": 0.4, "correct": False, "error": None}}},
        {"policies": {"full": {"kl": 0.0, "correct": None}, "h2o": {"kl": None, "correct": None, "error": "boom"}}},
    ]}))
    rows = gpu_check.chat_summary(chat)
    assert rows == [{"policy": "full", "mean_kl": 0.0, "right": "1/1", "error": None},
                    {"policy": "h2o", "mean_kl": 0.4, "right": "0/1", "error": "boom"}]
    summary = {"device": "cpu", "device_name": "CPU", "dtype": "bfloat16", "tolerance": 0.04, "torch": "2",
               "cuda": None, "started": "now", "steps": [{"step": "architecture tests", "exit": 1, "seconds": 3.0}],
               "tests": gpu_check.test_counts(junit), "chat": rows,
               "bench": [{"label": "a", "value": 1.234, "unit": "×", "op": "<=", "target": 1.5, "passed": True},
                         {"label": "b", "value": None, "unit": "×", "op": ">=", "target": 1.7, "passed": False,
                          "detail": "not measured: Ray cannot be imported"}],
               "profiles": ["A follow-up after 1024 tokens on cuda"]}
    text = gpu_check.markdown(summary)
    assert "| architecture tests | 1 | 3.0 |" in text and "4 passed, 2 failed, 1 errors, 3 skipped" in text
    assert "| h2o | 0.4 | 0/1 | boom |" in text
    assert "| a | 1.23 × | <= 1.5 | yes |" in text
    assert "| b | not measured: Ray cannot be imported | >= 1.7 | NO |" in text
    assert "```text\nA follow-up after 1024 tokens on cuda\n```" in text


def test_a_step_logged_outside_the_checkout_is_reported_where_it_is(tmp_path: Path) -> None:
    step = gpu_check.run_step("echo", ["true"], {}, tmp_path / "echo.log")
    assert step["exit"] == 0 and step["log"] == str(tmp_path / "echo.log")


def test_a_step_that_writes_nothing_leaves_no_earlier_result_in_the_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Results of an earlier run in the output folder are removed first: a failed step shows no numbers."""
    earlier = {"bench.json": {"rows": [{"label": "a", "value": 1.0, "unit": "×", "op": "<=", "target": 2.0,
                                        "passed": True}]},
               "chat.json": {"turns": [{"policies": {"full": {"kl": 0.0, "correct": True}}}]},
               "profile-five.json": {"text": "an earlier run"}, "profile-quest.json": {"text": "an earlier run"}}
    for name, content in earlier.items():
        (tmp_path / name).write_text(json.dumps(content))
    (tmp_path / "notes.txt").write_text("mine")
    monkeypatch.setattr(gpu_check, "run_step", lambda name, *_: {"step": name, "exit": 1, "seconds": 0.0, "log": ""})
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--device", "cpu", "--out", str(tmp_path)])
    assert gpu_check.main() == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["bench"] == [] and summary["chat"] == [] and summary["profiles"] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "summary.json", "summary.md"]
