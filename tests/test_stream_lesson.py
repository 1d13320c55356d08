"""The stream lesson: its verdict on hand-made perplexities (each outcome), and a real run on the embedded model."""

from __future__ import annotations

import math

import pytest

from kvlab.lessons import LESSONS
from kvlab.lessons.streams import CACHE, CHUNK, MIN_CHUNKS, TOKENS, first_evicted, window_ratio
from kvlab.workloads.stream.settings import RECOMPUTE

START = first_evicted(CACHE, CHUNK)
CHUNKS = math.ceil((TOKENS - 1 - START) / CHUNK)  # chunks read after the first eviction


def hand(window: float, sinks: float, jitter: float = 0.01, tokens: int = TOKENS, context: int = 8192,
         dense_past: float = 0.0) -> dict:
    """A stream record where, from the first eviction on, the window and the sinks add ``window`` / ``sinks``
    nats to every token's NLL; ``jitter`` nats alternate in sign from chunk to chunk on the window's; dense
    attention adds ``dense_past`` nats past the trained ``context``."""
    base = [2.0 + 0.3 * math.sin(i) for i in range(tokens - 1)]

    def shifted(extra: float, wobble: float = 0.0) -> list[float]:
        return [b + (extra + (wobble if (i // CHUNK) % 2 else -wobble) if i >= START else 0.0)
                for i, b in enumerate(base)]

    dense = [b + (dense_past if i >= context else 0.0) for i, b in enumerate(base)]
    nll = {"full": dense, "window": shifted(window, jitter), "streamingllm": shifted(sinks),
           RECOMPUTE: shifted(0.01)}
    labels = {"full": "dense (Full)", "window": "Window", "streamingllm": "StreamingLLM",
              RECOMPUTE: "sliding window + recompute"}
    bounded = CACHE + CHUNK - 1
    runners = {n: {"label": labels[n], "nll": v, "max_position": tokens - 2 if n == "full" else bounded,
                   "past_from": context if n == "full" and tokens - 1 > context else None, "time_s": 1.0,
                   "error": None} for n, v in nll.items()}
    return {"model": "hand", "text": "t", "context_length": context, "tokens": tokens, "cache": CACHE, "chunk": CHUNK,
            "sinks": 4, "position_mode": "rerotated", "time_s": 4.0, "runners": runners}


def verdict(result: dict):
    lesson = LESSONS["streams"]
    figures = lesson.figures(result)
    assert len(figures) == 2 and all(f.reading for f in figures)
    assert len(lesson.table(result)) == 4
    return lesson.verdict(result)


def test_sinks_that_hold_inside_the_trained_context_support_half_of_the_claim() -> None:
    got = verdict(hand(window=0.5, sinks=0.03))
    assert got.outcome == "mixed" and "supports the claim" not in got.text
    assert "the run stays inside the trained context, so its other half" in got.text and "is not tested" in got.text
    assert f"n = {TOKENS - 1 - START} tokens" in got.text and "stays inside the trained context" in got.text
    assert "StreamingLLM (4 sinks) is +2.0% from sliding window + recompute" in got.text
    assert "`kvlab stream --tokens 12000 --budget 1024`" in got.text


def test_a_window_as_good_as_the_sinks_contradicts_it() -> None:
    got = verdict(hand(window=0.03, sinks=0.03))
    assert got.outcome == "contradicts" and "contradicts the claim" in got.text
    ratio, low, high, chunks = window_ratio(hand(window=0.03, sinks=0.03))
    assert ratio == pytest.approx(1.0, abs=0.01) and 0.9 < low < 1 < high < 1.1 and chunks == CHUNKS


def test_sinks_that_help_but_stay_far_from_the_reference_are_mixed() -> None:
    got = verdict(hand(window=0.6, sinks=0.3))
    assert got.outcome == "mixed" and "more than 10% above" in got.text


def test_numbers_that_cannot_tell_the_window_from_the_sinks_are_inconclusive() -> None:
    noisy = verdict(hand(window=0.08, sinks=0.03, jitter=0.4))  # ratio ≈ 1.1 with an interval far wider than ±10 %
    assert noisy.outcome == "inconclusive" and "cannot tell" in noisy.text
    assert f"Inconclusive (n = {CHUNKS} chunks" in noisy.text
    short = verdict(hand(window=0.5, sinks=0.03, tokens=START + 2 * CHUNK))
    assert short.outcome == "inconclusive" and f"needs at least {MIN_CHUNKS}" in short.text


def test_a_stream_past_the_trained_context_supports_the_claim_where_dense_attention_degrades() -> None:
    got = verdict(hand(window=0.5, sinks=0.03, context=400, dense_past=1.0))
    assert f"Past the trained context (tokens 401–{TOKENS - 1}) dense attention's perplexity is" in got.text
    assert got.outcome == "supports" and "supports the claim" in got.text and "stays inside" not in got.text
    steady = verdict(hand(window=0.5, sinks=0.03, context=400))  # dense as good past the context as before it
    assert steady.outcome == "mixed" and "it does not degrade there" in steady.text


def test_a_failed_runner_leaves_no_verdict_but_says_why() -> None:
    result = hand(window=0.5, sinks=0.03)
    result["runners"]["window"] |= {"error": "RuntimeError: out of memory", "nll": []}
    got = LESSONS["streams"].verdict(result)
    assert got.outcome == "inconclusive" and "out of memory" in got.text
    assert len(LESSONS["streams"].figures(result)) == 2
