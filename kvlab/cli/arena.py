"""``python -m kvlab arena``: workloads over policies × budgets; writes results.csv, results.json, report.html.

``--workers N`` runs the grid's cells on N local Ray workers, ``--ray-address`` on an existing Ray cluster
(``kvlab.experiments.workers``); the files are the same as from the in-process run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from kvlab.cli.bars import progress_bar
from kvlab.cli.interrupt import INTERRUPTED, stop_on_interrupt
from kvlab.cli.options import BLOCK_HELP, POSITION_HELP, add_model_options, comma_list, made, out_folder
from kvlab.cli.printing import print_replay, text_table
from kvlab.engine.model import load_model
from kvlab.errors import KvlabError
from kvlab.experiments.arena_record import SavedArena, arena_from_json, replay_differences
from kvlab.experiments.plan import MODES, ArenaSettings, ModelSpec, RayPlan, grid_size, parse_budgets
from kvlab.experiments.report import arena_report
from kvlab.experiments.runner import cells_not_run, check_grid, grid_short_replies, run_arena, turns_ran
from kvlab.experiments.seed_table import THRESHOLDS, seed_table
from kvlab.experiments.tables import GRID_QUIET, accuracy_grid, failures, mode_drop, one_mode, results_json
from kvlab.export import table_csv, to_json, without_quiet
from kvlab.files import read_bytes
from kvlab.policies import DEFAULT_COMPARISON, parse_params
from kvlab.policies.plugins import refuse_on_workers
from kvlab.saved import ReplayCheck, read_json
from kvlab.workloads.chat.budgets import BUDGET_UNITS, PERCENT_HELP
from kvlab.workloads.chat.conversation import Conversation
from kvlab.workloads.chat.files import workloads_of
from kvlab.workloads.chat.scbench import fit_to_context


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("arena", help="run workloads over cache policies × budgets and write a report")
    p.add_argument("--workload", nargs="+", default=[], metavar="FILE",
                   help="conversation JSON file(s), e.g. data/retrieval/*.json; JSONL of them (kvlab tasks); SCBench "
                        "JSONL / parquet (every record a session)")
    p.add_argument("--scbench", metavar="TASK", help="an SCBench task from the hub, e.g. scbench_kv (needs the "
                   "datasets package and a network)")
    p.add_argument("--policies", default=",".join(DEFAULT_COMPARISON), help="comma-separated policy names")
    p.add_argument("--budgets", default="64,128,256,512", help="comma-separated budgets, in --budget-unit")
    p.add_argument("--budget-unit", choices=list(BUDGET_UNITS), default="tokens",
                   help="tokens: kept per layer per KV head, the same for every policy, up to the model's context; "
                        "mib: MiB of K/V the cache may hold, each policy keeping the most tokens whose worst case "
                        "fits (4 bits keep more), up to Full's K/V over the whole context; "
                        + PERCENT_HELP.replace("%", "%%"))
    p.add_argument("--policy-file", action="append", default=[], metavar="FILE",
                   help="a Python file of plug-in policies, repeatable (see README: Writing a plug-in policy)")
    p.add_argument("--param", action="append", default=[], metavar="POLICY.NAME=VALUE",
                   help="a policy parameter, repeatable, e.g. --param snapkv.window=16 --param tova.per_head=true")
    p.add_argument("--max-new-tokens", type=int, default=8, help="greedy reply length per turn")
    p.add_argument("--max-turns", type=int, default=None, help="only the first N turns of each workload")
    p.add_argument("--block-size", type=int, default=16, help=BLOCK_HELP)
    p.add_argument("--modes", default="multi-turn", help=f"comma-separated, of {', '.join(MODES)}: single-shot "
                   "asks each later question against turn 1's compressed context alone, its answer not kept")
    p.add_argument("--position-mode", choices=["original", "rerotated"], default="original", help=POSITION_HELP)
    add_model_options(p, dtype=False)
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="run the cells on N Ray workers started here (one torch thread each on a CPU, one GPU each "
                        "where there are GPUs); 1, the default, runs in this process without Ray")
    p.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="run on the Ray cluster at ADDRESS (e.g. 10.0.0.5:6379) instead of starting Ray here; "
                        "--workers then defaults to one per GPU of the cluster, else one per CPU")
    p.add_argument("--replay", metavar="RESULTS_JSON",
                   help="run a saved arena run again (its conversations and settings; the grid options above are "
                        "ignored) and check that every row but the timings is the same: exit 1 where one differs")
    p.add_argument("--out", default=None, help="output folder (created if missing; needed but for a --replay, which "
                   "writes files only where it is given); Ctrl-C stops at once, drops the turn in progress (with "
                   "Ray: stops the workers), writes the turns that finished and exits 130")
    p.set_defaults(func=run)


RESULTS_CSV, RESULTS_JSON, REPORT, SEEDS = "results.csv", "results.json", "report.html", "seed_table.csv"
ARENA_FILES = (RESULTS_CSV, RESULTS_JSON, REPORT, SEEDS)  # what a run writes in --out


def replayed(path: str) -> SavedArena:
    """A saved run to replay, refused in words when it cannot be (no such file, not an arena run, saved before
    runs kept their conversations)."""
    saved = arena_from_json(read_json(read_bytes(path, "saved arena run"), f"arena run {path}"))
    if saved.unreplayable:
        raise KvlabError(f"{path} cannot be replayed: {saved.unreplayable}")
    return saved


def run(args: argparse.Namespace) -> int:
    """Run the grid and write the results; exit 1 when a policy failed (its error is in the files) or a replay
    differs from its file."""
    saved = replayed(args.replay) if args.replay else None
    if saved is not None:
        settings, conversations = saved.settings, saved.conversations
    else:
        settings = ArenaSettings(
            policies=comma_list(args.policies, "--policies"), budgets=parse_budgets(args.budgets, args.budget_unit),
            budget_unit=args.budget_unit,
            max_new_tokens=args.max_new_tokens, max_turns=args.max_turns, block_size=args.block_size,
            position_mode=args.position_mode, params=parse_params(args.param),
            modes=comma_list(args.modes, "--modes"),
        )
        conversations = workloads_of(args.workload, args.scbench)
    plan = None
    if args.ray_address is not None or (args.workers is not None and args.workers != 1):
        plan = RayPlan(workers=args.workers, address=args.ray_address)
        refuse_on_workers(settings.policies)
        if plan.address:
            from kvlab.experiments.workers import check_reachable  # Ray is imported only for a run that uses it

            check_reachable(plan.address)  # before the model loads
    if args.out is None and saved is None:
        raise KvlabError("give --out, the folder for the results")
    out = None if args.out is None else out_folder(args.out, files=ARENA_FILES, inputs=[
        (args.replay, "the file being replayed"), *((w, "a workload file") for w in args.workload)])
    lm = load_model(args.model, device=args.device)
    conversations = [fit_to_context(c, lm, settings.max_new_tokens) for c in conversations]
    for c in conversations:
        if c.notice:
            print(f"kvlab: note: {c.notice}", file=sys.stderr)
    check_grid(lm, conversations, settings)
    if short := grid_short_replies(lm, conversations, settings):
        print(f"kvlab: warning: {short}", file=sys.stderr)
    if settings.budget_unit == "mib":  # what each byte budget gives each policy, before anything runs
        for b in settings.budgets:
            chat = settings.chat_settings(b, lm.facts)
            print(f"{b:g} MiB: " + ", ".join(f"{n} {chat.budget_of(n)}" for n in chat.policies)
                  + " tokens per layer and KV head")

    bar, progress = progress_bar("arena", grid_size(conversations, settings), "turn")

    stopping = ("stopping now; the turn in progress is dropped, the finished turns are kept" if plan is None
                else "stopping the workers; finished cells are kept")
    with bar, stop_on_interrupt(stopping) as cancel:
        if plan is None:
            table = run_arena(lm, conversations, settings, cancel=cancel, progress=progress)
        else:
            from kvlab.experiments.workers import run_arena_ray  # Ray is imported only for a run that uses it

            table = run_arena_ray(ModelSpec(args.model, device=args.device), conversations, settings, plan,
                                  cancel=cancel, progress=progress)
    cancelled = cancel.is_set() and bar.n < bar.total
    seeds = seed_table(table) if not table.empty else None
    failed = failures(table)
    # nothing finished, nothing written: empty files would take the place of an earlier run's in the folder
    files = [] if out is None or seeds is None else _write(out, table, seeds, settings, lm.facts.name, conversations,
                                                           cancelled)
    if cancelled:
        turns = sum(turns_ran(cell.to_dict("records"), settings) for _, cell in table.groupby(["workload", "budget"]))
        print(f"kvlab: interrupted: {len(table)} rows from the {turns} turns that finished; "
              f"{cells_not_run(table, conversations, settings)} of {len(conversations) * len(settings.budgets)} "
              "cells (workload × budget) did not run" + ("" if files or out is None else "; nothing was written"),
              file=sys.stderr)
    if not table.empty:
        if cancelled:
            print(f"Cut short: the tables below hold the {turns} turn{'s' * (turns != 1)} that finished, not the whole "
                  "grid.")
        print("Accuracy (share of the answers right) per turn and over all turns, with 95 % intervals:")
        print(text_table(without_quiet(accuracy_grid(one_mode(table)), GRID_QUIET)))
        if len(failed):  # their rows above read "-": no score, said here as a failure
            print("FAILED, no score on the turns named (the errors are on stderr): " + "; ".join(
                f"{r.policy} at budget {r.budget:g} on {r.workload}, turns {r.turns}" for r in failed.itertuples()))
        if note := settings.budget_blind_note():
            print(note)
        if len(drop := mode_drop(table)):
            print(text_table(drop))
        print(f"\nThe seed's table, measured. {THRESHOLDS}")
        unrun = set()  # a family none of whose policies ran: one line for all, not a block of "not run" each
        for row in seeds.itertuples(index=False):
            texts = list(zip(seeds.columns[3:], row[3:]))
            if all(str(text).startswith(("not run", "not measured")) for _, text in texts):
                unrun.add(row.family)
                continue
            print(f"\n{row.family} ({row.policies}) at budget {row.budget}:")
            for workload, text in texts:
                print(f"  {workload}: {text}")
        if unrun:
            print(f"\nNot run here (no policy of theirs in --policies): {', '.join(sorted(unrun))}.")
    if files:
        print(f"wrote {', '.join(map(str, files))}")
    for text in failed["text"]:
        print(f"kvlab: error: {text}", file=sys.stderr)
    differ = saved is not None and not cancelled and print_replay(
        ReplayCheck(replay_differences(saved.table, table), "every row", saved.stamp, lm.facts.name), args.replay)
    return INTERRUPTED if cancelled else 1 if len(failed) or differ else 0


def _write(out: Path, table: pd.DataFrame, seeds: pd.DataFrame, settings: ArenaSettings, model: str,
           conversations: list[Conversation], cancelled: bool) -> list[Path]:
    """The run's files in ``out``; returns their paths."""
    names = [c.name for c in conversations]
    (made(out) / RESULTS_CSV).write_bytes(table_csv(table))
    (out / RESULTS_JSON).write_text(
        to_json(results_json(table, settings, model, names, cancelled, conversations=conversations), indent=1),
        encoding="utf-8")
    (out / REPORT).write_text(arena_report(table, settings, model, names, cancelled), encoding="utf-8")
    (out / SEEDS).write_bytes(table_csv(seeds))
    return [out / RESULTS_CSV, out / RESULTS_JSON, out / REPORT, out / SEEDS]


