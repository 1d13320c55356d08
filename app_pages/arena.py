"""Page 4: the policy arena — workloads over policies × budgets, run in the background."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import streamlit as st

from kvlab.errors import KvlabError
from kvlab.experiments.arena_record import SavedArena, arena_from_json, replay_differences
from kvlab.experiments.job import ArenaJob
from kvlab.experiments.plan import MODES, ArenaSettings, ModelSpec, RayPlan, parse_budgets
from kvlab.experiments.report import arena_report
from kvlab.experiments.runner import cells_not_run, check_grid, grid_short_replies
from kvlab.experiments.seed_table import THRESHOLDS, WORKLOADS, seed_cells, seed_table
from kvlab.experiments.tables import (
    GRID_QUIET,
    accuracy_grid,
    after_turn_one,
    failure_text,
    failures,
    fidelity_vs_budget,
    memory_equal,
    memory_equal_shown,
    memory_vs_fidelity,
    mode_drop,
    modes_note,
    one_mode,
    per_turn,
    results_json,
)
from kvlab.export import table_csv, to_json
from kvlab.files import MB
from kvlab.paths import CONVERSATIONS_DIR, RETRIEVAL_DIR
from kvlab.policies import DEFAULT_COMPARISON, POLICIES
from kvlab.policies.memory import MIB
from kvlab.policies.oracle import NOT_DEPLOYABLE
from kvlab.policies.plugins import refuse_on_workers
from kvlab.saved import ReplayCheck, read_json
from kvlab.viz.arena import (
    fidelity_vs_budget_figure,
    memory_equal_figure,
    memory_vs_fidelity_figure,
    modes_figure,
    per_turn_figure,
    seed_headroom_figure,
    seed_table_figure,
)
from kvlab.workloads.chat.budgets import BUDGET_UNITS, PERCENT_HELP
from kvlab.workloads.chat.conversation import Conversation, list_workloads, load_conversation
from kvlab.workloads.chat.files import MAX_SCBENCH_BYTES, workloads_from_bytes
from kvlab.workloads.chat.replay import session_conversation
from kvlab.workloads.chat.ruler import TASKS as RULER_TASKS
from kvlab.workloads.chat.ruler import generate as generate_ruler
from kvlab.workloads.chat.ruler import one_question
from kvlab.workloads.chat.scbench import fit_to_context
from ui.common import new_upload, page_start, say_replay
from ui.figures import download_all_figures
from ui.jobs import job_panel
from ui.params import FIELD_WIDTH, param_widgets
from ui.plugins import PLUGIN_HELP, policy_option
from ui.tables import RESULT_HEADERS, compact_table


def show(df: pd.DataFrame, unit: str) -> None:
    """A summary table, numbers short and columns headed in words, the budget's with its ``unit`` (the downloads
    keep their names); the KL interval is left out where no cell has one (each holds one turn)."""
    data, config = compact_table(df, RESULT_HEADERS | {"budget": f"budget ({unit})"}, pinned="policy",
                                 quiet=GRID_QUIET)
    st.dataframe(data, hide_index=True, width="stretch", placeholder="—", column_config=config)


lm = page_start(
    "Policy arena",
    "Run workloads over several policies and budgets. Each (workload, budget) is one multi-turn session with "
    "every policy side by side; caches carry over between turns (SCBench multi-turn), and in single-shot mode each "
    "later question is asked against turn 1's compressed context alone. Accuracy checks each "
    "policy's own answer; KL and top-1 compare its next-token distributions with Full's on the same tokens.",
)

RUN_ON = ["this process", "local Ray workers", "a Ray cluster"]

state = st.session_state
job: ArenaJob | None = state.get("arena_job")
running = job is not None and job.running


def current_chat() -> Conversation | None:
    """The chat page's conversation, if it has a turn."""
    chat = state.get("chat")
    return None if chat is None else session_conversation(chat)


def chosen_workloads(files: list[Path], upload, use_chat: bool, max_new: int,
                     generated: list[Conversation]) -> list[Conversation]:
    """The picked files, the upload (every session of an SCBench file, cut to fit the model), the current
    chat and the generated RULER tasks as conversations (KvlabError on bad input)."""
    convs = [load_conversation(p) for p in files]
    if upload is not None:
        convs += [fit_to_context(c, lm, max_new) for c in workloads_from_bytes(upload.getvalue(), upload.name)]
    if use_chat:
        chat = current_chat()
        if chat is None:
            raise KvlabError("there is no conversation on the chat page yet")
        convs.append(chat)
    convs += generated
    if not convs:
        raise KvlabError("choose at least one workload")
    return convs


def drawn_from(job: ArenaJob) -> tuple:
    """What the results below are drawn from, for a job's run: its rows, settings, workload names, whether it was
    cancelled, the model it ran on and its conversations."""
    return job.table, job.settings, job.workload_names, job.cancelled, job.lm.facts.name, job.conversations


def ray_run(where: str, workers: int, address: str, policies: tuple[str, ...]) -> dict:
    """ArenaJob's ``plan`` and ``source`` for a run on Ray: its workers load the sidebar's model themselves."""
    if where == RUN_ON[0]:
        return {}
    refuse_on_workers(policies)
    plan = RayPlan(workers=workers) if where == RUN_ON[1] else RayPlan(workers=workers or None, address=address)
    source = ModelSpec(lm.facts.name, device=state.get("model_device", "auto"),
                       dtype=state.get("model_dtype", "auto"), trust_remote_code=state.get("model_trust", False))
    return {"plan": plan, "source": source}


with st.expander("Grid", expanded=job is None):
    files = list_workloads(RETRIEVAL_DIR) + list_workloads(CONVERSATIONS_DIR)
    c1, c2 = st.columns([3, 2])
    picked = c1.multiselect("Workloads", files, default=files[:1], persist_state="session", key="arena_files",
                            format_func=lambda p: f"{p.parent.name}/{p.stem}")
    upload = c2.file_uploader("…and/or upload a workload (kvlab JSON or JSONL, SCBench JSONL or parquet)",
                              type=["json", "jsonl", "parquet"], key="arena_upload",
                              max_upload_size=MAX_SCBENCH_BYTES // MB)
    # under the workloads: beside them, in two fifths of a 900 px window's page, it would read "Add the current …"
    if current_chat() is None:  # a tick kept from a chat since cleared would stay on, greyed out, and fail the run
        st.session_state.arena_use_chat = False
    use_chat = c1.checkbox("Add the current chat",
                           persist_state="session", key="arena_use_chat", disabled=current_chat() is None,
                           help="Runs the chat page's conversation, its replies kept as the history.")
    r1, r2, r3 = st.columns([3, 1.2, 0.8])
    ruler_tasks = r1.multiselect("…and/or RULER tasks, generated here (kvlab tasks ruler)", list(RULER_TASKS),
                                 persist_state="session", key="arena_ruler_tasks")
    # no min/max: Streamlit would quietly keep the last valid value; the generator refuses a bad one in words
    ruler_length = r2.number_input("RULER length (tokens)", value=min(1024, lm.facts.context_length), step=256,
                                   persist_state="session", key="arena_ruler_length",
                                   help="As RULER counts it: the prompt with every question and its answer prefix, "
                                        "plus the tokens the task may generate (niah 128, vt 30, cwe 120, fwe 50), "
                                        "so a session's own tokens are fewer. A length is a ceiling: each sample is "
                                        "as long as its haystack can be within it.")
    ruler_samples = r3.number_input("Samples", value=2, persist_state="session", key="arena_ruler_samples")
    # fields of a fixed width that wrap as a whole: columns split any width, breaking labels mid-word at 900 px
    with st.container(horizontal=True, vertical_alignment="bottom"):
        ruler_seed = st.number_input("Seed", value=0,
                                     persist_state="session", key="arena_ruler_seed", width=FIELD_WIDTH)
        ruler_questions = st.number_input("Questions", value=0,
                                          persist_state="session", key="arena_ruler_questions", width=FIELD_WIDTH,
                                          help="Queries per sample (niah: keys asked; vt: chains tracked, with the "
                                               "multi-turn variant only; cwe and fwe ask one); 0: the task's own.")
        ruler_multi = st.checkbox("Multi-turn variant", persist_state="session", key="arena_ruler_multi",
                                  help="One context, one query per turn (SCBench-style): as many turns as the sample "
                                       "has queries (Questions). cwe and fwe ask one question: they run as RULER's "
                                       "one-turn task beside the others, and the page says so.")
    # the whole width: in three fifths of a 900 px window's page it would show two of the four policies chosen
    policies = st.multiselect("Policies (Full always runs as the reference)", [p for p in POLICIES if p != "full"],
                              default=list(DEFAULT_COMPARISON[1:]),
                              persist_state="session", key="arena_policies", format_func=policy_option,
                              help=PLUGIN_HELP)
    if "oracle" in policies:
        st.caption(f"**oracle**: {NOT_DEPLOYABLE}. Its dashed line in the chart is the headroom any eviction "
                   "policy at that budget could still gain.")
    c3, c4 = st.columns([3, 2])
    unit = c3.radio("Budget unit", list(BUDGET_UNITS),
                    persist_state="session", key="arena_budget_unit", horizontal=True,
                    format_func=BUDGET_UNITS.label,
                    help="tokens: every policy keeps that many per layer and KV head. MiB: the K/V the cache may "
                         "hold; each policy keeps the most tokens whose worst case fits, so a 4-bit KIVI cache "
                         "keeps several times the tokens of a full-precision one at the same memory, once its "
                         "full-precision residual (128 tokens by default) fits. " + PERCENT_HELP)
    budgets_text = c4.text_input("Budgets, comma-separated", "64,128,256,512",
                                 persist_state="session", key="arena_budgets",
                                 help="In the unit above: tokens per layer per KV head, MiB of K/V held at most "
                                      f"({lm.facts.name} holds {lm.facts.kv_bytes(512) / MIB:.1f} MiB at 512 "
                                      "tokens, unquantized), or % of Full's K/V bytes (e.g. 12.5,25,50).")
    c5, c6, c7, c8 = st.columns(4)
    # unbounded here, checked by ArenaSettings at Run: a bounded field keeps its last valid value quietly
    max_new = c5.number_input("Reply tokens per turn", value=8, persist_state="session", key="arena_max_new")
    max_turns = c6.number_input("Turns per workload (0 = all)", value=0, persist_state="session", key="arena_max_turns")
    block_size = c7.number_input("Block size", value=16, persist_state="session", key="arena_block")
    mode = c8.radio("Positions", ["original", "rerotated"], persist_state="session", key="arena_mode", horizontal=True)
    modes = st.multiselect(
        "Modes", list(MODES), default=["multi-turn"], persist_state="session", key="arena_modes",
        help="multi-turn: answers stay and caches carry over (SCBench multi-turn). single-shot: turn 1 is the "
             "shared context, compressed once; every later question is asked against the caches as turn 1 left "
             "them, its answer not kept (SCBench multi-request, kvpress). Turn 1 runs once for both modes.")
    st.caption("Policy parameters (defaults follow each policy's reference code; hover for the variants)")
    params = param_widgets(policies, "arena")
    c9, c10 = st.columns([3, 2])  # the three choices on one line
    where = c9.radio("Run on", RUN_ON, persist_state="session", key="arena_run_on", horizontal=True,
                     help="Ray workers each load the model once and run whole (workload, budget) cells; "
                          "the results are the same as in this process.")
    n_workers, address = 0, ""
    if where == RUN_ON[1]:
        n_workers = c10.number_input("Local workers (one torch thread each; one GPU each where there are GPUs)",
                                     min_value=2, max_value=max(2, os.cpu_count() or 2), value=2,
                                     persist_state="session", key="arena_workers")
    elif where == RUN_ON[2]:
        address = c10.text_input("Ray cluster address",
                                 persist_state="session", key="arena_ray_address", placeholder="10.0.0.5:6379")
        n_workers = c10.number_input("Workers (0 = one per GPU of the cluster, else one per CPU)", min_value=0,
                                     max_value=64, value=0, persist_state="session", key="arena_cluster_workers")

    if st.button("Run the grid", type="primary", key="arena_run", disabled=running):
        try:
            if max_turns < 0:  # the field's 0 means all, so ArenaSettings' own "at least 1" would mislead
                raise KvlabError(f"turns per workload must be 0 (all) or more, not {int(max_turns)}")
            settings = ArenaSettings(policies=tuple(policies), budgets=parse_budgets(budgets_text, unit),
                                     budget_unit=unit,
                                     max_new_tokens=int(max_new), max_turns=int(max_turns) or None,
                                     block_size=int(block_size), position_mode=mode, params=params,
                                     modes=tuple(modes))
            single = [t for t in ruler_tasks if ruler_multi and one_question(t)]  # no multi-turn variant to run
            ruler = [s.conversation for task in ruler_tasks
                     for s in generate_ruler(task, int(ruler_length), int(ruler_samples), int(ruler_seed), lm.encode,
                                             multi_turn=ruler_multi and task not in single,
                                             questions=None if task in single else int(ruler_questions) or None)]
            convs = chosen_workloads(picked, upload, use_chat, int(max_new), ruler)
            check_grid(lm, convs, settings)  # refused in words here, before a job starts
            state.arena_notices = [c.notice for c in convs if c.notice] + [
                f"{', '.join(single)} ask{'s' * (len(single) == 1)} one question, so "
                f"{'it runs' if len(single) == 1 else 'they run'} as RULER's one-turn task"
                + (" beside the multi-turn variants." if len(single) < len(ruler_tasks) else ".")] * bool(single)
            state.arena_short = grid_short_replies(lm, convs, settings)
            if job is not None and job.table is not None and not job.table.empty:
                state.arena_last = job  # drawn again if the new run ends without a finished turn
            state.arena_job = ArenaJob(lm, convs, settings, **ray_run(where, int(n_workers), address,
                                                                        settings.policies)).start()
            state.arena_view = state.arena_replay = None  # the new run's results replace a run opened from a file
        except KvlabError as exc:
            st.error(str(exc))
        else:
            st.rerun()  # redraw with the Run button disabled and the progress panel ticking

for notice in state.get("arena_notices", []):  # what fitting a workload to the model changed (SCBench's cut)
    st.info(notice)
if state.get("arena_short"):
    st.warning(state.arena_short)


with st.popover("Open a saved run", disabled=running):
    raw = new_upload("A downloaded arena run (JSON): every table and chart drawn from the file at once, no model run",
                     "arena_open")
    if raw is not None:
        try:
            state.arena_view, state.arena_replay = arena_from_json(read_json(raw, "arena run")), None
            state.arena_notices, state.arena_short = [], None  # the last run's, not the file's
            st.rerun()
        except KvlabError as exc:
            st.error(str(exc))

job_panel("arena", lambda j: f"{j.done}/{j.total} turns · {j.label}",
          "Cancelling: the turn in progress stops at its next decode step and is dropped…")

view: SavedArena | None = None if running else state.get("arena_view")
if view is None and (job is None or job.running):
    st.stop()

if view is not None:  # the file's rows stand for a finished job's
    st.info(f"**Opened from a file, no model run**: every table and chart below is the file's record "
            f"({view.stamp.label()}, workloads {', '.join(view.workloads) or 'unknown'}). **Run the grid** "
            "measures afresh on the model in the sidebar.")
    table, settings, names, cancelled = view.table, view.settings, view.workloads, view.cancelled
    model, conversations = view.stamp.model, view.conversations
    if view.unreplayable:
        st.caption(f"This file cannot be replayed: {view.unreplayable}.")
    elif st.button(f"Replay: run this file's grid again on {lm.facts.name} and check every row",
                   key="arena_replay_button"):
        state.arena_replay, state.arena_view = view, None
        state.arena_job = ArenaJob(lm, view.conversations, view.settings).start()
        st.rerun()
else:
    if job.error:
        st.error(f"The run stopped: {job.error}")
    table, settings, names, cancelled, model, conversations = drawn_from(job)
    if (replayed := state.get("arena_replay")) is not None and not job.cancelled and table is not None:
        say_replay(ReplayCheck(replay_differences(replayed.table, table), "every row", replayed.stamp, model))
if view is None and (table is None or table.empty):
    said = (f"Cancelled after 0 of {job.total} turn{'s' * (job.total != 1)}: no turn finished" if job.cancelled
            else "No turn finished")
    if (last := state.get("arena_last")) is None:
        (st.warning if job.cancelled else st.info)(f"{said}, so there are no results.")
        st.stop()
    st.warning(f"{said}, so this run has no results; below are the results of the run before it.")
    job = last
    table, settings, names, cancelled, model, conversations = drawn_from(job)
if view is None and job.cancelled:
    st.warning(f"Cancelled after {job.done} of {job.total} turn{'s' * (job.total != 1)}; the results below hold the "
               f"finished turns ({cells_not_run(table, job.conversations, job.settings)} workload × budget cells did "
               "not run).")

if view is None:
    cells = len(job.settings.budgets) * len(job.settings.modes)
    n_policies = len(job.settings.policies)
    ran = [name for name in job.workload_names if name in set(table["workload"])]  # a cancelled run: fewer
    st.success(f"{job.done} turn{'s' * (job.done != 1)} × {n_policies} polic{'ies' if n_policies != 1 else 'y'} in "
               f"{job.elapsed_s:.0f} s: the turns of "
               f"{', '.join(ran)} at {cells} budget{' and mode' * (len(job.settings.modes) > 1)} "
               f"setting{'s' * (cells != 1)}.")
for row in failures(table).itertuples():  # the grid went on without it
    st.error(failure_text(row, f"**{row.policy}**"))
drop, rows = mode_drop(table), one_mode(table)
scored = bool(table["scored"].any())
grid = accuracy_grid(rows)
# each note under its table: the table's toolbar, shown on hover, covers the line above it
if scored:
    st.subheader(f"Accuracy per turn (mean over workloads, {rows['mode'].iloc[0]})")
    show(grid, settings.unit_name)
    st.caption("n: questions scored per policy and budget; the intervals are 95 % (Wilson for accuracy, a seeded "
               "bootstrap for mean KL, none of one turn): a difference inside them is not a finding.")
else:  # every accuracy column would be empty
    st.subheader(f"Fidelity per policy and budget (mean over workloads, {rows['mode'].iloc[0]})")
    show(grid[["policy", "budget", "kl", "kl 95 %", "top1"]], settings.unit_name)
    st.caption("No turn of these workloads has an answer to check, so there is no accuracy: KL and top-1 compare "
               "each policy's next-token predictions with Full's. The KL interval is 95 % (a seeded bootstrap, none "
               "of one turn): a difference inside it is not a finding.")

pt, summary, memory = per_turn(rows), fidelity_vs_budget(rows), memory_vs_fidelity(rows)
if moves := after_turn_one(summary):
    st.caption("After turn 1 (SCBench asks whether query-aware eviction falls): " + "; ".join(moves) + ".")
if len(drop):
    st.subheader("Single-shot vs multi-turn")
    st.caption("The same questions on the same budget: single-shot asks each against the compressed context "
               "alone, multi-turn after every earlier turn. drop = single-shot accuracy − multi-turn accuracy "
               "(positive: carrying the conversation lost answers); KL rise = multi-turn KL − single-shot KL. "
               "The summaries below read the multi-turn rows.")
    if note := modes_note(drop):
        st.warning(note)
    st.plotly_chart(modes_figure(drop, "accuracy" if scored else "kl"), width="stretch")
    show(drop, settings.unit_name)
tab_turn, tab_budget, tab_memory, tab_equal, tab_rows = st.tabs(
    ["Per turn", "Fidelity vs budget", "Memory vs fidelity", "Memory-equal", "All rows"])
with tab_turn:
    metric = st.radio("Metric", ["accuracy", "kl", "top1"], index=0 if scored else 1, horizontal=True,
                      persist_state="session", key="arena_metric")
    st.plotly_chart(per_turn_figure(pt, metric), width="stretch")
with tab_budget:
    if note := settings.budget_blind_note():
        st.caption(note)
    st.plotly_chart(fidelity_vs_budget_figure(summary, settings.budget_label), width="stretch")
    show(summary, settings.unit_name)
with tab_memory:
    st.plotly_chart(memory_vs_fidelity_figure(memory), width="stretch")
    show(memory, settings.unit_name)
    st.caption("Times per turn: **own s** is work only that policy ran (its eviction and any pass of its own: "
               "KVzip's reconstruction, the oracle's run of Full); **shared s** is its even share of the forwards "
               "run for every cache at once, the same for all policies of a batch, so not a comparison of cost.")
with tab_equal:
    st.caption("The memory axis is measured, not set: bytes held after each turn (kivi: packed integers, scales "
               "and zero points; quest: every key plus a min and a max key per page) and bytes a decoding query "
               "reads (quest: every page's min and max, then the share of keys and values it read; the others "
               "read all they hold), each over Full's on the same turn. The points are the budgets (and kivi "
               "bits) you ran; kivi with evict_with=full keeps every token at any budget. **held KiB** is the K/V "
               "a policy held (mean over turns), **most held KiB** the most on any turn, next to what its budget "
               "allowed (**budget allows KiB**: a % of Full's bytes grows with the conversation, the largest is "
               "shown); **held vs budget** marks a turn held over its budget (PyramidKV's floors, a % too small for a "
               "policy's minimum) and a policy no budget bounds.")
    equal = memory_equal(rows)
    st.plotly_chart(memory_equal_figure(equal), width="stretch")
    show(memory_equal_shown(equal, settings.budget_unit), settings.unit_name)  # Full's budget, an unscored row
with tab_rows:
    st.dataframe(table, hide_index=True, width="stretch", placeholder="—")

st.subheader("The seed's table, measured")
st.caption("The notes kvlab grew from rate each family per workload with ✓ / ⚠ / ✗; here the marks come from this "
           f"run. {THRESHOLDS} RAG and code edits are not part of an arena run, so their columns say so.")
cells = seed_cells(table)
st.plotly_chart(seed_table_figure(cells, settings.unit_name), width="stretch", key="arena_seed_fig")
st.plotly_chart(seed_headroom_figure(cells, settings.unit_name), width="stretch", key="arena_headroom_fig")
# its cells are sentences: rows three lines high, so they wrap rather than stop at the column's edge
st.dataframe(seed_table(table), hide_index=True, width="stretch", row_height=72,
             column_config={"family": st.column_config.TextColumn(pinned=True),
                            **{w: st.column_config.TextColumn(width="large") for w in WORKLOADS}}, placeholder="—")

downloads = st.container(horizontal=True)  # buttons as wide as their labels, wrapping: columns would cut them at 900 px
downloads.download_button("Download CSV", table_csv(table), "kvlab-arena.csv", "text/csv", key="arena_csv",
                          on_click="ignore")
downloads.download_button(
    "Download JSON",
    lambda: to_json(results_json(table, settings, model, names, cancelled, view.stamp if view else None,
                                 conversations)),
    "kvlab-arena.json", "application/json", key="arena_json", on_click="ignore")
downloads.download_button(
    "Download HTML report",
    lambda: arena_report(table, settings, model, names, cancelled),
    "kvlab-arena.html", "text/html", key="arena_html", on_click="ignore")

download_all_figures("arena")
