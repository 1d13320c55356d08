"""``python -m kvlab stream``: a long text through policies side by side; writes CSV, JSON and an HTML report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvlab.cli.bars import progress_bar
from kvlab.cli.interrupt import INTERRUPTED, stop_on_interrupt
from kvlab.cli.options import POSITION_HELP, add_model_options, comma_list, made, out_folder
from kvlab.cli.printing import text_table
from kvlab.engine.model import load_model
from kvlab.errors import KvlabError
from kvlab.experiments.stream_report import stream_report
from kvlab.export import table_csv, to_json
from kvlab.policies import parse_params
from kvlab.workloads.stream.run import run_stream
from kvlab.workloads.stream.settings import (
    DEFAULT_POLICIES,
    RECOMPUTE,
    StreamSettings,
    check_length,
    check_names,
    stream_policies,
    streamable,
)
from kvlab.workloads.stream.sinks import SINKS, parse_sinks, sink_ablation, stream_record
from kvlab.workloads.stream.text import DEFAULT_TEXT_NAME, MAX_TOKENS, default_text, read_text, stream_ids


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("stream", help="stream a long text past the trained context: perplexity per policy")
    p.add_argument("--text", default=None, help=f"UTF-8 text file (default: {DEFAULT_TEXT_NAME})")
    p.add_argument("--tokens", type=int, default=4096,
                   help="tokens of the text to stream (past the embedded SmolLM2's 8,192 to leave its context)")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help=f"comma-separated, of {', '.join(streamable())} or a plug-in policy that bounds the cache "
                        f"(--policy-file, KVLAB_POLICY_PATH): full is the dense baseline, {RECOMPUTE} a sliding window "
                        "with recomputation, the others cache policies that bound the cache "
                        f"(default {','.join(DEFAULT_POLICIES)})")
    p.add_argument("--budget", type=int, default=1024, help="tokens each cache keeps after every chunk")
    p.add_argument("--chunk", type=int, default=64, help="tokens read per forward (1: token by token)")
    p.add_argument("--position-mode", choices=["rerotated", "original"], default="rerotated", help=POSITION_HELP)
    p.add_argument("--policy-file", action="append", default=[], metavar="FILE",
                   help="a Python file of plug-in policies, repeatable (see README: Writing a plug-in policy)")
    p.add_argument("--param", action="append", default=[], metavar="POLICY.NAME=VALUE",
                   help="a policy parameter, e.g. streamingllm.n_sink=8 (repeatable)")
    p.add_argument("--segment", type=int, default=1024, help="tokens per row of the perplexity-per-segment table")
    p.add_argument("--window", type=int, default=256, help="tokens the running perplexity curve averages over")
    p.add_argument("--sinks", default=None, metavar="0,1,2,4,8",
                   help="also run the sink ablation at the same cache with these sink counts "
                        f"(StreamingLLM's Table 1: {','.join(map(str, SINKS))})")
    add_model_options(p, dtype=False)
    p.add_argument("--out", required=True,
                   help="folder for tokens.csv, segments.csv, result.json, report.html (and sink_ablation.csv)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Stream the text, write the files; exit 1 when a policy failed (its error is in the files)."""
    names = tuple(n.lower() for n in comma_list(args.policies, "--policies"))
    settings = StreamSettings(policies=names, budget=args.budget, chunk=args.chunk,
                              position_mode=args.position_mode, params=parse_params(args.param))
    check_names(settings)  # before the model loads
    if not 2 <= args.tokens <= MAX_TOKENS:
        raise KvlabError(f"--tokens must be between 2 and {MAX_TOKENS:,}, not {args.tokens:,}")
    if args.segment < 1 or args.window < 1:
        raise KvlabError("--segment and --window must be at least 1 token")
    sinks = None if args.sinks is None else parse_sinks(args.sinks, settings.budget)
    text = read_text(args.text) if args.text else default_text()
    text_name = Path(args.text).name if args.text else DEFAULT_TEXT_NAME
    out = out_folder(args.out)

    lm = load_model(args.model, device=args.device)
    ids = stream_ids(lm.encode, text, args.tokens)
    if len(ids) < args.tokens:
        raise KvlabError(f"{text_name} has {len(ids):,} tokens, fewer than --tokens {args.tokens:,}")
    stream_policies(lm, settings)  # refused in words before a bar is drawn
    check_length(len(ids), settings)
    bar, progress = progress_bar("stream", 100, "%")  # a share of the work (chunk_work); its text counts tokens
    with bar, stop_on_interrupt("stopping after the current chunk; the tokens read so far are kept") as cancel:
        result = run_stream(lm, ids, settings, progress, cancel)
    ablation = None
    if sinks is not None and not result.cancelled:
        bar, progress = progress_bar("sink ablation", 100, "%")
        with bar, stop_on_interrupt("stopping the sink ablation after the current chunk") as cancel:
            ablation = sink_ablation(lm, ids, settings.budget, sinks, settings.chunk, settings.position_mode, progress,
                                     cancel)

    if result.cancelled and result.scored == 0:  # empty files would take an earlier run's place
        print(f"kvlab: interrupted: the stream stopped before its first chunk was read; nothing was written to {out}",
              file=sys.stderr)
        return INTERRUPTED
    (made(out) / "tokens.csv").write_bytes(table_csv(result.token_file()))
    (out / "segments.csv").write_bytes(table_csv(result.segments(args.segment)))
    if ablation is not None:
        (out / "sink_ablation.csv").write_bytes(table_csv(ablation.table()))
    else:  # none ran: an earlier run's must not sit beside these results as theirs
        (out / "sink_ablation.csv").unlink(missing_ok=True)
    record = stream_record(result, text_name, args.segment, ablation)
    (out / "result.json").write_text(to_json(record, indent=1), encoding="utf-8")
    (out / "report.html").write_text(stream_report(result, text_name, args.segment, args.window, ablation),
                                     encoding="utf-8")
    summary = result.summary()
    if result.cancelled:  # said beside the numbers too, not only on stderr
        print(f"Cut short: the tables below hold the first {result.scored:,} of {len(ids) - 1:,} tokens to score.")
    print(text_table(summary[["label", "ppl", "ppl_in_context", "ppl_past_context", "max_rope_position",
                              "tokens_per_s"]]))
    print("tokens_per_s: the tokens scored over the stream's seconds, one run (not a median of several)")
    if ablation is not None:
        print(text_table(ablation.table()[["cache", "ppl", "ppl_after_cache_filled"]]))
    print(f"wrote {out}/tokens.csv, segments.csv, result.json, report.html"
          + (", sink_ablation.csv" if ablation is not None else ""))
    if result.cancelled or (ablation is not None and ablation.result.cancelled):
        what = "the stream" if result.cancelled else "the sink ablation"
        print(f"kvlab: interrupted: {what} stopped after {result.scored:,} of {len(ids) - 1:,} tokens; the files hold "
              "what was read" + ("" if result.cancelled else ", the ablation up to where it stopped"), file=sys.stderr)
        return INTERRUPTED
    failed = summary[summary["error"].notna()]
    for _, row in failed.iterrows():
        print(f"kvlab: {row['policy']} failed: {row['error']}", file=sys.stderr)
    if ablation is not None:
        for _, row in ablation.table().dropna(subset=["error"]).iterrows():
            print(f"kvlab: {row['cache']} failed: {row['error']}", file=sys.stderr)
    return 1 if len(failed) or (ablation is not None and ablation.table()["error"].notna().any()) else 0
