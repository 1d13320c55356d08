"""A self-contained HTML report of an arena run: summary text, tables and the figures.

plotly.js is embedded once, inline, so the file opens without a network connection.
"""

from __future__ import annotations

import html

import pandas as pd

from kvlab.experiments.html import figures_html, page, table_html
from kvlab.experiments.plan import ArenaSettings
from kvlab.experiments.seed_table import THRESHOLDS, seed_cells, seed_table
from kvlab.experiments.tables import (
    GRID_QUIET,
    accuracy_grid,
    after_turn_one,
    failures,
    fidelity_vs_budget,
    memory_equal,
    memory_equal_shown,
    memory_vs_fidelity,
    mode_drop,
    modes_note,
    one_mode,
    per_turn,
)
from kvlab.viz.arena import (
    fidelity_vs_budget_figure,
    memory_equal_figure,
    memory_vs_fidelity_figure,
    modes_figure,
    per_turn_figure,
    seed_headroom_figure,
    seed_table_figure,
)


def findings(summary: pd.DataFrame) -> list[str]:
    """Plain sentences read off ``fidelity_vs_budget``: best policy per budget, turn 1 vs later turns."""
    out: list[str] = []
    evicting = summary[summary["policy"] != "full"]
    full = summary[summary["policy"] == "full"]
    if len(full) and full["scored"].sum():
        out.append(f"Full (the exact reference) answers {full['accuracy'].mean():.0%} of the scored turns.")
    for budget, rows in evicting.dropna(subset=["kl"]).groupby("budget"):  # a policy that always failed has no KL
        best = rows.sort_values(["kl", "accuracy"], ascending=[True, False]).iloc[0]
        acc = "" if pd.isna(best["accuracy"]) else f", accuracy {best['accuracy']:.0%}"
        out.append(f"Budget {budget}: closest to Full is {best['policy']} (mean KL {best['kl']:.3f}{acc}).")
    return out + [f"{line[0].upper()}{line[1:]}." for line in after_turn_one(summary)]


def arena_report(table: pd.DataFrame, settings: ArenaSettings, model: str, workloads: list[str],
                 cancelled: bool = False) -> str:
    """The whole report as one HTML string."""
    esc = html.escape
    head = (f"<h1>kvlab policy arena — {esc(model)}</h1>"
            f"<p>Workloads: {esc(', '.join(workloads))}. Policies: {esc(', '.join(settings.policies))}. "
            f"Budgets ({esc(settings.budget_label)}): {esc(', '.join(map(str, settings.budgets)))}. "
            f"Max new tokens {settings.max_new_tokens}, positions {esc(settings.position_mode)}, "
            f"block size {settings.block_size}, modes {esc(', '.join(settings.modes))}"
            + (f", first {settings.max_turns} turns" if settings.max_turns else "") + ".</p>")
    if cancelled:
        head += "<p><b>The run was cancelled; the tables hold the turns that finished.</b></p>"
    if table.empty:
        return page(head + "<p>No turn finished, so there is nothing to report.</p>", "kvlab arena report")
    rows, drop = one_mode(table), mode_drop(table)
    pt, summary, memory = per_turn(rows), fidelity_vs_budget(rows), memory_vs_fidelity(rows)
    equal = memory_equal(rows)
    failed = failures(table)
    notes = "".join(f"<li>{esc(s)}</li>" for s in [*findings(summary), settings.budget_blind_note()] if s)
    if len(failed):
        notes += (f"<li><b>{len(failed)} policy run(s) failed</b> (see the table below); the turns they failed on "
                  "have no score, and the means skip them.</li>")
    figures = [per_turn_figure(pt, "accuracy"), per_turn_figure(pt, "kl"),
               fidelity_vs_budget_figure(summary, settings.budget_label), memory_vs_fidelity_figure(memory),
               memory_equal_figure(equal)]
    if len(drop):
        figures += [modes_figure(drop, "accuracy"), modes_figure(drop, "kl")]
    cells = seed_cells(table)
    seed_plot = figures_html([seed_table_figure(cells, settings.unit_name),
                              seed_headroom_figure(cells, settings.unit_name)], plotly_js=False)
    plots = figures_html(figures)
    body = (
        head + f"<h2>Summary</h2><ul>{notes}</ul>"
        "<p class='note'>KL and top-1 are measured while every policy is fed the same golden reply "
        "(teacher forcing) against Full; accuracy checks the answer in each policy's own greedy reply. "
        "Compression is kept tokens / tokens in the conversation after the turn. Intervals are 95 %: Wilson for an "
        "accuracy (n = the questions scored), a seeded bootstrap for a mean KL; a difference inside them is not a "
        "finding.</p>"
        + (table_html(failed.drop(columns=["alone", "text"]), "Failed policies: the turns each has no score on and "
                      "its error (a multi-turn failure drops the policy from then on; a single-shot question fails "
                      "alone)")
           if len(failed) else "")
        + table_html(accuracy_grid(rows), f"Accuracy per turn per policy and budget (mean over workloads, "
                     f"{rows['mode'].iloc[0]})", quiet=("error", "past_context", *GRID_QUIET))
        + (f"<p><b>{esc(note)}</b></p>" if (note := modes_note(drop)) else "")
        + (table_html(drop, "Single-shot vs multi-turn per turn: drop = single-shot accuracy − multi-turn accuracy, "
                      "kl_rise = multi-turn KL − single-shot KL (single-shot: each later question asked against "
                      "turn 1's compressed context alone; turns 1–2 are equal in both modes by construction)")
           if len(drop) else "")
        + table_html(summary, "Fidelity vs budget")
        + table_html(memory, "Memory vs fidelity")
        + table_html(memory_equal_shown(equal, settings.budget_unit),
                     "Memory-equal: the token budget each policy ran with, measured KV bytes held and bytes read per "
                     "generated token, as shares of Full's (kivi: packed storage; quest: page metadata counted, reads "
                     "= every page's min/max plus the share of keys and values read; others read all they hold)")
        + plots
        + "<h2>The seed's table, measured</h2>"
        + f"<p class='note'>{esc(THRESHOLDS)}</p>" + seed_plot
        + table_html(seed_table(table), "Families × workloads: measured mark, share of Full's answers, KL and "
                     "memory held, next to the seed's verdict")
        + table_html(table.drop(columns=["reply"]), "Every turn and policy")
    )
    return page(body, "kvlab arena report")
