"""The seed's algorithm × workload table, rebuilt from an arena run's rows.

The notes kvlab grew from (``shared/seed``) rate cache-policy families per workload with ✓ / ⚠ / ✗
("稀疏方案 | 多轮适配度": StreamingLLM / SWA ✓ 好, H2O / SnapKV ⚠ 有风险, PyramidKV ⚠ 有风险, for
multi-turn; the table shows their verdicts in English, as a browser without CJK fonts draws boxes for the
notes' words). Here each family gets the same marks from measurements instead: per budget and workload,
the family's best member's correct answers as a share of Full's on the same questions, its mean KL
against Full, and the bytes it held as a share of Full's. A cell with no measurement says why in
words (not run, failed, not measured) and never carries a number.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pandas as pd

from kvlab.experiments.plan import MODES
from kvlab.experiments.tables import memory_equal
from kvlab.stats import Interval, wilson

# a share of Full's correct answers whose whole 95 % Wilson interval lies above GOOD is ✓, between RISKY and GOOD ⚠,
# below RISKY ✗; an interval across either line is UNSURE ("≈", written with its interval)
GOOD, RISKY = 0.9, 0.5
MARKS = ("✗", "⚠", "✓")  # worst to best: how a measured mark compares with the seed's
UNSURE = "≈"
WORKLOADS = (*MODES, "RAG", "code edits")
NOT_MEASURED = {"RAG": "not measured in this run (the arena runs conversations; RAG is `kvlab rag`)",
                "code edits": "not measured in this run (the arena runs conversations; code edits are `kvlab edit`)"}


@dataclass(frozen=True)
class Family:
    """A row of the seed's table: a family of policies and the seed's verdict per workload."""

    name: str
    policies: str  # the kvlab policies that belong to it, in words
    seed: dict[str, str] = field(default_factory=dict)  # workload -> verdict, its mark first


FAMILIES = (
    Family("window / sink", "streamingllm, window",
           {"multi-turn": "✓ good: temporal locality follows how older turns fade"}),
    Family("importance scoring", "h2o, snapkv, tova, knorm",
           {"multi-turn": "⚠ risky: importance scored on one turn's queries drifts over turns"}),
    Family("pyramid", "pyramidkv",
           {"multi-turn": "⚠ risky: as importance scoring; fixed per-layer sparsity"}),
    Family("query-aware sparse reading (Quest)", "quest"),
    Family("quantization", "kivi with evict_with=full"),
    Family("quantization + eviction", "kivi with evict_with an eviction policy"),
    Family("query-agnostic scoring", "kvzip, expected_attention, keydiff"),
    Family("head-adaptive budgets (AdaKV)", "adakv with any scorer"),
    Family("head-hybrid (DuoAttention)", "duoattention"),
    Family("oracle (not deployable: reads later turns)", "oracle"),
)
_MEMBERS = {"streamingllm": "window / sink", "window": "window / sink", "h2o": "importance scoring",
            "snapkv": "importance scoring", "tova": "importance scoring", "knorm": "importance scoring",
            "pyramidkv": "pyramid", "quest": "query-aware sparse reading (Quest)",
            "expected_attention": "query-agnostic scoring", "keydiff": "query-agnostic scoring",
            "kvzip": "query-agnostic scoring", "adakv": "head-adaptive budgets (AdaKV)",
            "duoattention": "head-hybrid (DuoAttention)",
            "oracle": "oracle (not deployable: reads later turns)"}

CELL_COLUMNS = ["family", "budget", "workload", "status", "policy", "accuracy_of_full", "share_low", "share_high",
                "n", "kl", "held_share", "verdict", "seed", "agrees", "cell"]


def family_of(policy: str, params: dict) -> str | None:
    """The family a policy run with ``params`` belongs to; None for Full (the reference) and unknown names."""
    if policy == "kivi":
        if params.get("bits") == 16:  # quantization off: exactly its eviction policy
            return family_of(params["evict_with"], {})
        return "quantization" if params.get("evict_with", "full") == "full" else "quantization + eviction"
    return _MEMBERS.get(policy)


def verdict(share: Interval) -> str:
    """✓ / ⚠ / ✗ for a share of Full's correct answers when its whole interval lies on one side of each line (see
    GOOD and RISKY), else ``UNSURE``."""
    if share.side(GOOD) == "above":
        return "✓"
    if share.side(RISKY) == "below":
        return "✗"
    if share.side(RISKY) == "above" and share.side(GOOD) == "below":
        return "⚠"
    return UNSURE


def agreement(measured: str, seed: str | None) -> str:
    """How the measured mark stands to the seed's verdict (whose mark is its first character)."""
    if seed is None:
        return "the seed gives no verdict"
    if measured not in MARKS:  # failed, n/a, or an interval across a line
        return "cannot tell"
    ours, theirs = MARKS.index(measured), MARKS.index(seed.split()[0])
    return "agrees" if ours == theirs else "no: better" if ours > theirs else "no: worse"


def _member_scores(rows: pd.DataFrame, full: pd.DataFrame, held: pd.Series) -> dict:
    """One policy's rows at one budget and mode → the share of Full's correct answers it also gave (with its Wilson
    interval over the questions Full answered), KL and bytes held."""
    keys = ["workload", "turn"]
    scored = rows[rows["scored"].astype(bool)]
    ref = full.set_index(keys).loc[pd.MultiIndex.from_frame(scored[keys])] if len(scored) else full.iloc[:0]
    full_right = ref["correct"].astype(bool).to_numpy()  # [questions scored]
    kept = int((scored["correct"].astype(bool).to_numpy() & full_right).sum())
    share = wilson(kept, int(full_right.sum()))
    return {"policy": rows["policy"].iloc[0], "scored": len(scored), "full_correct": share.n, "share": share,
            "accuracy_of_full": share.estimate if share.n else None,
            "kl": rows["kl"].astype(float).mean(), "held_share": held.get(rows["policy"].iloc[0])}


def _measured_cell(members: list[dict], failed: dict[str, str], seed: str | None) -> dict:
    """The cell of one family at one budget and mode from its members' scores (failed members aside)."""
    if not members:
        first = next(iter(failed.items()))
        return {"status": "failed", "verdict": "failed", "agrees": "cannot tell",
                "cell": f"failed: {first[0]}: {first[1]}"}
    rated = [m for m in members if m["accuracy_of_full"] is not None]
    best = (max(rated, key=lambda m: (m["accuracy_of_full"], -m["kl"])) if rated
            else min(members, key=lambda m: m["kl"]))
    also = f"; {', '.join(failed)} failed" if failed else ""
    memory = f"KL {best['kl']:.3f} · held {best['held_share']:.0%} of Full's bytes ({best['policy']}{also})"
    share: Interval = best["share"]
    if best["accuracy_of_full"] is None:
        why = "no answers to check" if not best["scored"] else "Full answered none"
        mark, text, interval = f"n/a ({why})", f"n/a ({why}) · {memory}", {}
    else:
        mark = verdict(share)
        text = (f"{mark} {share.estimate:.0%} [{100 * share.low:.0f}–{100 * share.high:.0f}%] of Full's answers "
                f"(n = {share.n} by Full) · {memory}")
        interval = {"share_low": share.low, "share_high": share.high, "n": share.n}
    agrees = agreement(mark, seed)
    return {"status": "measured", "policy": best["policy"], "accuracy_of_full": best["accuracy_of_full"],
            **interval, "kl": best["kl"], "held_share": best["held_share"], "verdict": mark, "agrees": agrees,
            "cell": text + (f" | seed: {seed} → {agrees}" if seed else "")}


def seed_cells(table: pd.DataFrame) -> pd.DataFrame:
    """Every (family, budget, workload) cell of the seed's table from arena rows, with its numbers (see
    ``CELL_COLUMNS``); ``status`` is measured, failed, not run or not measured.

    A family's cell is its best member (most of Full's answers, then lowest KL) at that budget over
    every workload and turn of that mode. A member with any failed row there is left out and named.
    """
    params = {p: json.loads(s) for p, s in table.drop_duplicates("policy")[["policy", "params"]].itertuples(
        index=False)}
    family = table["policy"].map(lambda p: family_of(p, params[p]))
    out = []
    for budget in sorted(table["budget"].unique()):
        at_budget = table[table["budget"] == budget]
        for workload in WORKLOADS:
            rows = at_budget[at_budget["mode"] == workload]
            held = memory_equal(rows).set_index("policy")["held_share"] if len(rows) else pd.Series(dtype=float)
            for fam in FAMILIES:
                seed = fam.seed.get(workload)
                # a budget in MiB may be fractional; tokens stay whole numbers
                cell = {"family": fam.name, "budget": budget.item() if hasattr(budget, "item") else budget,
                        "workload": workload, "seed": seed}
                mine = rows[family.loc[rows.index] == fam.name]
                if workload in NOT_MEASURED and not len(rows):
                    cell |= {"status": "not measured", "verdict": "not measured", "cell": NOT_MEASURED[workload]}
                elif not len(mine):
                    cell |= {"status": "not run", "verdict": "not run",
                             "cell": f"not run ({fam.policies})" if len(rows) else "not run (mode not in this run)"}
                else:
                    full = rows[rows["policy"] == "full"]
                    failed = {p: g["error"].dropna().iloc[0] for p, g in mine.groupby("policy", sort=False)
                              if g["error"].notna().any()}
                    members = [_member_scores(g, full, held) for p, g in mine.groupby("policy", sort=False)
                               if p not in failed]
                    cell |= _measured_cell(members, failed, seed)
                out.append(cell)
    frame = pd.DataFrame(out, columns=CELL_COLUMNS)
    frame["agrees"] = frame["agrees"].fillna("")
    return frame


def seed_table(table: pd.DataFrame) -> pd.DataFrame:
    """The seed's table as people read it: rows family × budget, one column of cell text per workload."""
    cells = seed_cells(table)
    wide = cells.pivot(index=["family", "budget"], columns="workload", values="cell")
    order = {f.name: i for i, f in enumerate(FAMILIES)}
    wide = wide.reset_index().sort_values(["family", "budget"], key=lambda s: s.map(order) if s.name == "family"
                                          else s)
    policies = {f.name: f.policies for f in FAMILIES}
    wide.insert(1, "policies", wide["family"].map(policies))
    return wide[["family", "policies", "budget", *WORKLOADS]].reset_index(drop=True).rename_axis(columns=None)


THRESHOLDS = (f"✓ keeps more than {GOOD:.0%} of Full's correct answers on the same questions, ⚠ between "
              f"{RISKY:.0%} and {GOOD:.0%}, ✗ fewer than {RISKY:.0%} — each only when the whole 95 % Wilson interval "
              f"(in brackets; n = the questions Full answered) lies on that side of the line; {UNSURE} when it "
              "straddles one, too few questions to tell. Each cell is the family's best member at that budget (most "
              "of Full's answers, then lowest mean KL(Full ‖ policy) in nats), over every workload and turn of that "
              "mode; held is KV bytes after each turn over Full's (kivi packed, quest with its page metadata). The "
              "seed rates only multi-turn, for three families; its prose also says importance scoring is good within "
              "one turn — the single-shot column asks later questions after turn 1's compression, which is not that "
              "claim.")
