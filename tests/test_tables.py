"""Wide tables transposed to fit: one column per strategy, each measure in its own format."""

from __future__ import annotations

import pandas as pd

from ui.tables import transposed


def test_a_wide_summary_becomes_one_column_per_strategy() -> None:
    df = pd.DataFrame([
        {"strategy": "Full prefill", "questions": 3, "accuracy": 1.0, "mean KL": 0.0, "TTFT ms": 812.4, "speed-up": 1.0},
        {"strategy": "CacheBlend", "questions": 3, "accuracy": float("nan"), "mean KL": 0.01234, "TTFT ms": 301.6,
         "speed-up": 2.6938},
    ])
    out = transposed(df, "strategy")
    assert list(out.columns) == ["Full prefill", "CacheBlend"]
    assert list(out.index) == ["questions", "accuracy", "mean KL", "TTFT ms", "speed-up"]
    assert out.loc["TTFT ms", "Full prefill"] == "812" and out.loc["TTFT ms", "CacheBlend"] == "302"
    assert out.loc["mean KL", "CacheBlend"] == "0.0123" and out.loc["speed-up", "CacheBlend"] == "2.69"
    assert out.loc["accuracy", "CacheBlend"] == "" and out.loc["questions", "CacheBlend"] == "3"  # no score: blank
