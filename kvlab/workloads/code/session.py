"""One code-edit session: prefix reuse per edit, sharing schemes measured and costed, K/V similarity.

The page holds one ``EditSession``; ``python -m kvlab edit`` and the lessons replay edit scripts with one.
"""

from __future__ import annotations

import math
import statistics
import threading
from dataclasses import dataclass, field
from functools import partial

import pandas as pd

from kvlab.engine.cache import common_prefix
from kvlab.engine.facts import LoadedModel
from kvlab.engine.fidelity import fidelity
from kvlab.engine.progress import Progress
from kvlab.engine.timing import Timing, paired_ratios, time_rounds
from kvlab.errors import KvlabError
from kvlab.sharing.forward import adjacent_similarity, crop_kv, shared_forward, sharing_refusal
from kvlab.sharing.schemes import Scheme, make_scheme
from kvlab.workloads.code.costs import cost_table
from kvlab.workloads.code.edits import (
    Edit,
    EditResult,
    EditState,
    encode_checked,
    first_changed_line,
    reuse_edit,
    start_state,
    step,
)


def reuse_spans(lm: LoadedModel, texts: list[str]) -> list[tuple[int, int]]:
    """(reused prefix, re-prefilled suffix) in tokens for each step texts[i-1] → texts[i]."""
    ids = [encode_checked(lm, t) for t in texts]
    spans = []
    for old, new in zip(ids[:-1], ids[1:]):
        reused = min(common_prefix(old, new), len(new) - 1)
        spans.append((reused, len(new) - reused))
    return spans


def measure_sharing(lm: LoadedModel, texts: list[str], schemes: list[Scheme], positions: int = 32,
                    repeats: int = 1, progress: Progress | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Run each scheme over the edit history ``texts`` (texts[0] prefilled, then one re-prefill per edit).

    Returns (summary per scheme, re-prefill time per edit and scheme). Fidelity compares the last
    ``positions`` next-token distributions of texts[0] with the unshared model. Every scheme runs the same
    layer-by-layer loop, timed in rounds (``time_rounds``: each scheme once a round, the order turned), so Full is
    the fair baseline and a busy spell or a cold first call falls on every scheme alike; times are medians of
    ``repeats`` rounds, the prefill ratio the median of the rounds' ratios to Full.
    """
    if refusal := sharing_refusal(lm):
        raise KvlabError(refusal)
    ids = [encode_checked(lm, t) for t in texts]
    spans = reuse_spans(lm, texts)
    full = make_scheme("full", lm.facts.n_layers)
    run = {s.label: s for s in [full] + [s for s in schemes if s.name != "full"]}
    costs = cost_table(lm.facts, list(run.values()), spans or [(0, len(ids[0]))]).set_index("scheme")
    every = set(run)  # a scheme that fails is an error of the whole measurement, as a failed run of the loop is
    steps = 1 + len(spans)
    if progress:
        progress(0.0, f"prefill of the file: {len(run)} schemes, each once a round, "
                      f"{repeats} round{'s' * (repeats != 1)}")
    prefills = time_rounds({label: partial(shared_forward, lm, ids[0], s, last_n=positions)
                            for label, s in run.items()}, repeats, required=every)
    kv = {label: side.result[1] for label, side in prefills.items()}
    # the prefills' logits and times; their caches live on only in ``kv``, which each re-prefill replaces
    logits, seconds = ({label: side.result[0] for label, side in prefills.items()},
                       {label: side.seconds for label, side in prefills.items()})
    del prefills
    reprefill: dict[str, float] = dict.fromkeys(run, 0.0)
    times = []
    for i, (reused, _) in enumerate(spans):
        if progress:
            progress((i + 1) / steps, f"re-prefill after edit {i + 1} of {len(spans)}")
        # each seed a view of its cache's prefix, held by its call only: the previous caches go with the calls
        timed = time_rounds({label: partial(shared_forward, lm, ids[i + 1], s, crop_kv(kv[label], reused), reused)
                             for label, s in run.items()}, repeats, required=every)
        for label, side in timed.items():
            kv[label] = side.result[1]
            timing = Timing.of(side.seconds)
            reprefill[label] += timing.median
            times.append({"edit": i + 1, "scheme": label, "reprefill_ms": 1000 * timing.median,
                          "reprefill_spread_ms": 1000 * timing.spread, "runs": timing.runs})
    rows = []
    for label, scheme in run.items():
        prefill_s, fid, cost = Timing.of(seconds[label]), fidelity(logits[full.label], logits[label]), costs.loc[label]
        rows.append({
            "scheme": label, "kv_layers": scheme.kv_layers, "claim_share": scheme.claim_share,
            "compute_share": cost["compute_share"], "kv_bytes_share": cost["kv_bytes_share"],
            "prefill_s": prefill_s.median, "prefill_spread_s": prefill_s.spread, "runs": prefill_s.runs,
            "prefill_time_ratio": statistics.median(paired_ratios(seconds[label], seconds[full.label])),
            "reprefill_s": reprefill[label] if spans else math.nan,
            "kl_mean": fid.kl, "kl_max": fid.kl_max, "top1": fid.top1, "positions": fid.positions,
        })
    summary = pd.DataFrame(rows)
    summary["reprefill_time_ratio"] = summary["reprefill_s"] / summary["reprefill_s"].iloc[0]
    if progress:
        progress(1.0, "sharing measured")
    return summary, pd.DataFrame(times, columns=["edit", "scheme", "reprefill_ms", "reprefill_spread_ms", "runs"])


def similarity_frame(sim: dict) -> pd.DataFrame:
    """Long table: layer pair (l, l+1), tensor (K/V), KV head or 'mean', cosine similarity."""
    rows = []
    for name, values in sim.items():  # values [layers-1, kv_heads]
        for layer, per_head in enumerate(values.tolist()):
            for head, value in enumerate(per_head):
                rows.append({"layer": layer, "tensor": name.upper(), "head": str(head), "cosine": value})
            mean = sum(per_head) / len(per_head)
            rows.append({"layer": layer, "tensor": name.upper(), "head": "mean", "cosine": mean})
    return pd.DataFrame(rows)


def deep_similarity(frame: pd.DataFrame) -> dict[str, float]:
    """Mean cosine of K and of V over the deeper half of the layer pairs (l ≥ (layers − 1) / 2) of
    ``similarity_frame``'s table, where MiniCache observes adjacent layers alike: {"K": …, "V": …}."""
    means = frame[frame["head"] == "mean"]
    deep = means[means["layer"] >= (means["layer"].max() + 1) / 2]
    return {name: float(rows["cosine"].mean()) for name, rows in deep.groupby("tensor")}


@dataclass
class EditReport:
    """Everything the code-edit page and CLI show, as tables."""

    source: str
    facts: dict
    tokens: int
    edits: pd.DataFrame
    sharing: pd.DataFrame
    sharing_times: pd.DataFrame
    costs: pd.DataFrame
    similarity: pd.DataFrame

    def to_dict(self) -> dict:
        """JSON-ready: tables as lists of records."""
        def records(df: pd.DataFrame) -> list[dict]:
            return df.astype(object).where(df.notna(), None).to_dict(orient="records")

        return {
            "source": self.source, "model": self.facts, "tokens": self.tokens,
            "edits": records(self.edits), "sharing": records(self.sharing),
            "sharing_times": records(self.sharing_times), "costs": records(self.costs),
            "similarity": records(self.similarity),
        }


def edits_frame(results: list[EditResult]) -> pd.DataFrame:
    columns = list(EditResult.__dataclass_fields__)
    return pd.DataFrame([r.as_dict() for r in results], columns=columns)


@dataclass(eq=False)  # two sessions are the same only if they are one object
class EditSession:
    """A code file being edited: its K/V kept by prefix reuse, every text so far and each edit's report."""

    lm: LoadedModel
    source: str  # where the file came from: a path, a module, "pasted"
    state: EditState  # the current text, its ids and its cache
    texts: list[str]  # the file as first prefilled, then after each edit
    results: list[EditResult]  # one report per applied edit
    scripts: list[str | None] = field(default_factory=list)  # per applied edit, the sequence it came from (None: typed)
    sharing: tuple[pd.DataFrame, pd.DataFrame] | None = None  # the last ``measure`` of this history
    # held while an edit or a measurement runs: a page run that a click cut short goes on computing until its next
    # page call, beside the run the click started, and the two must not both change the session
    _busy: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @classmethod
    def start(cls, lm: LoadedModel, text: str, source: str = "") -> EditSession:
        """Prefill ``text`` from scratch; KvlabError if it is empty or does not fit the context."""
        return cls(lm, source, start_state(lm, text), [text], [])

    def is_for(self, lm: LoadedModel, source: str, text: str) -> bool:
        """Whether this session started from ``text`` of ``source`` on ``lm``'s model."""
        return (self.lm.facts.name, self.source, self.texts[0]) == (lm.facts.name, source, text)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no edit or measurement runs on this session; False if one still runs after ``timeout`` s."""
        if not self._busy.acquire(timeout=timeout):
            return False
        self._busy.release()
        return True

    def _record(self, state: EditState, result: EditResult, script: str | None = None) -> EditResult:
        self.state, self.sharing = state, None  # a measurement describes the history it ran on
        self.results.append(result)
        self.texts.append(state.text)
        self.scripts.append(script)
        return result

    def played(self, script: str) -> int | None:
        """How many edits of the sequence ``script`` this session has applied, one after another from the file as
        loaded; None where other edits came in (its edits are written for the file as its earlier ones leave it)."""
        return len(self.scripts) if all(s == script for s in self.scripts) else None

    def apply(self, edit: Edit, repeats: int = 1, script: str | None = None, after: int | None = None) -> EditResult:
        """Apply the next edit of the sequence ``script`` with prefix reuse and return its report; a bad edit
        changes nothing. ``after``: how many of the sequence's edits it follows, checked under the lock, so that two
        page runs playing one sequence cannot both apply its next edit."""
        with self._busy:
            if after is not None and self.played(script) != after:
                raise KvlabError(f"{edit.label}: the file is no longer as {after} edits of the sequence left it "
                                 "(another run edited it meanwhile)")
            return self._record(*step(self.lm, self.state, edit, len(self.results) + 1, repeats), script)

    def apply_text(self, new_text: str, repeats: int = 1) -> EditResult:
        """Make ``new_text`` (an editor's content) the file with prefix reuse and return the edit's report."""
        with self._busy:
            if new_text == self.state.text:  # an earlier call made it the file while this one waited
                raise KvlabError("the file holds this text already")
            line = first_changed_line(self.state.text, new_text)
            return self._record(*reuse_edit(self.lm, self.state, new_text, len(self.results) + 1, "manual edit",
                                            "edit", line, repeats))

    def table(self) -> pd.DataFrame:
        """One row per applied edit."""
        return edits_frame(self.results)

    def spans(self) -> list[tuple[int, int]]:
        """(reused prefix, re-prefilled suffix) of each applied edit."""
        return reuse_spans(self.lm, self.texts)

    def similarity(self) -> pd.DataFrame:
        """Adjacent-layer K/V similarity of the current cache."""
        return similarity_frame(adjacent_similarity(self.state.cache))

    def measure(self, schemes: list[Scheme], positions: int = 32, repeats: int = 1,
                progress: Progress | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
        """``measure_sharing`` over this session's texts; kept in ``sharing`` until the next edit. The last
        measurement is dropped first: one that stops or fails leaves none, not an older one of other settings."""
        with self._busy:
            self.sharing = None
            self.sharing = measure_sharing(self.lm, self.texts, schemes, positions, repeats, progress)
            return self.sharing


def run_report(lm: LoadedModel, text: str, source: str, edits: tuple[Edit, ...], schemes: list[Scheme],
               repeats: int = 1, positions: int = 32, progress: Progress | None = None) -> EditReport:
    """Prefill ``text``, apply ``edits`` with prefix reuse, then measure and cost the sharing schemes."""
    if progress:
        progress(0.0, "prefilling the file")
    session = EditSession.start(lm, text, source)
    tokens = len(session.state.ids)
    similarity = session.similarity()
    for i, edit in enumerate(edits, 1):
        session.apply(edit, repeats)
        if progress:
            progress(0.5 * i / len(edits), f"edit {i}/{len(edits)}: {edit.label}")
    sharing, times = session.measure(schemes, positions, repeats,
                                     (lambda f, m: progress(0.5 + 0.5 * f, m)) if progress else None)
    spans = session.spans() or [(0, len(session.state.ids))]
    costs = cost_table(lm.facts, [make_scheme("full", lm.facts.n_layers), *schemes], spans)
    return EditReport(source, lm.facts.as_dict(), tokens, session.table(), sharing, times, costs, similarity)
