"""A stream through policies side by side: the NLL of every token of a long text fed in chunks.

StreamingLLM's language-modelling protocol (mit-han-lab/streaming-llm ``examples/eval_long_ppl.py``):
feed the text one token at a time, take each next token's negative log-likelihood from the logits,
then cut the cache back to its size (``streaming_llm/kv_cache.py``, ``StartRecentKVCache``). Here a
chunk of C tokens is read at a time (C = 1 is that protocol): each chunk is read on the cache the
previous one left, its logits score every next token, then each policy compresses its cache to the
budget. A cache therefore holds at most budget + C keys while a chunk is read.

Two baselines are not cache policies. **Dense** is Full: every key stays, and past the model's
trained context its positions leave the range it was trained on (each token says so). **Sliding
window with recomputation** (``recompute``) runs, for every chunk, a fresh forward over the budget
tokens before it and the chunk itself: the paper's exact but slow reference, whose positions never
exceed budget + C.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from kvlab.engine.batched import append_together
from kvlab.engine.cache import new_cache
from kvlab.engine.facts import LoadedModel
from kvlab.engine.forward import run
from kvlab.engine.kvstate import KVState
from kvlab.engine.progress import Progress
from kvlab.engine.timing import clock
from kvlab.errors import KvlabError
from kvlab.policies import Policy
from kvlab.policies.evict import evict
from kvlab.saved import stamp
from kvlab.workloads.stream.settings import (
    RECOMPUTE,
    StreamSettings,
    check_length,
    chunk_work,
    chunks,
    label_of,
    stream_policies,
    stream_work,
)

# the tables' columns in words, on the page and in the report (the CSV and JSON keep the names)
HEADERS = {
    "label": "runner", "ppl": "perplexity", "ppl_in_context": "… in context",
    "ppl_past_context": "… past context", "tokens": "tokens scored",
    "max_rope_position": "largest rotary position", "time_s": "seconds (one run)",
    "tokens_per_s": "tokens / s (one run)",
    "recent": "recent tokens", "cache": "sinks + recent", "ppl_after_cache_filled": "after the cache filled",
    "past_context": "any query past the trained context", "start": "from token", "end": "to token"}
QUIET = ("error", "past_context", "ppl_past_context")  # shown only where a row says something in them


@dataclass
class Trace:
    """One runner's stream. Entry i is about token i + 1 of the text, predicted by the query of token i."""

    name: str
    nll: list[float] = field(default_factory=list)
    rope_position: list[int] = field(default_factory=list)  # the rotary position the predicting query sat at
    keys: list[int] = field(default_factory=list)  # keys that query could read, its own included
    time_s: float = 0.0
    error: str | None = None

    def extend(self, nll: torch.Tensor, rope: torch.Tensor, keys: torch.Tensor) -> None:
        """Add one chunk's tokens: nll, rope positions and keys read, each [n]."""
        self.nll += nll.tolist()
        self.rope_position += rope.tolist()
        self.keys += keys.tolist()


@dataclass
class StreamResult:
    """A finished (or cancelled) stream: one trace per runner over the same tokens."""

    settings: StreamSettings
    model: str
    context_length: int  # the model's trained context: rotary positions from here on are untrained
    n_tokens: int  # tokens of the text streamed
    traces: dict[str, Trace]
    cancelled: bool = False
    time_s: float = 0.0

    @property
    def scored(self) -> int:
        """Tokens scored so far (every runner that did not fail scored the same ones)."""
        return max((len(t.nll) for t in self.traces.values() if t.error is None), default=0)

    def tokens(self) -> pd.DataFrame:
        """One row per runner and scored token: policy, label, position (the token's index), nll,
        rope_position (its predicting query's), keys read and whether that query was past the trained context."""
        frames = []
        for name, t in self.traces.items():
            if t.error is not None:
                continue
            rope = np.asarray(t.rope_position, dtype=np.int64)
            frames.append(pd.DataFrame({
                "policy": name, "label": label_of(name), "position": np.arange(1, len(t.nll) + 1),
                "nll": np.asarray(t.nll, dtype=np.float64), "rope_position": rope,
                "keys": np.asarray(t.keys, dtype=np.int64), "past_context": rope >= self.context_length,
            }))
        columns = ["policy", "label", "position", "nll", "rope_position", "keys", "past_context"]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)

    def _failed(self, columns: list[str]) -> pd.DataFrame:
        """One row per runner that failed, its error and nothing else, in a table of ``columns``."""
        return pd.DataFrame([{"policy": n, "label": label_of(n), "error": t.error}
                             for n, t in self.traces.items() if t.error is not None], columns=columns)

    def token_file(self) -> pd.DataFrame:
        """``tokens`` with an error column and one row, its error, for each runner that failed: the per-token CSV
        names every runner, as the segments do."""
        df = self.tokens().assign(error=None)
        failed = self._failed(list(df.columns))
        whole = {"position": "Int64", "rope_position": "Int64", "keys": "Int64", "past_context": "boolean"}
        return pd.concat([df, failed], ignore_index=True).astype(whole) if len(failed) else df

    def segments(self, size: int) -> pd.DataFrame:
        """Perplexity per runner over consecutive segments of ``size`` tokens (the last may be shorter); a runner
        that failed has one row, its error, and no segment."""
        if size < 1:
            raise KvlabError(f"a segment must hold at least one token, not {size}")
        columns = ["policy", "label", "start", "end", "tokens", "ppl", "past_context", "error"]
        failed = self._failed(columns)
        df = self.tokens()
        if df.empty:
            return failed
        df["segment"] = (df["position"] - 1) // size
        out = df.groupby(["policy", "label", "segment"], sort=False).agg(
            start=("position", "min"), end=("position", "max"), tokens=("nll", "size"), nll=("nll", "mean"),
            past_context=("past_context", "any")).reset_index()
        out = out.assign(ppl=np.exp(out["nll"]), error=None)[columns]
        if len(failed):  # whole counts stay whole beside the failed runners' empty cells
            whole = {"start": "Int64", "end": "Int64", "tokens": "Int64"}
            out = pd.concat([out, failed], ignore_index=True).astype(whole)
        return out

    def segment_table(self, size: int) -> pd.DataFrame:
        """``segments`` one row a segment: its span, then each runner's perplexity in the summary's order."""
        segments = self.segments(size)
        segments = segments[segments["error"].isna()]
        per_segment = segments.pivot(index="start", columns="label", values="ppl")
        ordered = [label for label in self.summary()["label"] if label in per_segment.columns]
        span = segments.groupby("start").agg(end=("end", "max"), tokens=("tokens", "max"))  # a short last one as such
        return span.join(per_segment[ordered]).reset_index()

    def curve_window(self, window: int) -> int:
        """The running curve's window for this stream: ``window``, or a quarter of the tokens scored where the stream
        holds fewer than two windows (one window over all of it would draw a single point per runner)."""
        return window if self.scored >= 2 * window else max(1, self.scored // 4)

    def running(self, window: int) -> pd.DataFrame:
        """Each runner's perplexity over the last ``window`` tokens (the running curve), from the first position
        that has a whole window behind it (a stream shorter than the window: its last position alone)."""
        if window < 1:
            raise KvlabError(f"the running window must hold at least one token, not {window}")
        df = self.tokens()
        df["ppl"] = np.exp(df.groupby("policy", sort=False)["nll"].transform(
            lambda s: s.rolling(window, min_periods=min(window, len(s))).mean()))
        return df.dropna(subset=["ppl"])[["policy", "label", "position", "ppl", "past_context"]]

    def summary(self) -> pd.DataFrame:
        """Per runner: perplexity over the whole stream, inside and past the trained context, speed, error."""
        rows = []
        for name, t in self.traces.items():
            nll = np.asarray(t.nll, dtype=np.float64)
            past = np.asarray(t.rope_position) >= self.context_length
            ok = t.error is None and len(nll) > 0
            rows.append({
                "policy": name, "label": label_of(name),
                "ppl": float(np.exp(nll.mean())) if ok else None,
                "ppl_in_context": float(np.exp(nll[~past].mean())) if ok and (~past).any() else None,
                "ppl_past_context": float(np.exp(nll[past].mean())) if ok and past.any() else None,
                "tokens": len(nll) if ok else None, "max_rope_position": int(max(t.rope_position)) if ok else None,
                "time_s": t.time_s, "tokens_per_s": len(nll) / t.time_s if ok and t.time_s > 0 else None,
                "error": t.error,
            })
        # counts stay whole where a failed runner has none (None would make them floats: 119.000 in a report)
        return pd.DataFrame(rows).astype({"tokens": "Int64", "max_rope_position": "Int64"})

    def as_dict(self) -> dict:
        """What the JSON file holds: settings, the model's facts, the summary and per-runner errors."""
        s = self.settings
        return {**stamp(self.model), "context_length": self.context_length, "tokens": self.n_tokens,
                "scored": self.scored, "cancelled": self.cancelled, "time_s": self.time_s,
                "settings": {"policies": list(s.policies), "budget": s.budget, "chunk": s.chunk,
                             "position_mode": s.position_mode, "params": s.params},
                "summary": self.summary()}

    def record(self, text_name: str, segment: int, ablation: pd.DataFrame | None = None,
               ablation_s: float | None = None) -> dict:
        """What a stream's JSON file holds: ``as_dict``, the text's name, the perplexity per ``segment`` tokens, and
        the sink ablation's table and seconds (None where none ran; ``time_s`` is the stream's alone)."""
        return self.as_dict() | {"text": text_name, "segments": self.segments(segment), "sink_ablation": ablation,
                                 "sink_ablation_time_s": ablation_s}


def token_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[n, vocab] logits, [n] next tokens → [n] negative log-likelihoods (float32)."""
    return F.cross_entropy(logits.float(), labels.to(logits.device), reduction="none").cpu()


class _Policies:
    """Every cache policy's state, fed each chunk together, then compressed one by one."""

    def __init__(self, lm: LoadedModel, policies: dict[str, Policy], settings: StreamSettings,
                 traces: dict[str, Trace]) -> None:
        self.lm, self.policies, self.traces = lm, policies, traces
        self.states = {name: KVState(lm, settings.position_mode, track_accumulated=p.needs_accumulated,
                                     quant=p.quantizer()) for name, p in policies.items()}
        self.budgets = {name: p.layer_budgets(settings.budget, lm.facts.n_layers) for name, p in policies.items()}

    def read(self, chunk: list[int], labels: torch.Tensor) -> None:
        """Feed ``chunk`` to every live state, score its next tokens, then compress each to its budget."""
        live = list(self.states)
        if not live:
            return
        n = len(chunk)
        step = torch.arange(1, n + 1)
        before = {name: (self.states[name].next_positions(n).cpu(), max(self.states[name].lengths()))
                  for name in live}
        probes = [self.policies[name].probe() for name in live]
        scored: list = [None, None]  # (logits, their NLL): states whose caches are alike share one row's logits

        def nll_of(_: int, logits: torch.Tensor) -> torch.Tensor:
            if scored[0] is not logits:
                scored[:] = logits, token_nll(logits, labels)
            return scored[1]

        t0 = clock()
        nlls = append_together([self.states[name] for name in live], chunk, probes, reduce=nll_of)
        share = (clock() - t0) / len(live)
        for name, nll, probe in zip(live, nlls, probes):
            rope, held = before[name]
            trace = self.traces[name]
            trace.extend(nll, rope, held + step)
            t0 = clock()
            try:
                evict(self.states[name], self.policies[name], self.budgets[name], probe)
            except Exception as exc:  # one policy failing never takes the others down
                if name == "full":
                    raise
                trace.error = f"{type(exc).__name__}: {exc}"
                del self.states[name]  # its memory goes back now
            trace.time_s += share + clock() - t0


def _recompute(lm: LoadedModel, ids: list[int], start: int, end: int, budget: int, labels: torch.Tensor,
               trace: Trace) -> None:
    """Score tokens ``start`` … ``end`` − 1's next tokens by a fresh forward over the window before them."""
    first = max(0, start - budget)
    window = torch.tensor(ids[first:end])  # [budget + chunk at most]
    t0 = clock()
    logits = run(lm, window[None], torch.arange(len(window))[None], new_cache(lm), logits_to_keep=end - start)[0]
    offset = start - first
    rope = torch.arange(offset, offset + end - start)
    trace.extend(token_nll(logits, labels), rope, rope + 1)
    trace.time_s += clock() - t0


def run_stream(
    lm: LoadedModel,
    ids: list[int],
    settings: StreamSettings,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
) -> StreamResult:
    """Stream ``ids`` through every runner of ``settings``; ``cancel`` stops it after the current chunk.

    Policies that fail are marked with their error and dropped; the others go on.
    """
    return stream_with(lm, ids, settings, stream_policies(lm, settings), progress, cancel)


def stream_with(
    lm: LoadedModel,
    ids: list[int],
    settings: StreamSettings,
    policies: dict[str, Policy],
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
) -> StreamResult:
    """``run_stream`` with the policies given by name (``settings.policies`` names them, and the recompute
    baseline where it runs): several variants of one policy can then stream side by side."""
    settings.check()
    if stray := set(settings.policies) - set(policies) - {RECOMPUTE}:
        raise KvlabError(f"no policy given for {', '.join(sorted(stray))}")
    check_length(len(ids), settings)
    traces = {name: Trace(name) for name in settings.policies}
    result = StreamResult(settings, lm.facts.name, lm.facts.context_length, len(ids), traces)
    caches = _Policies(lm, policies, settings, traces)
    t0 = clock()
    total = len(ids) - 1  # the last token predicts nothing
    work, done = stream_work(settings, len(ids)), 0
    for start, end in chunks(len(ids), settings.chunk):
        if cancel is not None and cancel.is_set():
            result.cancelled = True
            break
        labels = torch.tensor(ids[start + 1 : end + 1])  # [n] the tokens each query predicts
        caches.read(ids[start:end], labels)
        if RECOMPUTE in traces:
            _recompute(lm, ids, start, end, settings.budget, labels, traces[RECOMPUTE])
        done += chunk_work(settings, start, end)
        if progress is not None:
            progress(done / work, f"{end:,} of {total:,} tokens streamed")
    result.time_s = clock() - t0
    return result

