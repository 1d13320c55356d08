"""The arena's summary tables: accuracy, fidelity and memory per policy and budget, from the runner's rows.

Pure functions of a results table (``kvlab.experiments.runner.COLUMNS``), so pages, the CLI, the report
and the seed table read the same numbers.
"""

from __future__ import annotations

import pandas as pd

from kvlab.experiments.plan import MODES, ArenaSettings
from kvlab.export import records
from kvlab.saved import Stamp, now
from kvlab.stats import bootstrap_mean, wilson
from kvlab.workloads.chat.conversation import Conversation, conversation_to_json
from kvlab.workloads.chat.records import budget_marks, over_budget

INTERVALS = ["accuracy_low", "accuracy_high", "kl_low", "kl_high"]


def with_intervals(summary: pd.DataFrame, t: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """``summary`` (one row per group of ``keys``) with each group's 95 % intervals: accuracy's Wilson interval over
    its scored questions (``scored`` is that n) and the mean KL's bootstrap interval over its scored rows (seed 0,
    so a table is the same every time it is built). ``t`` holds the rows, with ``hit`` (1, 0 or NaN: unscored)."""
    out = []
    for key, g in t.groupby(keys, sort=False):
        hits = g["hit"].dropna()
        acc, kl = wilson(int(hits.sum()), len(hits)), bootstrap_mean(g["kl"])
        out.append([*key, acc.low, acc.high, kl.low, kl.high])
    return summary.merge(pd.DataFrame(out, columns=[*keys, *INTERVALS]), on=keys, how="left")



def per_turn(table: pd.DataFrame) -> pd.DataFrame:
    """Accuracy and fidelity per policy, budget and turn, averaged over workloads, with 95 % intervals.

    accuracy is over the turns with an answer to check (NaN where none had one; ``scored`` counts them) with its
    Wilson interval; kl with its bootstrap interval (``with_intervals``). Means skip the rows of failed policies
    (no score); ``failed`` counts them.
    """
    t = table.assign(hit=table["correct"].where(table["scored"]).astype(float))
    keys = ["policy", "budget", "turn"]
    out = (t.groupby(keys, sort=False)
           .agg(accuracy=("hit", "mean"), scored=("scored", "sum"), kl=("kl", "mean"), top1=("top1", "mean"),
                workloads=("workload", "nunique"), failed=("error", "count"))
           .reset_index())
    return with_intervals(out, t, keys)


def fidelity_vs_budget(table: pd.DataFrame) -> pd.DataFrame:
    """Per policy and budget over every turn: accuracy and KL with 95 % intervals (``with_intervals``), top-1
    agreement and first vs later turns.

    Means skip the rows of failed policies (no score); ``failed`` counts them.
    """
    t = table.assign(hit=table["correct"].where(table["scored"]).astype(float))
    first, later = t[t["turn"] == 1], t[t["turn"] > 1]
    keys = ["policy", "budget"]
    out = (t.groupby(keys, sort=False)
           .agg(accuracy=("hit", "mean"), scored=("scored", "sum"), kl=("kl", "mean"), top1=("top1", "mean"),
                failed=("error", "count"))
           .reset_index())
    out = with_intervals(out, t, keys)
    out = out.merge(first.groupby(keys)["hit"].mean().rename("accuracy_turn1").reset_index(), on=keys, how="left")
    out = out.merge(later.groupby(keys)["hit"].mean().rename("accuracy_later").reset_index(), on=keys, how="left")
    return out


def after_turn_one(summary: pd.DataFrame) -> list[str]:
    """SCBench's question in words, from ``fidelity_vs_budget``: per policy and budget, turn 1 vs later accuracy.

    Only rows where both turn 1 and later turns were scored, and accuracy moved, are told.
    """
    lines = []
    both = summary.dropna(subset=["accuracy_turn1", "accuracy_later"])
    for row in both[both["policy"] != "full"].itertuples():
        change = row.accuracy_later - row.accuracy_turn1
        if change:
            verb = "falls" if change < 0 else "rises"
            lines.append(f"{row.policy} at {row.budget}: {verb} from {row.accuracy_turn1:.0%} on turn 1 to "
                         f"{row.accuracy_later:.0%} after")
    return lines


def memory_vs_fidelity(table: pd.DataFrame) -> pd.DataFrame:
    """Per policy and budget: memory held next to KL and accuracy.

    kv_kib counts the kept tokens densely; paged_kib is what a paged allocator (vLLM-style blocks)
    still reserves without compaction: every block that holds at least one kept token. extra_prefill_tokens
    and extra_prefill_s are the mean per turn of a pass the policy runs on top of the prefills (KVzip's
    reconstruction; 0 for the others). Means skip the rows of failed policies; ``failed`` counts them.
    """
    t = table.assign(hit=table["correct"].where(table["scored"]).astype(float),
                     fragmented_share=table["fragmented_blocks"] / table["n_blocks"],
                     own_s=table["own_s"].where(table["error"].isna()),  # a dropped policy's 0 s is not speed
                     shared_s=table["shared_s"].where(table["error"].isna()))
    return (t.groupby(["policy", "budget"], sort=False)
            .agg(kv_kib=("kv_kib", "mean"), paged_kib=("bytes_reserved", lambda s: s.mean() / 1024),
                 kept_tokens=("kept_tokens", "mean"), compression=("compression", "mean"),
                 fragmented_share=("fragmented_share", "mean"),
                 compaction_copy_kib=("bytes_compaction_copy", lambda s: s.mean() / 1024),
                 kl=("kl", "mean"), top1=("top1", "mean"), accuracy=("hit", "mean"), own_s=("own_s", "mean"),
                 shared_s=("shared_s", "mean"),
                 extra_prefill_tokens=("extra_prefill_tokens", "mean"), extra_prefill_s=("extra_prefill_s", "mean"),
                 failed=("error", "count"))
            .reset_index())


def memory_equal(table: pd.DataFrame) -> pd.DataFrame:
    """Per policy and budget: KV bytes held and bytes read per generated token, as shares of Full's, with
    accuracy and KL — so eviction, quantization and sparse reading stand on one memory axis.

    Measured, not set: held is ``kv_bytes`` after each turn (kivi: packed integers, scales and zero
    points; quest: every key plus its page metadata) over Full's on the same workload, budget, mode and
    turn; ``budget_tokens`` is the token budget the policy ran with (a byte budget gives each its own; a % of
    Full's bytes grows with the conversation: the largest it reached; none where no budget shapes it). Read
    is what one decoding query reads (quest: every page's min and max, then its share of the
    keys and values; every other policy reads all it holds). Means skip failed rows.

    Beside the budget, what it allows (``budget_kib``, the largest on any turn), the K/V the policy held (``held_kib``,
    the mean over turns) and the most it held on any turn (``held_kib_max``); ``held_vs_budget`` says "within" when
    no turn held more than that turn's budget allowed, else "over its budget" (PyramidKV's integer floors keep a
    little more than a token budget; a % budget too small for a policy's minimum leaves it its minimum), "no budget
    bounds it" (Full, Quest and KIVI without eviction keep every token, DuoAttention's retrieval heads every key)
    or "not recorded" (rows saved before the column existed).
    """
    keys = ["workload", "budget", "mode", "turn"]
    if "budget_tokens" not in table:  # rows written before byte budgets: every budget was in tokens
        table = table.assign(budget_tokens=table["budget"])
    recorded = "budget_kib" in table
    if not recorded:
        table = table.assign(budget_kib=float("nan"))
    full = table[table["policy"] == "full"].set_index(keys)["kv_bytes"].rename("full_bytes")
    t = table.join(full, on=keys)
    t = t.assign(hit=t["correct"].where(t["scored"]).astype(float), held_share=t["kv_bytes"] / t["full_bytes"],
                 read_share_of_full=t["kv_bytes_read"] / t["full_bytes"], read_kib=t["kv_bytes_read"] / 1024,
                 over=over_budget(t), excess=t["kv_kib"] - t["budget_kib"].astype(float))
    out = (t.groupby(["policy", "budget"], sort=False)
           .agg(budget_tokens=("budget_tokens", "max"), budget_kib=("budget_kib", "max"), over=("over", "any"),
                held_kib_max=("kv_kib", "max"), held_share=("held_share", "mean"),
                read_share_of_full=("read_share_of_full", "mean"),
                held_kib=("kv_kib", "mean"), read_kib=("read_kib", "mean"), accuracy=("hit", "mean"),
                kl=("kl", "mean"), failed=("error", "count"))
           .reset_index())
    held = budget_marks(out.pop("over"), out["budget_kib"], out["held_kib_max"])
    over = t[t["over"]]
    # the turn that went furthest over: the budget column is the largest any turn allowed, not that turn's
    worst = over.loc[over.groupby(["policy", "budget"], sort=False)["excess"].idxmax()]
    said = {(w.policy, w.budget): f"over its budget on turn {w.turn} of {w.workload} ({w.mode}): "
            f"{w.kv_kib:.1f} KiB held, {float(w.budget_kib):.1f} allowed" for w in worst.itertuples()}
    held = [said.get((p, b), h) for p, b, h in zip(out["policy"], out["budget"], held)]
    out.insert(4, "held_vs_budget", held if recorded else "not recorded")
    return out


def memory_equal_shown(equal: pd.DataFrame, budget_unit: str) -> pd.DataFrame:
    """``memory_equal`` as the page and the report show it: in tokens each policy's token budget is the grid's own
    (or none), so a second column of the same numbers is left out; files keep it."""
    return equal.drop(columns="budget_tokens") if budget_unit == "tokens" else equal


def one_mode(table: pd.DataFrame) -> pd.DataFrame:
    """The rows the per-budget summaries read: multi-turn where the run has it, else single-shot."""
    mode = "multi-turn" if (table["mode"] == "multi-turn").any() else "single-shot"
    return table[table["mode"] == mode]


# Turns 1 and 2 meet the same caches in both modes (turn 2 follows turn 1 alone either way): their rows are equal by
# construction, so only turn 3 on can show what carrying a conversation costs.
FIRST_TURN_MODES_DIFFER = 3


def mode_drop(table: pd.DataFrame) -> pd.DataFrame:
    """Per policy, budget and turn: accuracy and KL multi-turn next to single-shot, and what turns cost.

    drop = single-shot accuracy − multi-turn accuracy on the same question (positive: carrying the
    conversation lost answers); kl_rise = multi-turn KL − single-shot KL; ``modes can differ`` is False on turns
    1 and 2, equal in both modes by construction. Empty unless both modes ran.
    """
    columns = ["policy", "budget", "turn", "modes can differ", "accuracy multi-turn", "accuracy single-shot", "drop",
               "kl multi-turn", "kl single-shot", "kl_rise"]
    if not set(MODES) <= set(table["mode"]):
        return pd.DataFrame(columns=columns)
    keys = ["policy", "budget", "turn"]
    multi, single = (per_turn(table[table["mode"] == m]).set_index(keys)[["accuracy", "kl"]] for m in MODES)
    out = multi.join(single, lsuffix=" multi-turn", rsuffix=" single-shot", how="inner").reset_index()
    out["drop"] = out["accuracy single-shot"] - out["accuracy multi-turn"]
    out["kl_rise"] = out["kl multi-turn"] - out["kl single-shot"]
    out["modes can differ"] = out["turn"] >= FIRST_TURN_MODES_DIFFER
    return out[columns]


def modes_note(drop: pd.DataFrame) -> str | None:
    """Why a ``mode_drop`` table shows no difference, when no turn in it can differ between the modes (None when
    some can)."""
    if drop.empty or drop["modes can differ"].any():
        return None
    return (f"Every workload here stops by turn {FIRST_TURN_MODES_DIFFER - 1}: single-shot equals multi-turn by "
            f"construction (turn 2 follows turn 1 alone in both modes), so drop is 0. Run workloads with "
            f"{FIRST_TURN_MODES_DIFFER} turns or more to measure what carrying the conversation costs.")


def failures(table: pd.DataFrame) -> pd.DataFrame:
    """Every policy that failed, once per workload, budget and way it failed: the first turn it failed on, the turns
    it has no score on (``turns``, text), its error and whether its rows in other modes kept their scores (``alone``),
    with ``failure_text``'s sentence (``text``).

    A multi-turn failure (or one on turn 1, which every mode shares) drops the policy from its session; a single-shot
    question is asked alone of turn 1's caches and rolled back, so a policy failing one is asked the next one again,
    and its multi-turn rows keep their scores.
    """
    cell = ["workload", "budget", "policy"]
    columns = [*cell, "turn", "turns", "error", "alone", "text"]
    failed = table[table["error"].notna()].copy()
    if failed.empty:
        return pd.DataFrame(columns=columns)
    on_turn_1 = failed.groupby(cell)["turn"].transform("min") == 1  # dropped there, from both modes
    failed["alone"] = (failed["mode"] == "single-shot") & (failed["turn"] > 1) & ~on_turn_1
    out = failed.groupby([*cell, "alone"], sort=False).agg(
        turn=("turn", "min"), error=("error", "first"), turns=("turn", lambda t: ", ".join(map(str, sorted(set(t))))),
    ).reset_index()
    out["text"] = [failure_text(r) for r in out.itertuples()]
    return out[columns]


def failure_text(row: tuple, policy: str | None = None) -> str:
    """What a user reads about one ``failures`` row: where the policy failed and what that cost it (the policy named
    as ``policy`` says, e.g. in bold; its name by default)."""
    where = f"{policy or row.policy} failed on {row.workload}, budget {row.budget}"
    if row.alone:
        asked = "question of turn" if "," not in row.turns else "questions of turns"
        return (f"{where}, on the single-shot {asked} {row.turns}; each is asked alone of turn 1's caches, "
                f"so its other rows keep their scores: {row.error}")
    turn = f"turn {row.turn}" if row.turn == 1 else f"multi-turn turn {row.turn}"  # turn 1 serves every mode
    return f"{where}, {turn} and was dropped (no score from then on): {row.error}"


def interval_text(low: float, high: float, digits: int = 2) -> str | None:
    """'[0.41, 0.93]'; None where there is no interval (nothing scored: a missing value, never a number)."""
    return None if pd.isna(low) else f"[{low:.{digits}f}, {high:.{digits}f}]"


GRID_QUIET = ("kl 95 %",)  # a KL interval needs two turns in a cell; shown without one anywhere, it reads as broken


def accuracy_grid(table: pd.DataFrame) -> pd.DataFrame:
    """The closing table: rows policy × budget, one accuracy column per turn, and the overall figure with its n
    (questions scored) and 95 % intervals (Wilson for accuracy, bootstrap for the mean KL)."""
    pt = per_turn(table)
    wide = pt.pivot_table(index=["policy", "budget"], columns="turn", values="accuracy", sort=False,
                          dropna=False).astype(float)
    wide.columns = [f"turn {c}" for c in wide.columns]
    overall = fidelity_vs_budget(table).set_index(["policy", "budget"])
    return wide.join(pd.DataFrame({
        "all turns": overall["accuracy"], "n": overall["scored"].astype("Int64").where(overall["scored"] > 0),
        "all turns 95 %": [interval_text(lo, hi) for lo, hi in zip(overall["accuracy_low"], overall["accuracy_high"])],
        "kl": overall["kl"], "kl 95 %": [interval_text(lo, hi, 3) for lo, hi in zip(overall["kl_low"],
                                                                                    overall["kl_high"])],
        "top1": overall["top1"]}, index=overall.index)).reset_index()


def results_json(table: pd.DataFrame, settings: ArenaSettings, model: str, workloads: list[str],
                 cancelled: bool = False, made: Stamp | None = None,
                 conversations: list[Conversation] | None = None) -> dict:
    """Everything a run produced, as plain JSON, stamped ``made`` (a file opened and saved again keeps its
    stamp) or now; with the ``conversations`` it ran (as fitted to the model), so that it can be replayed."""
    return {
        **(made or now(model)).as_dict(), "kvlab_arena": 1, "model": model, "workloads": workloads,
        "conversations": [conversation_to_json(c) for c in conversations or []],
        "settings": settings.to_dict(), "cancelled": cancelled, "rows": records(table),
        "accuracy_grid": records(accuracy_grid(one_mode(table))) if len(table) else [],
        "mode_drop": records(mode_drop(table)) if len(table) else [],
        "memory_equal": records(memory_equal(one_mode(table))) if len(table) else [],
    }
