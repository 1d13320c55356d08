"""``python -m kvlab profile``: where a follow-up turn's time goes, Full alone against several policies."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

from kvlab.cli.bars import progress_bar
from kvlab.cli.options import (
    add_model_options,
    add_threads_option,
    check_runs,
    check_threads,
    comma_list,
    out_file,
    torch_threads,
)
from kvlab.engine.model import load_model
from kvlab.errors import KvlabError
from kvlab.experiments.bench_rows import machine
from kvlab.experiments.turn_profile import BUDGET, NEW_TOKENS, profile_follow_up, profile_text, tokens_needed
from kvlab.export import to_json
from kvlab.policies import DEFAULT_COMPARISON, parse_params
from kvlab.saved import stamp
from kvlab.workloads.chat.settings import ChatSettings


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="where a follow-up's time goes: Full alone against several policies, by "
                                       "phase and by operator")
    p.add_argument("--policies", default=",".join(DEFAULT_COMPARISON),
                   help="the policies side by side; Full runs among them, named or not (default %(default)s)")
    p.add_argument("--context", type=int, default=1024,
                   help="tokens of prose in the first turn, before the follow-up (default %(default)s)")
    p.add_argument("--runs", type=int, default=3, help="timed follow-ups per side (default %(default)s)")
    p.add_argument("--budget", type=int, default=BUDGET,
                   help="tokens per layer per KV head each policy keeps (default %(default)s)")
    p.add_argument("--param", action="append", default=[], metavar="POLICY.NAME=VALUE",
                   help="a policy parameter, e.g. streamingllm.n_sink=8 (repeatable)")
    add_threads_option(p)
    p.add_argument("--policy-file", action="append", default=[], metavar="FILE",
                   help="a Python file of plug-in policies, repeatable (see README: Writing a plug-in policy)")
    add_model_options(p)
    p.add_argument("--out", default="profile_result.json", help="result JSON path (default %(default)s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Profile, print the text, write the JSON; exit 1 when a policy failed (its error is in both)."""
    names = comma_list(args.policies, "--policies")
    # refuses unknown names, bad parameters and a budget below a policy's minimum, before the model loads
    chosen = ChatSettings(policies=names, budget=args.budget, params=parse_params(args.param))
    policies = chosen.policies
    if policies == ("full",):
        raise KvlabError("--policies must name at least one policy besides full: Full alone is the other side")
    check_runs(args.runs)
    if args.context < 1:
        raise KvlabError(f"--context must be at least 1 token, not {args.context}")
    check_threads(args.threads)
    out = out_file(args.out)
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    if args.context > lm.facts.context_length:  # before a text that long is made: memory
        raise KvlabError(f"--context {args.context}: more than the model's context of {lm.facts.context_length}")
    needed = tokens_needed(lm, args.context)
    if needed > lm.facts.context_length:
        raise KvlabError(f"--context {args.context}: the conversation would hold {needed} tokens, more than the "
                         f"model's context of {lm.facts.context_length}")
    if needed <= args.budget:
        print(f"kvlab: note: the conversation holds {needed} tokens, within the budget of {args.budget}: no policy "
              "evicts, so the sides differ only by the caches they carry", file=sys.stderr)
    bar, progress = progress_bar("profile", 100, "%")
    with torch_threads(args.threads) as threads, bar:
        profiles = profile_follow_up(lm, [("full",), policies], args.context, budget=args.budget, runs=args.runs,
                                     progress=progress, params=chosen.params)
    info = machine(lm, threads)
    setup = (f"{info['model']} on {info['device']} ({info['dtype']}), {info['processor']}, {info['torch_threads']} "
             f"torch threads; budget {args.budget} tokens, {NEW_TOKENS} new tokens a reply")
    text = profile_text(profiles, args.context, setup)
    out.write_text(to_json({**stamp(lm.facts.name), "machine": info, "context_tokens": args.context,
                            "budget": args.budget,
                            "params": chosen.params,
                            "new_tokens": NEW_TOKENS, "sides": [asdict(p) for p in profiles], "text": text},
                           indent=1), encoding="utf-8")
    print(text)
    print(f"wrote {out}")
    failed = [e for p in profiles for e in p.errors]
    for error in failed:
        print(f"kvlab: policy failed: {error}", file=sys.stderr)
    return 1 if failed else 0
