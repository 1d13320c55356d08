"""Code lessons: prefix reuse after an edit, and what cross-layer K/V sharing (CLA, YOCO) really saves."""

from __future__ import annotations

import pandas as pd

from kvlab.engine.facts import LoadedModel
from kvlab.export import records
from kvlab.lessons.base import Figure, Lesson, Progress, Result, Verdict, pct
from kvlab.sharing.forward import sharing_refusal
from kvlab.sharing.schemes import make_scheme
from kvlab.viz.edits import cost_share_figure
from kvlab.viz.lessons import reuse_figure
from kvlab.workloads.code.costs import cost_table
from kvlab.workloads.code.edits import Edit
from kvlab.workloads.code.session import EditSession, measure_sharing, reuse_spans
from kvlab.workloads.code.source import module_source

CODE_MODULE = "json.scanner"  # real code, ~650 tokens: short enough for a CPU, the same on every Python 3.11
EDITS = (
    Edit("insert", at=0.1, text="# kvlab: a comment inserted early\n", label="early (10%)"),
    Edit("insert", at=0.5, text="# kvlab: a comment inserted in the middle\n", label="middle (50%)"),
    Edit("insert", at=0.9, text="# kvlab: a comment inserted late\n", label="late (90%)"),
)
EXACT_LOGITS = 1e-3  # last-token logits of reuse vs full prefill closer than this: float noise
SCHEMES = ("cla2", "cla3", "yoco")
CLAIM_MATCH = 0.1  # a scheme's computed share within this of the claimed one counts as "as claimed"


def _play(lm: LoadedModel, progress: Progress, span: tuple[float, float]) -> tuple[list[str], list[dict]]:
    """The preset edits on the preset file with prefix reuse: every text and each edit's record."""
    progress(span[0], f"prefilling the source of {CODE_MODULE}")
    session = EditSession.start(lm, module_source(CODE_MODULE)[0], CODE_MODULE)
    for i, edit in enumerate(EDITS, 1):
        progress(span[0] + (span[1] - span[0]) * i / (len(EDITS) + 1), f"edit {i}: {edit.label}")
        session.apply(edit)
    return session.texts, records(session.table())


def edits_table(result: Result) -> pd.DataFrame:
    """One row per edit: the tokens reused and prefilled again, and the re-prefill against a full prefill."""
    return pd.DataFrame([{"edit": e["label"], "tokens of the edited file": e["new_tokens"], "reused": e["reused"],
                          "prefilled again": e["suffix"], "reused share": f"{e['reuse_pct']:.1f} %",
                          "re-prefill (ms, one run)": e["reprefill_ms"],
                          "full prefill (ms, one run)": e["full_ms"],
                          "largest logit difference": f"{e['max_logit_diff']:.1e}"} for e in result["edits"]])


def sharing_table(result: Result) -> pd.DataFrame:
    """One row per sharing scheme: the layers computing K/V, the claimed and computed shares of Full, and fidelity."""
    measured = {r["scheme"]: r for r in result["measured"]}
    return pd.DataFrame([{"scheme": r["scheme"], "layers computing K/V": r["kv_layers"],
                          "claimed share of Full": f"{100 * r['claim_share']:.0f} %",
                          "computed FLOPs share": f"{100 * r['compute_share']:.1f} %",
                          "K/V memory share": f"{100 * r['kv_bytes_share']:.0f} %",
                          "KL without training (nats)": measured.get(r["scheme"], {}).get("kl_mean"),
                          "top-1 without training": measured.get(r["scheme"], {}).get("top1")}
                         for r in result["costs"]])


# --- lesson 7: prefix reuse after an edit ------------------------------------------------------------------

def run_prefix(lm: LoadedModel, progress: Progress) -> Result:
    """The prefix-reuse lesson's run: the bundled file's edit script played, each edit re-prefilled and timed."""
    _, edits = _play(lm, progress, (0.0, 1.0))
    progress(1.0, "done")
    return {"model": lm.facts.name, "file": CODE_MODULE, "edits": edits}


def prefix_verdict(result: Result) -> Verdict:
    """The notes: the prefix before the edit point is fully reusable; everything after must be re-prefilled."""
    edits = result["edits"]
    worst = max(e["max_logit_diff"] for e in edits)
    parts = [f"{e['label']}: {e['reused']} of {e['new_tokens']} tokens reused ({e['reuse_pct']:.0f}%), "
             f"{e['suffix']} re-prefilled" for e in edits]
    text = (f"On {result['file']}: " + "; ".join(parts) + f". The largest last-token logit difference from a full "
            f"prefill is {worst:.1e}. Time saved, one run each on a shared machine (not a benchmark): "
            + ", ".join(f"{e['full_ms'] - e['reprefill_ms']:,.0f} ms" for e in edits) + ".")
    ordered = all(a["reused"] < b["reused"] for a, b in zip(edits, edits[1:]))
    # exactness and reuse counts are deterministic, so n is how many edits were tried, not a sample to test
    text += (f" n = {len(edits)} edits of one file; the verdict would change if any edit's logits moved by "
             f"{EXACT_LOGITS:g} or more from a full prefill, or a later edit reused no more than an earlier one.")
    if worst < EXACT_LOGITS and ordered:
        return Verdict("supports", text + " Reuse is exact and grows with the edit's position: the run supports the "
                                          "claim.")
    if worst >= EXACT_LOGITS:
        return Verdict("contradicts", text + " Reusing the prefix changed the logits: the run contradicts the claim.")
    return Verdict("mixed", text + " Reuse is exact, but does not follow the edit's position here.")


def prefix_figures(result: Result) -> list[Figure]:
    """The share of the cache each edit keeps, with its reading."""
    edits = result["edits"]
    return [Figure(reuse_figure(edits),
                   f"An edit at 10% keeps {edits[0]['reuse_pct']:.0f}% of the cache, at 90% "
                   f"{edits[-1]['reuse_pct']:.0f}%: "
                   "what follows the edit point is prefilled again in every layer.")]


# --- lesson 8: what CLA and YOCO really save ----------------------------------------------------------------

def run_sharing(lm: LoadedModel, progress: Progress) -> Result:
    """Cost accounting of the preset edits' re-prefills under each scheme, and the schemes run without training."""
    texts, edits = _play(lm, progress, (0.0, 0.3))
    schemes = [make_scheme(n, lm.facts.n_layers) for n in SCHEMES]
    costs = cost_table(lm.facts, schemes, reuse_spans(lm, texts))
    # fidelity is measured on the original file; one re-prefill is enough to run each scheme's reuse path
    summary, _ = measure_sharing(lm, texts[:2], schemes, progress=lambda f, m: progress(0.3 + 0.7 * f, m))
    progress(1.0, "done")
    return {"model": lm.facts.name, "layers": lm.facts.n_layers, "file": CODE_MODULE, "edits": edits,
            "costs": records(costs), "measured": records(summary)}


def sharing_verdict(result: Result) -> Verdict:
    """The notes: under CLA, re-prefill after an edit drops from O(N_layers) to O(N_layers / sharing ratio)."""
    rows = [r for r in result["costs"] if r["scheme"] != "Full"]
    measured = {r["scheme"]: r for r in result["measured"]}
    parts, as_claimed = [], []
    for r in rows:
        m = measured.get(r["scheme"])
        drift = f", and without training drifts by KL {m['kl_mean']:.3g} (top-1 {pct(m['top1'])})" if m else ""
        ok = abs(r["compute_share"] - r["claim_share"]) <= CLAIM_MATCH
        as_claimed.append(ok)
        parts.append(f"{r['scheme']} computes {pct(r['compute_share'])} of Full's re-prefill FLOPs (claimed "
                     f"{pct(r['claim_share'])}), stores {pct(r['kv_bytes_share'])} of its K/V"
                     + drift)
    text = (f"Over {len(result['edits'])} edits of {result['file']} ({result['layers']} layers): {'; '.join(parts)}."
            f" The FLOPs and bytes are counted from the model's shape, not sampled (n = {len(rows)} schemes); only a "
            f"scheme computing within {pct(CLAIM_MATCH)} of its claimed share, or not, would change the verdict.")
    if all(as_claimed):
        return Verdict("supports", text + " Each scheme saves what the notes claim: the run supports the claim.")
    if not any(as_claimed):
        return Verdict("contradicts", text + " No scheme saves what the notes claim: CLA skips only the K and V "
                                             "projections of its non-producing layers, not their attention or MLP: "
                                             "the run contradicts the claim.")
    missed = [r["scheme"] for r, ok in zip(rows, as_claimed) if not ok]
    verb = "saves" if len(missed) == 1 else "save"
    return Verdict("mixed", text + f" {' and '.join(missed)} {verb} far less than claimed (only the K/V projections "
                                   "of the sharing layers are skipped, not their attention or MLP); the others match "
                                   "the claim.")


def sharing_figures(result: Result) -> list[Figure]:
    """The FLOPs share per component of each scheme against the notes' claim, with its reading."""
    costs = pd.DataFrame(result["costs"])
    cla = [r for r in result["costs"] if r["scheme"].startswith("CLA")]
    first = cla[0] if cla else result["costs"][-1]
    return [Figure(cost_share_figure(costs),
                   f"{first['scheme']}: claimed {pct(first['claim_share'])} of Full's re-prefill, computed "
                   f"{pct(first['compute_share'])} — the bars show which components are left.")]


LESSONS = (
    Lesson("prefix_reuse", "Prefix reuse after an edit",
           "After an edit of a long code prompt, the K/V of everything before the edit point is reusable (a prefix "
           "cache), and everything after it must be prefilled again in every layer.",
           f"The source of {CODE_MODULE} as the whole prompt; comments inserted at 10%, 50% and 90% of its lines, "
           "each re-prefilled from the longest common token prefix and compared with a full prefill.",
           run_prefix, prefix_verdict, prefix_figures, table=edits_table),
    Lesson("sharing", "What CLA and YOCO really save",
           "With cross-layer K/V sharing (CLA, YOCO), re-prefilling after an edit drops from O(N_layers) to "
           "O(N_layers / sharing ratio).",
           "The three edits of the previous lesson; re-prefill FLOPs per component under CLA-2, CLA-3 and YOCO "
           "from the model's real shapes, and each scheme run on the model without training (fidelity).",
           run_sharing, sharing_verdict, sharing_figures, unavailable=sharing_refusal, table=sharing_table),
)
