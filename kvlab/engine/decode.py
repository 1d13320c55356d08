"""Greedy decoding: the one loop and the one stop rule every kvlab generation follows.

A reply is the argmax tokens after the prompt; a stop token ends it and is not part of it; it
holds at most ``max_new_tokens`` tokens, and the last one is never fed back (nothing reads its
logits). Batched decoding (``batched._decode_rows``) applies the same rule row by row.
"""

from __future__ import annotations

from typing import Callable

import torch

Step = Callable[[int, int], torch.Tensor]  # (token, step) -> logits [vocab] of the position after it
OnReply = Callable[[list[int]], None]  # the reply so far, after each token


def greedy(
    first_logits: torch.Tensor, step: Step, max_new_tokens: int, stop_ids: set[int] | frozenset[int],
    on_token: OnReply | None = None,
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy reply from ``first_logits`` [vocab], feeding each token with ``step``.

    Returns the reply and the logits that chose its tokens; the first ``len(logits) - 1`` reply
    tokens were fed.
    """
    out: list[int] = []
    logits = [first_logits]
    for i in range(max_new_tokens):
        token = int(logits[-1].argmax())
        if token in stop_ids:
            break
        out.append(token)
        if on_token:
            on_token(out)
        if i + 1 == max_new_tokens:
            break
        logits.append(step(token, i))
    return out, logits
