"""Lessons: verdicts on hand-built results (supporting and contradicting), the page, and real runs (slow)."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest
from page_helpers import open_page

import ui.common
from kvlab.engine.conversion import EMBEDDED, EMBEDDED_MODELS, GEMMA
from kvlab.engine.facts import LoadedModel
from kvlab.export import to_json
from kvlab.lessons import LESSONS, Verdict
from kvlab.lessons.agnostic import agnostic_figures, agnostic_table
from kvlab.lessons.base import MIN_CASES
from kvlab.lessons.chat import keys_for_mass
from kvlab.lessons.planted import FACT, find_span, kept_share, policy_case, policy_table, retention_figures
from kvlab.lessons.rag import MIN_QUESTIONS
from kvlab.lessons.record import lesson_record
from kvlab.saved import stamp, stamp_of
from kvlab.stats import wilson
from kvlab.workloads.chat.records import PolicyTurn
from kvlab.workloads.rag.strategies import LABELS


def verdict(key: str, result: dict) -> Verdict:
    """The lesson's verdict, after checking that its figures and readings build from the same result."""
    figures = LESSONS[key].figures(result)
    assert figures and all(f.reading for f in figures)
    if LESSONS[key].table is not None:
        assert len(LESSONS[key].table(result))
    return LESSONS[key].verdict(result)


# --- hand-built results ---------------------------------------------------------------------------------

def sinks(first_share: list[float]) -> dict:
    n = len(first_share)
    return {"model": "hand", "tokens": 200, "sink_tokens": 4, "queries": 64, "first_tokens": ["<s>", "a", "b", "c"],
            "sink_mass": [[s, s] for s in first_share], "first_share": first_share,
            "other": [{"position": 10 + i, "token": " the", "share": 0.1} for i in range(n)]}


def planted(correct: dict[str, bool], cases: int = 6) -> dict:
    """One case drawn in full, repeated ``cases`` times as the lesson's cases (the verdict reads the cases)."""
    fact = [20, 21, 22, 23]
    retained = {name: [[list(range(0, 40)) if ok else [0, 1, 2, 3, 30, 31]] for _ in range(2)]
                for name, ok in correct.items()}
    reply = {name: "Your locker code is " + (FACT if ok else "1234") for name, ok in correct.items()}
    case = {"fact": FACT, "budget": 48, "question": "?",
            "policies": {name: {"correct": ok, "reply": reply[name], "error": None, "kept_share": 1.0 if ok else 0.0}
                         for name, ok in correct.items()}}
    return {"model": "hand", "budget": 48, "fact": FACT, "fact_positions": fact, "question": "?",
            "prefill": "Your locker code is", "question_start": 40, "cases": [case] * cases,
            "total_tokens": 60, "segments": [{"start": 0, "end": 25, "turn": 0, "role": "user"},
                                             {"start": 25, "end": 40, "turn": 0, "role": "assistant"}],
            "token_texts": [f"t{i}" for i in range(40)],
            "policies": {name: {"correct": ok, "reply": reply[name],
                                "error": None,
                                "kept_share": kept_share(retained[name], fact), "retained": retained[name],
                                "kl": [0.0, 0.1 if ok else 0.9]}
                         for name, ok in correct.items()}}


def pyramid(spread: list[int], pyramid_kl: float) -> dict:
    result = planted({"full": True, "snapkv": True, "pyramidkv": True})
    result["policies"]["pyramidkv"]["kl"] = [0.0, pyramid_kl]
    result["policies"]["snapkv"]["kl"] = [0.0, 0.5]
    result["layer_budgets"] = {"snapkv": [64] * len(spread), "pyramidkv": list(range(90, 90 - 10 * len(spread), -10))}
    result["spread"] = spread
    return result


def rag_rows(kl: dict[str, float], right: dict[str, bool], extra: dict | None = None) -> list[dict]:
    return [{"question": "q01", "key": key, "strategy": LABELS[key], "KL": value, "correct": right[key],
             "top-1": 1.0 - value, "answer": "48213", "speed-up": 2.0, "TTFT ms": 100.0, "TTFT min ms": 95.0,
             "TTFT max ms": 105.0, "timed runs": 3, "compute share": 0.2,
             "doc tokens recomputed": 31, "question tokens": 29, "tokens reused": 300, "mean K dev": 1e-7,
             "mean V dev": 1e-7, "error": None,
             **(extra or {})}
            for key, value in kl.items()]


def rope(rot0: float, rot_deep: float) -> dict:
    dev = [{"strategy": LABELS[s], "layer": layer, "K": k, "V": k}
           for s, k0, deep in (("full", 0.0, 0.0), ("naive", 0.4, 0.5), ("recompose", rot0, rot_deep))
           for layer, k in enumerate([k0, deep, deep])]
    return {"model": "hand", "k": 3, "deviation": dev,
            "rows": rag_rows({"full": 0.0, "naive": 2.0, "recompose": 0.3},
                             {"full": True, "naive": False, "recompose": True})}


def cacheblend(kl_at_15: float, speedup: float = 3.0, questions: int = 8, spread: float = 0.05,
               rounds: bool = False) -> dict:
    """``questions`` questions: re-rotated reuse at KL 0.4 (0.35–0.45), CacheBlend at ``kl_at_15`` (and half that at
    30 %), full prefill's TTFT ``speedup`` times CacheBlend's, each timing's runs ``spread`` either side of its
    median; ``rounds``: timed in rounds, each row with its lowest and highest round's speed-up (a file saved before
    has neither)."""
    rows = []
    for q in range(questions):
        wobble = 0.05 * (q % 3 - 1)  # the questions differ a little, as real ones do
        ids = {"question": f"q{q:02d}"}
        full = {"TTFT ms": 100.0 * speedup, "TTFT min ms": 100.0 * speedup * (1 - spread),
                "TTFT max ms": 100.0 * speedup * (1 + spread)}
        blend = {"TTFT ms": 100.0, "TTFT min ms": 100.0 * (1 - spread), "TTFT max ms": 100.0 * (1 + spread),
                 "speed-up": speedup}
        if rounds:  # a round's ratio moves less than the runs' extremes paired: half the spread either side
            blend |= {"speed-up low": speedup * (1 - spread / 2), "speed-up high": speedup * (1 + spread / 2)}
        rows += [{**r, **ids, **full, "share": 0.0} for r in rag_rows({"full": 0.0}, {"full": True})]
        rows += [{**r, **ids, "share": 0.0} for r in rag_rows({"recompose": 0.4 + wobble}, {"recompose": False})]
        for share, kl in ((0.15, kl_at_15 * (1 + wobble)), (0.3, kl_at_15 / 2)):
            rows += [{**r, **ids, **blend, "share": share} for r in rag_rows({"cacheblend": kl}, {"cacheblend": True})]
    return {"model": "hand", "k": 3, "shares": [0.15, 0.3], "rows": rows}


def ordering(id_better: bool) -> dict:
    sim = [{"order": order, "k": k, "queries": 10, "token hit rate": rate, "query hit rate": rate}
           for k in range(1, 4) for order, rate in (("rank", 0.3), ("id", 0.5 if id_better else 0.2))]
    return {"model": "hand", "k": 3, "questions": 10, "simulation": sim,
            "rows": rag_rows({"full": 0.0, "fixed": 1e-6}, {"full": True, "fixed": True})}


def edits(diff: float) -> list[dict]:
    return [{"label": label, "reused": reused, "new_tokens": 1000, "suffix": 1000 - reused, "reuse_pct": reused / 10,
             "max_logit_diff": diff, "full_ms": 900.0, "reprefill_ms": 900.0 - reused / 2}
            for label, reused in (("early", 100), ("middle", 500), ("late", 900))]


def sharing(cla_share: float) -> dict:
    def row(scheme: str, compute: float, claim: float) -> dict:
        flops = {f"{c}_flops": compute / 6 for c in ("q_proj", "k_proj", "v_proj", "o_proj", "attention", "mlp")}
        return {"scheme": scheme, **flops, "total_flops": compute, "kv_layers": 2, "claim_share": claim,
                "compute_share": compute, "kv_bytes_share": claim}

    return {"model": "hand", "layers": 4, "file": "f.py", "edits": edits(0.0),
            "costs": [row("Full", 1.0, 1.0), row("CLA-2", cla_share, 0.5)],
            "measured": [{"scheme": "CLA-2", "kl_mean": 13.3512, "top1": 0.4}]}


def agnostic(recalled: dict[str, int], cases: int = 6) -> dict:
    """A lesson-10 record: each policy recalls the first ``recalled[name]`` of ``cases`` questions (one budget)."""
    names = list(recalled)
    run = {"budget_mib": 3.0, "budget_bytes": 3 << 20, "tokens": 68, "duo_ratio": 0.9, "total_tokens": 400,
           "held": {n: [1 << 20, 2 << 20, 3 << 20] for n in names}, "extra_prefill_s": dict.fromkeys(names, 0.0)}
    return {"model": "hand", "policies": names, "estimate_tokens": 400, "kv_heads": 90, "duo_pattern": None,
            "duo": {"sink": 4, "recent": 28, "pattern": "on_the_fly"}, "runs": [run],
            "cases": [{"fact": FACT, "question": "?", "budget_mib": 3.0, "turn": 5 + i, "fact_positions": [20, 21],
                       "question_start": 300,
                       "policies": {n: {"correct": i < k, "reply": "", "error": None, "kept_share": 0.5,
                                        "kv_bytes": (13 if n == "full" else 3) << 20} for n, k in recalled.items()}}
                      for i in range(cases)]}


def windows(imposed_recalls: bool) -> dict:
    result = planted({"full": True, "window": imposed_recalls, "streamingllm": imposed_recalls})
    for p in result["policies"].values():
        p["global_kept"] = p["kept_share"]
    return {**result, "window": 16, "sliding_layers": [0], "global_layers": [1]}


# --- verdicts ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("key", "supporting", "contradicting"), [
    ("sinks", sinks([0.01, 0.02, 0.5, 0.6, 0.4, 0.3]), sinks([0.01] * 6)),
    ("planted_fact", planted({"full": True, "streamingllm": True, "h2o": False, "snapkv": False}),
     planted({"full": True, "streamingllm": False, "h2o": True, "snapkv": False})),
    ("pyramid", pyramid([40, 30, 20, 10], 0.1), pyramid([10, 20, 30, 40], 0.9)),
    ("rope", rope(1e-7, 0.2), rope(0.3, 0.2)),
    ("cacheblend", cacheblend(0.1), cacheblend(0.39, speedup=1.5)),
    ("ordering", ordering(True), ordering(False)),
    ("prefix_reuse", {"model": "hand", "file": "f.py", "edits": edits(1e-5)},
     {"model": "hand", "file": "f.py", "edits": edits(0.5)}),
    ("sharing", sharing(0.55), sharing(0.93)),
    ("windows", windows(True), windows(False)),
    ("agnostic", agnostic({"full": 6, "snapkv": 0, "kvzip": 6, "duoattention": 3, "oracle": 6}),
     agnostic({"full": 6, "snapkv": 0, "kvzip": 0, "duoattention": 0, "oracle": 6})),
])
def test_each_verdict_says_whether_the_run_supports_or_contradicts_its_claim(key: str, supporting: dict,
                                                                              contradicting: dict) -> None:
    yes, no = verdict(key, supporting), verdict(key, contradicting)
    assert yes.outcome == "supports" and "supports the claim" in yes.text
    assert no.outcome == "contradicts" and "contradict" in no.text


def test_the_planted_fact_verdict_names_the_position_and_who_recalled_it() -> None:
    text = verdict("planted_fact", planted({"full": True, "streamingllm": False, "h2o": True, "snapkv": False})).text
    assert "positions 20–23" in text and f"Full answered {FACT}" in text
    assert "StreamingLLM held 0% of its keys" in text
    assert f"H2O held 100% of its keys and answered {FACT}" in text and "answered '1234'" in text


def test_a_partial_sink_pattern_and_a_failed_reference_are_said_as_such() -> None:
    partial = verdict("sinks", sinks([0.01, 0.01, 0.01, 0.5, 0.6, 0.4]))
    assert partial.outcome == "mixed" and "contradict" not in partial.text  # one statement, not two opposite ones
    assert "holds in 3 of the 4 layers it names (75%)" in partial.text and "only in layers 3–5" in partial.text
    failed = verdict("planted_fact", planted({"full": False, "streamingllm": True}))
    assert failed.outcome == "inconclusive" and "Inconclusive (n = 0 cases Full recalled" in failed.text


def test_a_rate_from_too_few_cases_is_inconclusive_and_says_its_n() -> None:
    few = verdict("planted_fact", planted({"full": True, "streamingllm": True, "h2o": False, "snapkv": False},
                                          cases=MIN_CASES - 1))
    assert few.outcome == "inconclusive" and f"Inconclusive (n = {MIN_CASES - 1} cases" in few.text
    assert "would decide it" in few.text
    enough = verdict("planted_fact", planted({"full": True, "streamingllm": True, "h2o": False, "snapkv": False},
                                             cases=MIN_CASES))
    assert enough.outcome == "supports" and f"{MIN_CASES}/{MIN_CASES}" in enough.text
    two = verdict("cacheblend", cacheblend(0.1, questions=MIN_QUESTIONS - 1))
    assert two.outcome == "inconclusive" and f"Inconclusive (n = {MIN_QUESTIONS - 1} questions" in two.text


def test_the_agnostic_verdict_judges_intervals_against_snapkv_and_says_n_below_the_threshold() -> None:
    few = verdict("agnostic", agnostic({"full": 6, "snapkv": 0, "kvzip": 6, "duoattention": 6, "oracle": 6},
                                       cases=MIN_CASES - 1))
    assert few.outcome == "inconclusive" and f"Inconclusive (n = {MIN_CASES - 1} questions Full recalled" in few.text
    assert "would decide it" in few.text
    # KVzip 4/6 [30–90 %] overlaps SnapKV's 2/6 [10–70 %], and is not below half: no separation
    overlap = verdict("agnostic", agnostic({"full": 6, "snapkv": 2, "kvzip": 4, "duoattention": 3, "oracle": 6}))
    assert overlap.outcome == "inconclusive" and "n = 6 now" in overlap.text  # nothing separated: no verdict
    assert "SnapKV 2/6 (33 % [10–70 %])" in overlap.text and "KVzip 4/6 (67 % [30–90 %])" in overlap.text
    # only the questions Full recalled count: Full's misses leave too few
    missed = verdict("agnostic", agnostic({"full": 3, "snapkv": 0, "kvzip": 3, "duoattention": 3, "oracle": 3}))
    assert missed.outcome == "inconclusive" and "n = 3 questions" in missed.text
    supports = verdict("agnostic", agnostic({"full": 6, "snapkv": 0, "kvzip": 6, "duoattention": 3, "oracle": 6}))
    assert "3.00 MiB at 3 MiB (90% streaming heads)" in supports.text and "KVzip's interval" in supports.text


def test_the_sharing_verdict_rounds_its_kl_as_the_table_shows_it() -> None:
    assert "drifts by KL 13.4 (" in verdict("sharing", sharing(0.55)).text  # the table's three significant digits


def test_the_agnostic_recall_reading_names_every_policy_tied_for_most() -> None:
    result = agnostic({"full": 6, "snapkv": 0, "kvzip": 6, "duoattention": 3, "oracle": 6})
    reading = LESSONS["agnostic"].figures(result)[0].reading
    assert reading == ("KVzip 6 of 6 (61–100 %), Oracle (not deployable) 6 of 6 (61–100 %) recalled most (95 % "
                       "Wilson intervals)."), reading
    none = agnostic({"full": 6, "snapkv": 0, "kvzip": 0, "duoattention": 0, "oracle": 0})
    assert LESSONS["agnostic"].figures(none)[0].reading == "No policy but Full recalled a fact."


def test_the_fewest_cases_are_the_fewest_whose_extremes_wilson_can_tell_apart() -> None:
    assert wilson(MIN_CASES - 1, MIN_CASES - 1).low <= wilson(0, MIN_CASES - 1).high
    assert wilson(MIN_CASES, MIN_CASES).low > wilson(0, MIN_CASES).high


def test_overlapping_recall_intervals_do_not_separate_the_families() -> None:
    result = planted({"full": True, "streamingllm": True, "h2o": True, "snapkv": False})
    result["cases"] = [{**c, "policies": {**c["policies"], "streamingllm": {**c["policies"]["streamingllm"],
                                                                          "correct": i % 2 == 0}}}
                       for i, c in enumerate(result["cases"])]  # StreamingLLM 3/6 against H2O 6/6 and SnapKV 0/6
    got = verdict("planted_fact", result)  # no policy's interval apart from sink + window's: no verdict
    assert got.outcome == "inconclusive" and "intervals overlap" in got.text and "StreamingLLM 3/6" in got.text
    # one scoring policy clearly below sink + window, another overlapping it: a mixed result
    result = planted({"full": True, "streamingllm": True, "h2o": False, "snapkv": False})
    result["cases"] = [{**c, "policies": {**c["policies"], "h2o": {**c["policies"]["h2o"], "correct": i % 2 == 0}}}
                       for i, c in enumerate(result["cases"])]  # StreamingLLM 6/6, H2O 3/6, SnapKV 0/6
    got = verdict("planted_fact", result)
    assert got.outcome == "mixed" and "SnapKV clearly below it" in got.text, got.text


def test_the_cacheblend_verdict_fails_when_its_ttft_part_fails() -> None:
    slow = verdict("cacheblend", cacheblend(0.1, speedup=1.5))  # quality recovered, TTFT only 1.5×
    assert slow.outcome == "mixed" and "the run partly supports the claim, and not the claim as a whole" in slow.text
    assert "contradicts" not in slow.text  # the page heads a mixed verdict "partly supports"
    assert "less than the claimed 2.2×" in slow.text and "1.50×" in slow.text
    assert "median of 3 timed runs" in slow.text
    assert verdict("cacheblend", cacheblend(0.39, speedup=1.5)).outcome == "contradicts"
    fast_but_poor = verdict("cacheblend", cacheblend(0.39, speedup=3.0))
    assert fast_but_poor.outcome == "mixed" and "less than 50% of the gap" in fast_but_poor.text
    # a speed-up whose timed runs spread across 2.2× decides nothing about that part
    noisy = verdict("cacheblend", cacheblend(0.1, speedup=2.3, spread=0.2))
    assert noisy.outcome == "inconclusive" and "straddles" in noisy.text


def test_the_cacheblend_verdict_reads_speed_ups_timed_in_rounds_from_each_questions_rounds() -> None:
    timed = verdict("cacheblend", cacheblend(0.1, speedup=2.3, spread=0.2, rounds=True))
    assert "the median of 3 timed rounds each, a round timing full prefill and the strategies run beside it back" \
           " to back" in timed.text
    assert "2.07–2.53× between each question's lowest and highest round" in timed.text
    assert timed.outcome == "inconclusive" and "straddles" in timed.text  # 2.2× lies inside 2.07–2.53×
    fast = verdict("cacheblend", cacheblend(0.1, speedup=2.6, spread=0.2, rounds=True))
    assert fast.outcome == "supports"  # 2.34–2.86×: above 2.2× (the runs' extremes paired, 1.73–3.90×, straddle it)


def test_the_rag_lessons_readings_name_only_what_their_chart_or_table_shows() -> None:
    reading = LESSONS["cacheblend"].figures(cacheblend(0.1, speedup=2.5))[0].reading
    assert "full prefill: 0% 2.00×, 15% 2.50×, 30% 2.50× (" in reading  # the speed-ups the chart does not draw
    result = ordering(True)
    assert "the table's prefix-cache tokens" in verdict("ordering", result).text
    assert list(LESSONS["ordering"].table(result)["prefix-cache tokens"]) == [300, 300]


def test_helpers() -> None:
    assert keys_for_mass([0.5, 0.3, 0.1, 0.1]) == 3
    assert kept_share([[[1, 2]], [[2, 3]]], [2, 3]) == 0.75
    assert kept_share([], [2, 3]) is None  # a policy that failed held nothing to count: no "0 %"


def test_a_policy_that_failed_is_failed_in_a_lessons_table_figures_and_grid_not_wrong_and_empty() -> None:
    held = PolicyTurn("h2o", retained=[[[0, 1, 20, 21]]])
    case = policy_case(PolicyTurn("h2o", reply="", error="RuntimeError: boom"), PolicyTurn("h2o"), [20, 21])
    assert case == {"correct": None, "reply": "", "error": "RuntimeError: boom", "kept_share": None}
    assert policy_case(PolicyTurn("h2o", reply="4127", correct=True), held, [20, 21])["kept_share"] == 1.0
    result = planted({"full": True, "snapkv": False})
    result["policies"]["h2o"] = case | {"retained": [], "kl": [None, None]}
    table = policy_table(result).set_index("policy")
    assert table.loc["H2O", f"recalled {FACT}"] is None and pd.isna(table.loc["H2O", "fact's keys held"])
    assert table.loc["SnapKV", f"recalled {FACT}"] is False and table.loc["SnapKV", "fact's keys held"] == "0 %"
    first = retention_figures(result)[0]
    assert "H2O failed." in first.reading and "SnapKV missed (holding 0% of the code's keys)" in first.reading
    assert list(first.figure.data[0].text) == ["recalled", "missed", "failed"]

    lesson = agnostic({"full": 6, "snapkv": 3, "duoattention": 0})
    for c in lesson["cases"]:
        c["policies"]["duoattention"] = case | {"kv_bytes": None}
    rows = agnostic_table(lesson).set_index("policy")
    assert pd.isna(rows.loc["DuoAttention", "fact's keys held (mean)"])  # not "0 %"
    assert rows.loc["DuoAttention", "recalled over 6 questions Full recalled"].startswith("0/0")
    figures = agnostic_figures(lesson)
    assert "DuoAttention (90% streaming heads) is bounded by nothing but its split and failed: nothing was " \
        "measured" in figures[2].reading
    assert set(figures[1].figure.data[0].text[2]) == {"failed"}
    assert "DuoAttention 0/0" in verdict("agnostic", lesson).text
    failed_full = windows(True)  # the window lesson's reference failing: said, not a crash on its missing share
    failed_full["policies"]["full"] |= case | {"global_kept": None}
    said = verdict("windows", failed_full)
    assert said.outcome == "inconclusive" and "RuntimeError: boom" in said.text


@pytest.mark.model
def test_find_span_locates_the_fact_tokens(model: LoadedModel) -> None:
    ids = model.encode("My locker code is 4127. Please remember it.")
    span = find_span(model, ids, FACT)
    assert model.decode(ids[span[0]: span[-1] + 1]).strip() == FACT


# --- the page ---------------------------------------------------------------------------------------------

@pytest.fixture
def tiny_page_model(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny model stands in for both embedded models (so the switch to Gemma loads nothing)."""
    for name in (EMBEDDED, GEMMA):
        monkeypatch.setitem(ui.common._MODELS, (name, "auto", "auto", False), tiny)


@pytest.mark.usefixtures("tiny_page_model")
def test_the_window_lesson_on_a_model_without_windows_says_so_and_offers_the_switch() -> None:
    at = open_page("app_pages/lessons.py", timeout=300)
    at.radio(key="lesson").set_value("windows").run()
    assert not at.exception
    assert any("no sliding-window layers" in i.value for i in at.info)
    at.button(key="lesson_switch").click().run()
    assert not at.exception
    assert at.radio(key="model_source").value == EMBEDDED_MODELS[GEMMA].label


@pytest.mark.usefixtures("tiny_page_model")
def test_the_lessons_page_runs_the_sink_lesson_from_its_button_and_shows_a_verdict() -> None:
    at = open_page("app_pages/lessons.py", timeout=300)
    assert not at.exception
    assert at.radio(key="lesson").value == "sinks"
    at.button(key="lesson_run").click().run()
    assert not at.exception
    assert not at.error  # a verdict is a finding, never shown as a failure
    shown = [e.value for box in (at.success, at.warning, at.info) for e in box]
    assert any("The run" in v and "first 4 tokens" in v for v in shown), shown
    assert len(at.get("plotly_chart")) == 2


@pytest.mark.usefixtures("tiny_page_model")
def test_a_saved_lesson_run_opens_at_once_labelled_even_where_the_model_could_not_run_it() -> None:
    at = open_page("app_pages/lessons.py", timeout=300)
    result = windows(True)  # a Gemma lesson: the tiny model has no windows, yet the file opens
    old = {"lesson": "windows", "claim": "", "preset": "", "verdict": {}, "result": result}  # saved before stamps
    at.file_uploader(key="lesson_open").set_value(("lesson-windows.json", to_json(old).encode(), "application/json"))
    at.run()
    assert not at.exception and at.radio(key="lesson").value == "windows"
    assert any("Opened from a file, no run" in i.value and "model unknown" in i.value for i in at.info)
    assert not at.error  # a verdict is a finding, never shown as a failure
    shown = [e.value for box in (at.success, at.warning, at.info) for e in box]
    assert LESSONS["windows"].verdict(result).text in " ".join(shown)
    assert len(at.get("plotly_chart")) == len(LESSONS["windows"].figures(result))
    assert at.button(key="lesson_run").disabled  # this model cannot run it; the file still reads
    made = stamp_of(stamp("SmolLM2-135M-Instruct"))
    saved = lesson_record(LESSONS["sinks"], sinks([0.01, 0.5]), LESSONS["sinks"].verdict(sinks([0.01, 0.5])), made)
    at.file_uploader(key="lesson_open").set_value(("lesson-sinks.json", to_json(saved).encode(), "application/json"))
    at.run()
    assert at.radio(key="lesson").value == "sinks"
    assert any(made.label() in i.value for i in at.info)
    at.file_uploader(key="lesson_open").set_value(("cut.json", to_json(saved)[:50].encode(), "application/json"))
    at.run()
    assert any("not valid JSON (line" in e.value for e in at.error) and not at.exception


# --- real runs on the embedded model -------------------------------------------------------------------------

@pytest.mark.parametrize(("key", "result"), [
    ("sinks", sinks([0.01] * 6)),
    ("prefix_reuse", {"model": "hand", "file": "f.py", "edits": edits(1e-5)}),
    ("prefix_reuse", {"model": "hand", "file": "f.py", "edits": edits(0.5)}),
    ("sharing", sharing(0.55)),
    ("sharing", sharing(0.93)),
])
def test_a_verdict_states_its_sample_and_what_would_change_it(key: str, result: dict) -> None:
    text = verdict(key, result).text
    assert re.search(r"n = \d+", text), text
    assert "would change" in text, text


@pytest.mark.usefixtures("tiny_page_model")
def test_a_saved_run_run_again_is_checked_against_its_file() -> None:
    at = open_page("app_pages/lessons.py", timeout=300)
    at.button(key="lesson_run").click().run(timeout=300)
    (model, _), result = next(iter(at.session_state["lesson_results"].items()))
    made = stamp_of(stamp(model))
    same = lesson_record(LESSONS["sinks"], result, LESSONS["sinks"].verdict(result), made)
    changed = json.loads(to_json(same))
    changed["result"]["first_share"][3] += 0.25
    for record, identical in ((same, True), (changed, False)):
        at.file_uploader(key="lesson_open").set_value(("run.json", to_json(record).encode(), "application/json"))
        at.run()
        at.button(key="lesson_run").click().run(timeout=300)
        assert not at.exception
        if identical:
            said = [s.value for s in at.success]
            assert any("Replay identical" in s and "every number equals the file's" in s for s in said), said
        else:
            warnings = [w.value for w in at.warning]
            assert any("differs from the file" in w and "first_share[3]" in w for w in warnings), warnings


@pytest.mark.usefixtures("tiny_page_model")
def test_a_lesson_run_cut_short_says_so_once_and_how() -> None:
    at = open_page("app_pages/lessons.py", timeout=300)
    sinks_title, other = LESSONS["sinks"].title, LESSONS["prefix_reuse"].title
    page_change = ": another click or a page change ran the page again while it ran, so it has no verdict."
    at.session_state["lesson_running"] = sinks_title  # what a page change during the run leaves behind
    at.run()
    assert not at.exception
    assert [w.value for w in at.warning] == [f"The run of “{sinks_title}” stopped before it finished{page_change} "
                                             "Press Run to run it again."]
    at.run()
    assert not at.warning  # said once
    at.session_state["lesson_running"] = sinks_title
    at.session_state["lesson_stop_asked"] = True  # what the Stop button's click sets
    at.run()
    assert [i.value for i in at.info if "stopped" in i.value] == [
        f"The run of “{sinks_title}” stopped before it finished, as asked, so it has no verdict. Press Run to run it "
        "again."]
    assert not at.warning
    at.session_state["lesson_running"] = other  # another lesson's run, cut short
    at.run()
    assert [w.value for w in at.warning] == [f"The run of “{other}” stopped before it finished{page_change} Open "
                                             f"“{other}” and press Run to run it again."]
    at.button(key="lesson_run").click().run()  # a run to its end leaves no marker behind
    assert not at.exception and "lesson_running" not in at.session_state
