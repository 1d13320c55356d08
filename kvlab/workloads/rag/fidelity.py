"""Greedy answers after a strategy's prompt KV, and the teacher-forced logits fidelity is measured on."""

from __future__ import annotations

import torch

from kvlab.engine.decode import greedy
from kvlab.engine.facts import LoadedModel
from kvlab.workloads.rag.kv import SpanKV, cache_of, forward


def greedy_answer(
    lm: LoadedModel, first_logits: torch.Tensor, kv: SpanKV, next_pos: int, n: int, stop_ids: frozenset[int]
) -> tuple[list[int], torch.Tensor]:
    """``decode.greedy`` after a prompt whose KV is ``kv`` → (tokens, logits that chose them [fed + 1, vocab])."""
    cache = cache_of(lm, kv)

    def step(token: int, i: int) -> torch.Tensor:
        return forward(lm, [token], torch.tensor([next_pos + i]), cache)[0][-1]

    tokens, logits = greedy(first_logits, step, n, stop_ids)
    return tokens, torch.stack(logits)


def teacher_forced(
    lm: LoadedModel, first_logits: torch.Tensor, kv: SpanKV, next_pos: int, tokens: list[int]
) -> torch.Tensor:
    """Next-token logits while feeding ``tokens`` after the prompt [len(tokens), vocab]."""
    if len(tokens) <= 1:
        return first_logits[None]
    out, _ = forward(lm, tokens[:-1], torch.arange(next_pos, next_pos + len(tokens) - 1), cache_of(lm, kv))
    return torch.cat([first_logits[None], out])
