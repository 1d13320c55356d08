"""``python -m kvlab edit``: replay scripted code edits with prefix reuse and cost/measure K/V sharing."""

from __future__ import annotations

import argparse

from kvlab.cli.bars import progress_bar
from kvlab.cli.options import add_model_options, out_file
from kvlab.engine.model import load_model
from kvlab.engine.timing import SINGLE_RUN_NOTE
from kvlab.errors import KvlabError
from kvlab.export import to_json
from kvlab.paths import DATA_DIR
from kvlab.sharing.schemes import OFFERED_SCHEMES, SCHEME_FAMILIES, parse_schemes
from kvlab.workloads.code.edits import apply_edit, load_script
from kvlab.workloads.code.session import EditReport, run_report
from kvlab.workloads.code.source import module_source, read_file


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("edit", help="code edits: prefix reuse, CLA/YOCO cost and fidelity")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--file", help="code file to edit (default: the edit script's own file)")
    source.add_argument("--module", help="installed Python module whose source to edit, e.g. json.decoder")
    p.add_argument("--edits", required=True,
                   help="edit sequence JSON (see kvlab/workloads/code/edits.py; e.g. data/edits/*.json)")
    p.add_argument("--sharing", default=",".join(OFFERED_SCHEMES),
                   help="comma-separated: "
                   + "; ".join(f"{f.names_hint} ({f.summary})" for f in SCHEME_FAMILIES.values())
                   + " (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timing runs per measurement, the median counts (default 3)")
    p.add_argument("--positions", type=int, default=32, help="last positions compared for fidelity (default 32)")
    add_model_options(p, dtype=False)
    p.add_argument("--out", help="write the full result as JSON here")
    p.set_defaults(func=run)


def _source(args: argparse.Namespace, script_file: str | None) -> tuple[str, str]:
    if args.module:
        text, origin = module_source(args.module)
        return text, f"module {args.module} ({origin})"
    if args.file:
        return read_file(args.file), args.file
    if script_file:
        path = DATA_DIR / script_file
        return read_file(path), str(path.relative_to(DATA_DIR.parent))
    raise KvlabError("give --file or --module (the edit script names no file)")


def format_report(report: EditReport) -> str:
    """The two tables the command prints."""
    edits = report.edits.assign(position=lambda d: "L" + d["line"].astype(str) + " " + d["op"])
    edits = edits[["index", "label", "position", "new_tokens", "reused", "suffix", "reuse_pct", "reprefill_ms",
                   "reprefill_spread_ms", "full_ms", "full_spread_ms", "speedup", "max_logit_diff"]]
    runs = int(report.edits["runs"].iloc[0]) if len(report.edits) else 1
    sharing = report.sharing[["scheme", "kv_layers", "claim_share", "compute_share", "kv_bytes_share",
                              "prefill_time_ratio", "reprefill_time_ratio", "kl_mean", "top1"]]
    return "\n".join([
        f"source: {report.source} ({report.tokens} tokens), model: {report.facts['name']}",
        "",
        "Edits (prefix reuse vs full prefill of the new text):",
        edits.to_string(index=False, float_format=lambda v: f"{v:.4g}"),
        SINGLE_RUN_NOTE if runs == 1 else f"Times: median of {runs} runs; spread = slowest − fastest run.",
        "",
        "Sharing (compute/KV shares of Full for re-prefilling the edits' suffixes; time ratios measured with",
        f"the same layer loop; fidelity over the last {int(report.sharing['positions'].iloc[0])} positions"
        " of the original file vs the unshared model):",
        sharing.to_string(index=False, float_format=lambda v: f"{v:.3f}"),
        "",
        "claim_share: the notes' 're-prefill drops from O(N_layers) to O(N_layers / sharing ratio)'.",
        "The model was not trained to share K/V: KL and top-1 are an upper bound on a CLA/YOCO-trained model's loss.",
    ])


def run(args: argparse.Namespace) -> int:
    for option, value in (("--repeats", args.repeats), ("--positions", args.positions)):
        if value < 1:
            raise KvlabError(f"{option} must be at least 1, not {value}")
    out = out_file(args.out, inputs=[(args.edits, "the edit script"), (args.file, "the code file")])
    script = load_script(args.edits)
    text, source = _source(args, script.file)
    edited = text
    for edit in script.edits:  # a script that cannot apply is refused before the model loads, not halfway through
        try:
            edited, _ = apply_edit(edited, edit)
        except KvlabError as exc:
            raise KvlabError(f"{args.edits} does not fit {source}: {exc}") from None
        if not edited.strip():
            raise KvlabError(f"{edit.label}: it leaves {source} empty, and an empty file cannot be prefilled")
    lm = load_model(args.model, device=args.device)
    if args.positions > (tokens := len(lm.encode(text))):
        raise KvlabError(f"--positions {args.positions} is more than the {tokens} tokens of {source}")
    schemes = parse_schemes(args.sharing, lm.facts.n_layers)
    bar, progress = progress_bar("edit", 100, "%")
    with bar:
        report = run_report(lm, text, source, script.edits, schemes, args.repeats, args.positions, progress)
    print(format_report(report))
    if out is not None:
        out.write_text(to_json(report.to_dict(), indent=2))
        print(f"\nwrote {out}")
    return 0
