"""Calibrate the retrieval workloads: how often does a plain full forward find each pass key?

Per scored turn the prompt is a full re-prefill of the chat-template history (golden replies kept)
+ the current user message + the assistant start + the turn's prefill; the model then decodes a few
tokens greedily and the turn counts as correct when its ``answer`` occurs in the continuation.
Nothing is cached between turns or sessions. DESIGN.md asks Full to score at least 75%.

    .venv/bin/python benchmarks/calibrate_retrieval.py [FILES...] [--tokens 8] [--min 0.75]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvlab.engine.facts import LoadedModel
from kvlab.engine.model import load_model  # noqa: E402
from kvlab.errors import KvlabError  # noqa: E402
from kvlab.workloads.chat.conversation import Conversation, chat_messages, list_workloads, load_conversation  # noqa: E402

RETRIEVAL = Path(__file__).resolve().parents[1] / "data" / "retrieval"


def turn_prompt(lm: LoadedModel, conv: Conversation, turn: int) -> list[int]:
    """Token ids of the chat-template prompt for ``turn`` with its prefill appended."""
    text = lm.tokenizer.apply_chat_template(chat_messages(conv, turn), add_generation_prompt=True, tokenize=False)
    return lm.encode(text + conv.turns[turn].prefill)


def session_tokens(lm: LoadedModel, conv: Conversation) -> int:
    """Length of the whole session (every turn and golden reply) under the chat template."""
    ids = turn_prompt(lm, conv, len(conv.turns) - 1)
    last = conv.turns[-1]
    return len(ids) + (len(lm.encode(last.golden[len(last.prefill):])) if last.golden else 0)


def continuation(lm: LoadedModel, ids: list[int], max_new_tokens: int) -> str:
    """Greedy continuation of ``ids`` by a plain ``generate`` (fresh cache)."""
    inputs = torch.tensor([ids], device=lm.device)  # [1, tokens]
    with lm.lock, torch.inference_mode():
        out = lm.model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_new_tokens,
                                do_sample=False, pad_token_id=lm.tokenizer.eos_token_id)
    return lm.decode(out[0, len(ids):].tolist())


def calibrate(lm: LoadedModel, paths: list[Path], max_new_tokens: int) -> tuple[int, int]:
    """Score every session; print per-turn results and a per-session line. Returns (right, asked)."""
    right = asked = 0
    for path in paths:
        conv = load_conversation(path)
        scored = [i for i, t in enumerate(conv.turns) if t.answer is not None]
        if not scored:
            continue
        marks = []
        for i in tqdm(scored, desc=conv.name, leave=False):
            ids = turn_prompt(lm, conv, i)
            cont = continuation(lm, ids, max_new_tokens)
            ok = conv.turns[i].answer in cont
            marks.append(ok)
            tqdm.write(f"  {'+' if ok else '-'} turn {i + 1} [{len(ids)} tok] {conv.turns[i].prefill}"
                       f"{cont!r} (expected {conv.turns[i].answer})")
        right, asked = right + sum(marks), asked + len(marks)
        print(f"{conv.name:28s} {sum(marks)}/{len(marks)}  ({session_tokens(lm, conv)} tokens)", flush=True)
    return right, asked


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, help="session files (default: all of data/retrieval)")
    parser.add_argument("--tokens", type=int, default=8, help="greedy tokens decoded after the prefill")
    parser.add_argument("--min", type=float, default=0.75, help="required share of correct answers")
    args = parser.parse_args()
    lm = load_model(device="cpu", dtype="float32")
    try:
        right, asked = calibrate(lm, args.files or list_workloads(RETRIEVAL), args.tokens)
    except KvlabError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    share = right / asked if asked else 0.0
    print(f"total {right}/{asked} = {share:.0%} (required {args.min:.0%})")
    return 0 if share >= args.min else 1


if __name__ == "__main__":
    sys.exit(main())
