"""``python -m kvlab tasks ruler``: RULER's synthetic tasks generated locally, seeded, as kvlab workloads."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from kvlab.cli.options import out_file
from kvlab.engine.conversion import EMBEDDED, embedded_folder, embedded_model
from kvlab.errors import KvlabError
from kvlab.workloads.chat.conversation import conversation_to_json
from kvlab.workloads.chat.ruler import TASKS, generate


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tasks", help="generate the field's synthetic tasks (RULER) as kvlab workloads")
    kinds = p.add_subparsers(dest="kind", required=True, parser_class=type(p))
    r = kinds.add_parser("ruler", help="RULER's niah_*, vt, cwe and fwe, with a haystack that ships with kvlab")
    r.add_argument("--task", required=True, choices=list(TASKS), metavar="NAME", help=", ".join(TASKS))
    r.add_argument("--length", type=int, required=True, help="tokens per sample (RULER's count: questions, answer "
                   "prefixes and the tokens to generate), in the tokenizer of --model")
    r.add_argument("--samples", type=int, default=1, help="samples to generate (1 to 1000)")
    r.add_argument("--seed", type=int, default=0, help="random seed: the same seed and settings give the same samples")
    r.add_argument("--multi-turn", action="store_true",
                   help="one context, one query per turn (SCBench-style) instead of RULER's one question")
    r.add_argument("--questions", type=int, default=None,
                   help="queries per sample (niah: keys asked; vt: chains, with --multi-turn); default the task's")
    r.add_argument("--model", default=None, help="whose tokenizer counts the tokens: gemma3-270m (embedded) or a "
                   "local model folder (default: the embedded SmolLM2-135M)")
    r.add_argument("--out", required=True, help="FILE.jsonl: one kvlab conversation per line (kvlab arena "
                   "--workload takes it); FILE.json: one sample. FILE.manifest.jsonl says where the needles are")
    p.set_defaults(func=run)


def load_tokenizer(name: str | None) -> tuple[PreTrainedTokenizerBase, int | None]:
    """An embedded model's tokenizer, or a local folder's, with the model's trained context (None where its config
    does not say); nothing is downloaded."""
    embedded = embedded_model((name or EMBEDDED).strip())
    folder = str(embedded_folder(embedded)) if embedded is not None else name
    if embedded is None and not Path(name).is_dir():
        raise KvlabError(f"--model {name!r} is neither an embedded model nor a local model folder")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise KvlabError(f"cannot read a tokenizer from {name}: {type(exc).__name__}") from None
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True).get_text_config()
    except (OSError, ValueError):  # a tokenizer-only folder counts tokens just as well
        return tokenizer, None
    return tokenizer, getattr(config, "max_position_embeddings", None)


def run(args: argparse.Namespace) -> int:
    """Generate the samples and write them with their manifest."""
    out = out_file(args.out)
    if out.suffix not in (".jsonl", ".json"):
        raise KvlabError("--out must end in .jsonl (any number of samples) or .json (one sample)")
    if out.suffix == ".json" and args.samples != 1:
        raise KvlabError("a .json file holds one sample; write --samples > 1 to a .jsonl file")
    tokenizer, context = load_tokenizer(args.model)

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    samples = generate(args.task, args.length, args.samples, args.seed, encode, multi_turn=args.multi_turn,
                       questions=args.questions, tokenizer_name=Path(tokenizer.name_or_path).name)
    lines = [json.dumps(conversation_to_json(s.conversation), ensure_ascii=False) for s in samples]
    out.write_text(lines[0] + "\n" if out.suffix == ".json" else "\n".join(lines) + "\n", encoding="utf-8")
    manifest = out.with_suffix(".manifest.jsonl")
    manifest.write_text("".join(json.dumps(s.manifest()) + "\n" for s in samples), encoding="utf-8")
    for s in samples:
        turns, needles = len(s.conversation.turns), len(s.needles)
        print(f"{s.conversation.name}: {s.tokens} tokens, {turns} turn{'s' * (turns != 1)}, "
              f"{needles} needle{'s' * (needles != 1)}")
    print(f"wrote {out} and {manifest}")
    if context is not None and (longest := max(s.tokens for s in samples)) > context:
        print(f"kvlab: note: samples of up to {longest:,} tokens are longer than the trained context of "
              f"{Path(tokenizer.name_or_path).name} ({context:,} tokens): in original positions kvlab chat and arena "
              "refuse a conversation that does not fit the model they run on", file=sys.stderr)
    return 0
