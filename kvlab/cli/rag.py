"""``python -m kvlab rag``: RAG questions through every chunk-reuse strategy, with a summary table."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvlab.cli.bars import counted_until_interrupted, progress_bar
from kvlab.cli.interrupt import INTERRUPTED
from kvlab.cli.options import add_model_options, comma_list, out_file
from kvlab.cli.printing import print_replay, text_table
from kvlab.engine.facts import LoadedModel
from kvlab.engine.model import load_model
from kvlab.errors import KvlabError
from kvlab.experiments.rag_report import rag_report
from kvlab.export import table_csv, to_json
from kvlab.files import read_bytes
from kvlab.saved import ReplayCheck, now, read_json
from kvlab.workloads.rag.corpus import DEFAULT_CORPUS, Corpus, Question, load_questions
from kvlab.workloads.rag.drift import check_drift
from kvlab.workloads.rag.record import made_on, rag_differences, rag_from_json, rag_record, replay_refusal
from kvlab.workloads.rag.run import (
    QuestionResult,
    RagLab,
    RagSettings,
    deviation_table,
    results_table,
    summary_table,
    timing_note,
)
from kvlab.workloads.rag.simulate import simulate
from kvlab.workloads.rag.strategies import STRATEGIES, strategy_names
from kvlab.workloads.rag.upload import corpus_from_paths

DEFAULT_OUT = "rag_result.json"
DRIFT = (2, 0)  # the report's drift figure: its layer and query head unless asked


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("rag", help="reuse cached document chunks in RAG prompts: RoPE drift and its fixes")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--questions", help="JSON file of questions (default: the corpus's own question set)")
    src.add_argument("--question", help="one free-text question (no answer check)")
    p.add_argument("--corpus", nargs="+", default=[str(DEFAULT_CORPUS)], metavar="FILE",
                   help="your corpus: one JSON file in the built-in corpus's format (its questions optional), or "
                        ".txt/.md files, one document each (no question set: ask with --question or --questions)")
    p.add_argument("--k", type=int, default=None,
                   help=f"documents retrieved per question (default: {RagSettings.k}, or every document of a smaller "
                        "corpus)")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help="comma-separated subset of " + "; ".join(f"{s.name} ({s.label})" for s in STRATEGIES.values()))
    p.add_argument("--recompute", type=float, default=0.15, help="CacheBlend's share of document tokens recomputed")
    p.add_argument("--select-layer", type=int, default=1, help="layer whose K/V deviation picks CacheBlend's tokens")
    p.add_argument("--answer-tokens", type=int, default=8, help="greedy answer length")
    p.add_argument("--runs", type=int, default=3, help="timed runs per TTFT (median, with the slowest and fastest)")
    p.add_argument("--limit", type=int, default=None, help="only the first N questions")
    add_model_options(p, dtype=False)
    p.add_argument("--replay", metavar="RESULT_JSON",
                   help="run a saved RAG run's questions again with the settings each ran with, on the --corpus it "
                        "was made on, and check that everything but the timings is the same: exit 1 where it is not")
    p.add_argument("--out", default=None, help=f"JSON result file (the page opens it as a saved run; default "
                   f"{DEFAULT_OUT} in the current folder; a --replay writes one only where --out is given)")
    p.add_argument("--csv", default=None, help="also write the per-question table as CSV")
    p.add_argument("--html", default=None, help="also write an HTML report with the figures")
    p.add_argument("--drift-layer", type=int, default=None,
                   help=f"layer of the --html report's q·k drift figure (default {DRIFT[0]})")
    p.add_argument("--drift-head", type=int, default=None,
                   help=f"query head of the --html report's q·k drift figure (default {DRIFT[1]})")
    p.set_defaults(func=run)


def _drift(args: argparse.Namespace) -> tuple[int, int]:
    """The drift figure's layer and query head: as asked, else ``DRIFT``."""
    return tuple(d if a is None else a for a, d in zip((args.drift_layer, args.drift_head), DRIFT))


def _check_drift(args: argparse.Namespace, lm: LoadedModel) -> None:
    """Refuse a drift layer or head the model lacks where a report draws them or the user named them."""
    if args.html or args.drift_layer is not None or args.drift_head is not None:
        check_drift(lm, *_drift(args))


def replay(args: argparse.Namespace) -> int:
    """Run a saved RAG run's questions again on fresh caches and say whether every number but the timings matches."""
    data = read_json(read_bytes(args.replay, "saved RAG run"), f"RAG run {args.replay}")
    saved, stamp = rag_from_json(data)
    corpus = corpus_from_paths(args.corpus)
    if refusal := replay_refusal(data, saved, corpus):
        raise KvlabError(refusal)
    lm = load_model(args.model, device=args.device)
    _check_drift(args, lm)
    lab = RagLab(lm, corpus)
    bar, progress = progress_bar("replay", len(saved), "q")
    with bar:
        again = lab.replay(saved, progress)
    write(args, again, corpus, lm, [r.question for r in saved])
    return int(print_replay(ReplayCheck(rag_differences(saved, again), "every question", stamp, lm.facts.name),
                            args.replay))


def write(args: argparse.Namespace, results: list[QuestionResult], corpus: Corpus, lm: LoadedModel,
          questions: list[Question], planned: int | None = None) -> None:
    """The files asked for, then one line naming them: the run's JSON (a saved record the page opens and
    ``--replay`` runs again), its CSV and its HTML report; ``planned``: the questions the run was to ask, where
    Ctrl-C stopped it before its last (None: all ran)."""
    summary, dev, made = summary_table(results), deviation_table(results), now(lm.facts.name)
    cancelled = planned is not None and len(results) < planned
    if args.out:
        report = {**rag_record(results, made, made_on(corpus)), "summary": summary, "deviation": dev,
                  "cancelled": cancelled}
        Path(args.out).write_text(to_json(report, indent=1), encoding="utf-8")
    if args.csv:
        Path(args.csv).write_bytes(table_csv(results_table(results)))
    if args.html:
        sim = simulate(lm, corpus, questions)
        ran = results[0].settings if results else None
        notes = (made.label(), f"corpus {corpus.name}; {len(results)} question(s)" + (
            "" if ran is None else f"; k {ran.k}, strategies {', '.join(ran.strategies)}, CacheBlend recomputes "
                                   f"{ran.recompute:.0%}"), timing_note(results))
        if cancelled:
            notes += (f"Cut short: {len(results)} of the {planned} questions ran; the tables and figures hold those.",)
        Path(args.html).write_text(rag_report(lm, corpus, summary, dev, sim, *_drift(args), notes=notes),
                                   encoding="utf-8")
    if files := [f for f in (args.out, args.csv, args.html) if f]:
        print(f"wrote {', '.join(files)}")


def run(args: argparse.Namespace) -> int:
    if args.out is None and not args.replay:
        args.out = DEFAULT_OUT
    inputs = [(args.replay, "the file being replayed"), (args.questions, "the question file"),
              *((c, "a corpus file") for c in args.corpus)]
    for option in ("out", "csv", "html"):  # refused before the questions run, not after
        if (path := out_file(getattr(args, option), f"--{option}", inputs)) is not None:
            setattr(args, option, str(path))
            inputs.append((str(path), f"the --{option} file"))  # one file each: the last written would be all left
    if args.replay:
        return replay(args)
    corpus = corpus_from_paths(args.corpus)
    if args.question is not None:
        if not args.question.strip():
            raise KvlabError("the question is empty")
        questions: tuple[Question, ...] = (Question(id="free", question=args.question),)
    elif args.questions:
        questions = load_questions(args.questions, corpus)
    elif corpus.questions:
        questions = corpus.questions
    else:
        raise KvlabError(f"the corpus {corpus.name!r} has no questions: ask one with --question, or give a "
                         "question file with --questions")
    if args.limit is not None:
        if args.limit < 1:
            raise KvlabError("--limit must be at least 1")
        questions = questions[: args.limit]
    if min(_drift(args)) < 0:
        raise KvlabError("--drift-layer and --drift-head must be 0 or more")
    strategies = strategy_names(list(comma_list(args.strategies, "--strategies")))  # before the model loads
    k = min(RagSettings.k, len(corpus.documents)) if args.k is None else args.k
    settings = RagSettings(k=k, strategies=strategies,
                           recompute=args.recompute, select_layer=args.select_layer, answer_tokens=args.answer_tokens,
                           runs=args.runs)
    lm = load_model(args.model, device=args.device)
    settings.check(len(corpus.documents), lm.facts.n_layers)
    _check_drift(args, lm)
    lab = RagLab(lm, corpus)

    results = []
    stopping = "stopping after the current question; the questions that finished are written"
    with counted_until_interrupted(stopping, len(questions), "questions", "q") as one_done:
        for question in questions:
            results.append(lab.run(question, settings))
            if one_done():
                break
    cols = ["strategy", "questions", "failed", "accuracy", "mean KL", "top-1", "doc tokens recomputed",
            "question tokens", "TTFT ms", "speed-up", "speed-up low", "speed-up high"]
    print(text_table(summary_table(results)[cols]))
    print(timing_note(results))
    asked = list(questions)[: len(results)]
    write(args, results, corpus, lm, asked, planned=len(questions))
    if len(results) < len(questions):
        print(f"kvlab: interrupted: {len(results)} of the {len(questions)} questions ran; the files hold those",
              file=sys.stderr)
        return INTERRUPTED
    return 0

