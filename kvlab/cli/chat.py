"""``python -m kvlab chat``: run a conversation file over several policies side by side."""

from __future__ import annotations

import argparse
import sys

from kvlab.cli.bars import FirstUse, counted_until_interrupted
from kvlab.cli.interrupt import INTERRUPTED
from kvlab.cli.options import BLOCK_HELP, POSITION_HELP, add_model_options, comma_list, out_file
from kvlab.cli.printing import text_table
from kvlab.engine.model import load_model
from kvlab.errors import KvlabError
from kvlab.experiments.plan import parse_budgets
from kvlab.export import to_json
from kvlab.policies import DEFAULT_COMPARISON, parse_params
from kvlab.workloads.chat.budgets import (
    BUDGET_UNITS,
    PERCENT_HELP,
    UNCONVERTED,
    budget_words,
    check_mib,
    mib_settings,
)
from kvlab.workloads.chat.conversation import check_max_turns, first_turns, short_replies
from kvlab.workloads.chat.files import workloads_of
from kvlab.workloads.chat.positions import check_script_fits
from kvlab.workloads.chat.records import failures, turn_table
from kvlab.workloads.chat.replay import session_to_json
from kvlab.workloads.chat.scbench import fit_to_context
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.settings import ChatSettings, model_policies


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="run a multi-turn conversation over several cache policies")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--conversation", help="conversation file: kvlab JSON (see data/conversations), a JSONL of "
                        "them (kvlab tasks), or SCBench's JSONL / parquet (one record is one session)")
    source.add_argument("--scbench", metavar="TASK", help="an SCBench task from the hub, e.g. scbench_kv (needs the "
                        "datasets package and a network)")
    p.add_argument("--record", default=None, metavar="ID", help="which record (SCBench id, or conversation name in "
                   "a JSONL file) to run; default the first")
    p.add_argument("--policies", default=",".join(DEFAULT_COMPARISON), help="comma-separated policy names")
    p.add_argument("--budget", default="128", help="the budget, in --budget-unit (default: 128 tokens)")
    p.add_argument("--budget-unit", choices=list(BUDGET_UNITS), default="tokens",
                   help="tokens: retained per layer per KV head; mib: MiB of K/V held at most, each policy the most "
                        "tokens whose worst case fits (4 bits keep more); " + PERCENT_HELP.replace("%", "%%"))
    p.add_argument("--policy-file", action="append", default=[], metavar="FILE",
                   help="a Python file of plug-in policies, repeatable (see README: Writing a plug-in policy)")
    p.add_argument("--param", action="append", default=[], metavar="POLICY.NAME=VALUE",
                   help="a policy parameter, repeatable, e.g. --param snapkv.window=16 --param tova.per_head=true")
    p.add_argument("--block-size", type=int, default=16, help=BLOCK_HELP)
    p.add_argument("--position-mode", choices=["original", "rerotated"], default="original", help=POSITION_HELP)
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens each reply decodes at most (1 to 1024)")
    p.add_argument("--max-turns", type=int, default=None, help="only the conversation's first N turns")
    add_model_options(p)
    p.add_argument("--out", required=True, help="result JSON path; Ctrl-C stops after the current turn, writes the "
                   "turns that finished and exits 130")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the conversation and write the JSON; exit 1 when a policy failed (its error is in the file)."""
    convs = workloads_of([args.conversation] if args.conversation else [], args.scbench, args.record)
    conv = convs[0]
    check_max_turns(args.max_turns, "--max-turns")
    budgets = parse_budgets(args.budget, args.budget_unit)
    if len(budgets) > 1:
        raise KvlabError(f"give one budget, not {args.budget!r} (the arena runs several)")
    percent, mib = args.budget_unit == "percent", args.budget_unit == "mib"
    settings = ChatSettings(
        policies=comma_list(args.policies, "--policies"),
        budget=128 if percent else UNCONVERTED if mib else budgets[0],  # MiB become tokens on the model
        block_size=args.block_size,
        position_mode=args.position_mode, max_new_tokens=args.max_new_tokens, params=parse_params(args.param),
        budget_percent=budgets[0] if percent else None,
    )
    if mib:  # refused before the model loads, as every other bad budget
        check_mib(budgets[0])
    out = out_file(args.out, inputs=[(args.conversation, "the conversation file")])
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    if mib:  # bytes become each policy's tokens on the model's facts
        settings = mib_settings(settings, budgets[0], lm.facts)
    if len(convs) > 1:
        print(f"running {conv.name}, the first of {len(convs)} sessions in the file (--record picks another)",
              file=sys.stderr)
    conv = fit_to_context(conv, lm, args.max_new_tokens)  # the whole conversation, as the arena fits it
    conv = first_turns(conv, args.max_turns)
    check_script_fits(lm, settings.position_mode, conv, settings.max_new_tokens, len(conv.turns))
    if conv.notice:
        print(f"kvlab: note: {conv.notice}", file=sys.stderr)
    if short := short_replies(lm.encode, [conv], settings.max_new_tokens):
        print(f"kvlab: warning: {short}", file=sys.stderr)
    learning = FirstUse("preparing")  # what a policy learns from the model first, before the session takes it
    try:
        model_policies(lm, settings, learning)
    finally:
        learning.close()
    session = ChatSession(lm, settings, conv.system, script=conv)
    stopping = "stopping after the current turn; the turns that finished are written"
    with counted_until_interrupted(stopping, len(conv.turns), conv.name, "turn") as one_done:
        for turn in conv.turns:
            session.run_turn(turn.user, golden=turn.golden, prefill=turn.prefill, answer=turn.answer,
                             metric=turn.metric)
            if one_done():
                break
    data = session_to_json(session)
    data["conversation"] = conv.name
    data["notice"] = conv.notice
    data["cancelled"] = len(session.turns) < len(conv.turns)
    out.write_text(to_json(data))
    table = turn_table(session.turns)
    cols = ["turn", "policy", "kl", "top1", "correct", "metric", "past_context", "max_position", "kept_tokens",
            "budget_tokens", "budget_kib", "kv_kib", "held_vs_budget", "held_share", "fragmented_blocks",
            "turn_s", "shared_s", "own_s", "extra_prefill_tokens", "extra_prefill_s"]
    print(text_table(table[cols].assign(past_context=["PAST" if v else "" for v in table.past_context],
                                        correct=["FAILED" if isinstance(e, str) else c
                                                 for c, e in zip(table.correct, table.error)])))
    if table.past_context.any():
        print(f"past_context PAST: the policy's largest rotary position (max_position) passed {lm.facts.name}'s "
              f"trained context of {lm.facts.context_length:,}: scores there come from positions it never trained on "
              "(where Full is past it, the reference itself is)")
    print("turn_s: the whole turn; shared_s: each policy's even share of the forwards run for all caches at once; "
          "own_s: only its own work (eviction, extra pass); budget_kib: the K/V its budget allowed at the turn's "
          "last compression (-: no budget bounds what it holds); held_share: the K/V it held over Full's")
    print(f"budget: {budget_words(settings)}")
    print(f"wrote {out}")
    failed = failures(session.turns)
    for name, (turn, error) in failed.items():
        print(f"kvlab: error: {name} failed on turn {turn} and was dropped (no score from then on): {error}",
              file=sys.stderr)
    if data["cancelled"]:
        print(f"kvlab: interrupted: {len(session.turns)} of the {len(conv.turns)} turns ran; {out} holds those",
              file=sys.stderr)
        return INTERRUPTED
    return 1 if failed else 0
