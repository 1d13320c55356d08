"""Streams: attention sinks keep a stream's perplexity near dense attention's after the cache starts evicting.

The run is a short stream of the bundled text (``kvlab.workloads.stream``) through dense attention, a plain
window, StreamingLLM's 4 sinks + window and the sliding window recomputed for every chunk, in re-rotated
positions. Its per-token negative log-likelihoods are the record, so the verdict, the table and the figures
are pure functions of them.
"""

from __future__ import annotations

import math
import statistics

import numpy as np
import pandas as pd

from kvlab.engine.facts import LoadedModel
from kvlab.errors import KvlabError
from kvlab.lessons.base import Figure, Lesson, Progress, Result, Verdict, inconclusive, needs_rope, pct
from kvlab.stats import bootstrap_mean
from kvlab.viz.stream import perplexity_figure, stream_bars_figure
from kvlab.workloads.stream.run import run_stream
from kvlab.workloads.stream.settings import RECOMPUTE, StreamSettings, label_of
from kvlab.workloads.stream.text import DEFAULT_TEXT_NAME, default_text, default_text_path, stream_ids

TOKENS = 512  # 6 s on SmolLM2-135M on an idle 2-core CPU (minutes on a busy one); 5 chunks after the first eviction
CACHE = 128
CHUNK = 64
SINKS = 4
RUNNERS = ("full", "window", "streamingllm", RECOMPUTE)
CLOSE = 0.10  # "near": StreamingLLM's perplexity within 10 % of the reference's (the bar, as in its Figure 3)
MIN_CHUNKS = 4  # fewer chunks after the first eviction give no interval worth the name
LONG_RUN = "`kvlab stream --tokens 12000 --budget 1024`"


def first_evicted(cache: int, chunk: int) -> int:
    """Index of the first token read on an evicted cache: caches are cut after a chunk leaves them over ``cache``."""
    return (cache // chunk + 1) * chunk


def unavailable(lm: LoadedModel) -> str | None:
    """Why the stream lesson cannot run on ``lm`` (no rotary embeddings, or the bundled text missing), or None."""
    if why := needs_rope(lm):
        return why + ": re-rotated positions, which keep a stream's positions inside the cache, need it"
    try:
        default_text_path()
    except KvlabError as exc:
        return str(exc)
    return None


def run_streams(lm: LoadedModel, progress: Progress) -> Result:
    """The first TOKENS tokens of the default text through the four runners side by side; every token's NLL."""
    progress(0.0, "reading the default text")
    ids = stream_ids(lm.encode, default_text(), TOKENS)
    settings = StreamSettings(policies=RUNNERS, budget=CACHE, chunk=CHUNK, position_mode="rerotated",
                              params={"streamingllm": {"n_sink": SINKS}})
    stream = run_stream(lm, ids, settings, progress)
    progress(1.0, "done")
    context = lm.facts.context_length
    runners = {}
    for name, trace in stream.traces.items():
        past = [i for i, p in enumerate(trace.rope_position) if p >= context]
        runners[name] = {"label": label_of(name), "nll": [round(x, 5) for x in trace.nll],
                         "max_position": max(trace.rope_position, default=None),
                         "past_from": past[0] if past else None, "time_s": trace.time_s, "error": trace.error}
    return {"model": lm.facts.name, "text": DEFAULT_TEXT_NAME, "context_length": context, "tokens": len(ids),
            "cache": CACHE, "chunk": CHUNK, "sinks": SINKS, "position_mode": "rerotated", "time_s": stream.time_s,
            "runners": runners}


def _ppl(nll: list[float]) -> float:
    return math.exp(statistics.fmean(nll))


def reference_of(result: Result) -> str:
    """What StreamingLLM is held against: the recomputed window (exact, slow) where it ran, else dense."""
    r = result["runners"].get(RECOMPUTE)
    return RECOMPUTE if r is not None and r["error"] is None and r["nll"] else "full"


def after_eviction(result: Result) -> dict[str, list[float]]:
    """Each runner that did not fail: the NLLs of the tokens read on an evicted cache."""
    start = first_evicted(result["cache"], result["chunk"])
    return {n: r["nll"][start:] for n, r in result["runners"].items() if r["error"] is None}


def window_ratio(result: Result) -> tuple[float, float, float, int]:
    """The window's perplexity over StreamingLLM's after the first eviction with its 95 % interval: the seeded
    bootstrap of the mean per-chunk difference of mean NLL (a chunk is one forward; tokens within one are not
    independent): (ratio, low, high, chunks)."""
    after, chunk = after_eviction(result), result["chunk"]
    window, sinks = after["window"], after["streamingllm"]
    diffs = bootstrap_mean(statistics.fmean(window[i:i + chunk]) - statistics.fmean(sinks[i:i + chunk])
                           for i in range(0, len(window), chunk))
    if diffs.n == 0:
        return math.nan, math.nan, math.nan, 0
    return math.exp(diffs.estimate), math.exp(diffs.low), math.exp(diffs.high), diffs.n


def stream_verdict(result: Result) -> Verdict:
    """StreamingLLM: sinks + window stay near the reference where a plain window degrades; bounded positions."""
    runners, after = result["runners"], after_eviction(result)
    if "window" not in after or "streamingllm" not in after:
        failed = [f"{runners[n]['label']}: {runners[n]['error']}" for n in ("window", "streamingllm")
                  if runners.get(n, {}).get("error")]
        return Verdict("inconclusive", "Inconclusive: the run has no perplexity for both the window and the sinks "
                                       f"({'; '.join(failed) or 'not run'}).")
    ref = reference_of(result)
    ratio, low, high, n_chunks = window_ratio(result)
    start = first_evicted(result["cache"], result["chunk"])
    read = (f"The first {result['tokens']} tokens of {result['text'].split(' (')[0]} streamed through "
            f"{result['model']} in chunks of {result['chunk']} at a cache of {result['cache']}")
    if n_chunks < MIN_CHUNKS:
        return inconclusive(n_chunks, "chunks after the first eviction", MIN_CHUNKS,
                            f"{read} leave {len(after['streamingllm'])} tokens after the first eviction (from token "
                            f"{start + 1}).", "A longer stream or a smaller cache would decide it.")
    ppl = {n: _ppl(nll) for n, nll in after.items() if nll}
    sinks_gap = ppl["streamingllm"] / ppl[ref] - 1
    context = result["context_length"]
    positions = {n: r["max_position"] for n, r in runners.items() if r["error"] is None}
    text = (f"{read}: over the {len(after['streamingllm'])} tokens read after the first eviction (from token "
            f"{start + 1}) the perplexity is "
            + ", ".join(f"{runners[n]['label']} {ppl[n]:.2f}" for n in ppl)
            + f". StreamingLLM ({result['sinks']} sinks) is {100 * sinks_gap:+.1f}% from "
              f"{runners[ref]['label']}; the plain window is {ratio:.2f}× StreamingLLM's perplexity "
              f"(95 % bootstrap interval over {n_chunks} chunks: {low:.2f}–{high:.2f}). Largest rotary "
              "position: " + ", ".join(f"{runners[n]['label']} {p:,}" for n, p in positions.items() if p is not None)
            + f", against a trained context of {context:,}.")
    dense = runners.get("full", {})
    dense_degrades = None  # past the trained context: does dense attention end clearly above the sinks?
    if dense.get("past_from") is not None:
        past = _ppl(dense["nll"][dense["past_from"]:])
        sinks_past = _ppl(runners["streamingllm"]["nll"][dense["past_from"]:])
        dense_degrades = past > (1 + CLOSE) * sinks_past
        text += (f" Past the trained context (tokens {dense['past_from'] + 1:,}–{len(dense['nll']):,}) dense "
                 f"attention's perplexity is {past:.2f}, StreamingLLM's {sinks_past:.2f}.")
    else:
        text += (f" This short stream stays inside the trained context: bounded caches keep their positions below "
                 f"cache + chunk however long a stream runs, while dense attention's grow with it; a stream past "
                 f"{context:,} tokens ({LONG_RUN}, or the Streams page) shows what that costs dense attention, and "
                 "takes much longer.")
    change = (f" Sample: n = {len(after['streamingllm'])} tokens ({n_chunks} chunks) after the first eviction, one "
              f"text. What would change it: a window within {pct(CLOSE)} of the sinks (its ratio interval inside "
              f"[{1 / (1 + CLOSE):.2f}, {1 + CLOSE:.2f}]), or StreamingLLM more than {pct(CLOSE)} above "
              f"{runners[ref]['label']}; a longer stream narrows the interval.")
    if low > 1 and sinks_gap <= CLOSE:
        held = " The window is clearly worse and the sinks keep the stream near the reference"
        if dense_degrades is None:  # the claim is about streams past the trained context: half of it is untested
            return Verdict("mixed", text + held + ", as the claim says; but the run stays inside the trained "
                                               "context, so its other half (dense attention degrades past it, the "
                                               "sinks do not) is not tested." + change)
        if not dense_degrades:
            return Verdict("mixed", text + held + f", but past the trained context dense attention stays within "
                                               f"{pct(CLOSE)} of StreamingLLM: it does not degrade there." + change)
        return Verdict("supports", text + held + ", and past the trained context dense attention degrades where "
                                                 "the sinks do not: the run supports the claim." + change)
    if low > 1:
        return Verdict("mixed", text + f" The sinks clearly help, but StreamingLLM stays more than {pct(CLOSE)} "
                                       f"above {runners[ref]['label']}." + change)
    if high < 1 or (high <= 1 + CLOSE and low >= 1 / (1 + CLOSE)):
        return Verdict("contradicts", text + " A plain window does as well as the sinks here: the run contradicts "
                                             "the claim that sinks are what keeps the stream alive." + change)
    return Verdict("inconclusive", f"Inconclusive (n = {n_chunks} chunks after the first eviction). {text} The "
                                   "window's interval straddles StreamingLLM's perplexity and reaches beyond "
                                   f"±{pct(CLOSE)}: the numbers cannot tell the two apart." + change)


def _running(result: Result) -> pd.DataFrame:
    """Each runner's perplexity over the last chunk of tokens, as ``StreamResult.running`` gives it."""
    frames = []
    for name, r in result["runners"].items():
        if r["error"] is not None or not r["nll"]:
            continue
        nll = pd.Series(r["nll"], dtype=float)
        past = np.zeros(len(nll), dtype=bool)
        if r["past_from"] is not None:
            past[r["past_from"]:] = True
        frames.append(pd.DataFrame({"policy": name, "label": r["label"], "position": np.arange(1, len(nll) + 1),
                                    "ppl": np.exp(nll.rolling(result["chunk"]).mean()), "past_context": past}))
    return pd.concat(frames, ignore_index=True).dropna(subset=["ppl"]) if frames else pd.DataFrame(
        columns=["policy", "label", "position", "ppl", "past_context"])


def stream_table(result: Result) -> pd.DataFrame:
    """One row per runner: perplexity over the stream and after the first eviction, positions, seconds."""
    after, ref = after_eviction(result), reference_of(result)
    rows = []
    against = f"vs {result['runners'][ref]['label']}"
    for name, r in result["runners"].items():
        ok = r["error"] is None and bool(r["nll"])
        scored = ok and bool(after[name]) and bool(after.get(ref))
        rows.append({"runner": r["label"], "perplexity": round(_ppl(r["nll"]), 3) if ok else None,
                     "after the first eviction": round(_ppl(after[name]), 3) if scored else None,
                     against: f"{100 * (_ppl(after[name]) / _ppl(after[ref]) - 1):+.1f}%" if scored else None,
                     "largest rotary position": r["max_position"],
                     "past the trained context": r["past_from"] is not None,
                     "seconds": round(r["time_s"], 1), "error": r["error"]})
    return pd.DataFrame(rows)


def stream_figures(result: Result) -> list[Figure]:
    """The running perplexity of every runner and each one's after the first eviction, with their readings."""
    after = {n: nll for n, nll in after_eviction(result).items() if nll}
    bars = pd.DataFrame([{"policy": n, "label": result["runners"][n]["label"], "ppl": _ppl(nll)}
                         for n, nll in after.items()], columns=["policy", "label", "ppl"]).sort_values("ppl")
    start = first_evicted(result["cache"], result["chunk"])
    if {"window", "streamingllm"} <= set(after):
        ratio, low, high, n = window_ratio(result)
        spread = f"{low:.2f}–{high:.2f}" if n > 1 else "one chunk: no interval"
        gap = f"from there the plain window runs {ratio:.2f}× StreamingLLM's perplexity ({spread})."
    else:
        gap = "the window or the sinks did not finish."
    return [
        Figure(perplexity_figure(_running(result), result["context_length"], result["cache"], result["chunk"]),
               f"Perplexity over the last {result['chunk']} tokens. The lines agree until the cache first evicts "
               f"(token {start + 1}); {gap}"),
        Figure(stream_bars_figure(bars),
               f"From token {start + 1} on: lowest {bars['label'].iloc[0]} {bars['ppl'].iloc[0]:.2f}, highest "
               f"{bars['label'].iloc[-1]} {bars['ppl'].iloc[-1]:.2f}." if len(bars) else "No runner finished."),
    ]


LESSONS = (
    Lesson("streams", "Sinks keep a stream alive past the trained context",
           "Keeping the first few tokens (attention sinks) beside a window of recent ones lets a model stream text "
           "indefinitely with a perplexity near that of recomputing each window from scratch, where a plain window "
           "degrades once the first tokens leave the cache and dense attention degrades past the trained context "
           "(StreamingLLM).",
           f"The first {TOKENS} tokens of the King James Bible in chunks of {CHUNK} at a cache of {CACHE} tokens, "
           f"re-rotated positions: dense (Full), Window (0 + {CACHE}), StreamingLLM ({SINKS} + {CACHE - SINKS}) and "
           f"the window recomputed for every chunk. A stream truly past SmolLM2's 8,192-token trained context is "
           f"{LONG_RUN} (or the Streams page), which takes several minutes.",
           run_streams, stream_verdict, stream_figures, unavailable, stream_table),
)
