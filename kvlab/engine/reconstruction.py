"""KVzip's reconstruction pass: the model repeats the new tokens, and each key is scored by the most attention a
repeating query gives it.

Reference: snu-mllab/KVzip ``model/wrapper.py`` (``ModelKVzip.self_task`` builds the repeat inputs,
``scoring`` runs them) and ``attention/score.py`` (``KVScore._get_score``), as kvpress ports them
(``kvpress/presses/kvzip_press.py``). The tokens to score are cut into chunks of ``chunk_size``; chunk
*i* is scored by one forward over the cache of

    "\\n\\nRepeat the previous context exactly."                                 (the first chunk)
    "\\n\\nRepeat the part of the previous context exactly, starting with " + the previous chunk's last 8 tokens
    + the chat template's end of a user message and generation prompt + the chunk's own tokens again,

each forward run on the cache as it is and thrown away afterwards (the authors' ``update_cache=False``:
the repeat's own keys and values are never kept). Its queries' attention is the model's own, over every
key the cache holds; the score, as ``_get_score`` computes it, takes each query's softmax over the first
``n_sink`` keys, the chunk's keys and the repeat's own keys (causally) only, then the maximum over the
repeat's queries and over the query heads of each KV head. The suffix is read off the model's chat
template as kvpress does (for the authors' Llama / Qwen / Gemma templates it is their ``postfix``), and
is ``"\\n"`` for a model without one (kvpress's default).

In a conversation the tokens to score are those appended since the last pass (a user message, then a
reply): each is reconstructed once, when it arrives, and its scores stay with its slots
(``SlotLayer.reconstruction``) through later evictions, never recomputed. The pass costs an extra prefill of
about the new tokens' length again; ``Repeat`` says how many tokens it ran and how long it took.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from kvlab.engine.attention import Probe
from kvlab.engine.chatformat import chat_format, uses_plain_format
from kvlab.engine.kvstate import KVState, to_kv_heads_max
from kvlab.engine.timing import clock
from kvlab.errors import KvlabError

FIRST_PROMPT = "\n\nRepeat the previous context exactly."
NEXT_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with "
CHUNK_SIZE = 2000  # ModelKVzip.self_task's chunk_size (kvpress: 2048)
PREV_POSTFIX = 8  # the previous chunk's last tokens that start a later chunk's prompt (prev_postfix_size)
NO_TEMPLATE_SUFFIX = "\n"  # kvpress's suffix for a model without a chat template


@dataclass(frozen=True)
class RepeatSpec:
    """How a policy's reconstruction pass runs: the sinks each score's softmax includes, and the chunk size."""

    n_sink: int = 4
    chunk_size: int = CHUNK_SIZE


@dataclass(frozen=True)
class Repeat:
    """What one reconstruction pass cost: the tokens run through the model, their chunks, and the seconds."""

    tokens: int = 0
    chunks: int = 0
    seconds: float = 0.0


@functools.lru_cache(maxsize=8)
def repeat_suffix(tokenizer: PreTrainedTokenizerBase) -> str:
    """The text between the repeat prompt and the repeated tokens: the end of a user message and the assistant's
    generation prompt, from the chat template (kvpress's rule); ``"\\n"`` without a template."""
    if uses_plain_format(tokenizer):
        return NO_TEMPLATE_SUFFIX
    return chat_format(tokenizer, None).user_suffix


def repeat_inputs(encode, suffix: str, ids: list[int], chunk_size: int = CHUNK_SIZE
                  ) -> list[tuple[int, int, list[int]]]:
    """(start, end, repeat ids) per chunk of ``ids``: the chunk ``ids[start:end]`` and the tokens whose forward
    scores it (``ModelKVzip.self_task``). ``encode`` turns text into ids without special tokens."""
    suffix_ids = encode(suffix)
    out = []
    for start in range(0, len(ids), chunk_size):
        chunk = ids[start : start + chunk_size]
        if start == 0:
            prompt = encode(FIRST_PROMPT)
        else:
            prompt = encode(NEXT_PROMPT) + ids[max(0, start - PREV_POSTFIX) : start]
        out.append((start, start + len(chunk), prompt + suffix_ids + chunk))
    return out


def _score_over(state: KVState, low: int, high: int, n_sink: int) -> list[torch.Tensor]:
    """Per layer [kv_heads, slots]: the slots a chunk's score softmax runs over (sinks and the chunk, no padding)."""
    out = []
    for lay in state.layers:
        pos = lay.positions
        out.append(lay.real & (((pos >= low) & (pos < high)) | ((pos >= 0) & (pos < n_sink))))
    return out


@torch.no_grad()
def reconstruct(state: KVState, spec: RepeatSpec) -> Repeat:
    """Score every slot appended since the last pass by reconstructing those tokens; the cache is left as it was.

    Each chunk's forward runs on the cache as it is and is undone (``snapshot`` / ``restore``); the slots of
    the chunk get their scores in ``SlotLayer.reconstruction`` and ``state.reconstructed`` moves to ``seen``.
    """
    begin, end = state.reconstructed, state.seen
    if begin >= end:
        return Repeat()
    if state.lm.tokenizer is None:
        raise KvlabError("KVzip's reconstruction pass needs the model's tokenizer to write its repeat prompt")
    t0 = clock()
    lm = state.lm
    inputs = repeat_inputs(lm.encode, repeat_suffix(lm.tokenizer), state.tokens[begin:end], spec.chunk_size)
    tokens = 0
    for start, stop, ids in inputs:
        low, high = begin + start, begin + stop
        probe = Probe(colmax_over=_score_over(state, low, high, spec.n_sink))
        saved = state.snapshot()
        try:
            state.forward(torch.tensor(ids, device=lm.device), state.next_positions(len(ids)), probe,
                          logits_to_keep=1)
        finally:
            state.restore(saved)  # the repeat's own keys and values are never kept
        tokens += len(ids)
        for layer, lay in enumerate(state.layers):
            per_kv = to_kv_heads_max(probe.colmaxes[layer][:, : lay.held], lm.facts.n_kv_heads)  # [kv_heads, slots]
            pos = lay.positions
            lay.rescore("reconstruction", lay.real & (pos >= low) & (pos < high), per_kv)
    state.reconstructed = end
    return Repeat(tokens=tokens, chunks=len(inputs), seconds=clock() - t0)
