"""Greedy answers after a strategy's prompt KV, and the teacher-forced logits fidelity is measured on."""

from __future__ import annotations

import torch

from kvlab.model import LoadedModel
from kvlab.rag.kv import SpanKV, cache_of, forward


def greedy(
    lm: LoadedModel, first_logits: torch.Tensor, kv: SpanKV, next_pos: int, n: int
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens after a prompt whose KV is ``kv`` → (tokens, logits that chose them [tokens, vocab])."""
    eos = lm.tokenizer.eos_token_id
    cache, logits, tokens = cache_of(lm, kv), [first_logits], []
    for step in range(n):
        token = int(logits[-1].argmax())
        tokens.append(token)
        if token == eos or step == n - 1:
            break
        out, cache = forward(lm, [token], torch.tensor([next_pos + step]), cache)
        logits.append(out[-1])
    return tokens, torch.stack(logits)


def teacher_forced(
    lm: LoadedModel, first_logits: torch.Tensor, kv: SpanKV, next_pos: int, tokens: list[int]
) -> torch.Tensor:
    """Next-token logits while feeding ``tokens`` after the prompt [len(tokens), vocab]."""
    if len(tokens) <= 1:
        return first_logits[None]
    out, _ = forward(lm, tokens[:-1], torch.arange(next_pos, next_pos + len(tokens) - 1), cache_of(lm, kv))
    return torch.cat([first_logits[None], out])
