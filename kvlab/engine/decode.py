"""Greedy decoding: the one loop and the one stop rule every kvlab generation follows.

A reply is the argmax tokens after the prompt; a stop token ends it and is not part of it; it
holds at most ``max_new_tokens`` tokens, and the last one is never fed back (nothing reads its
logits). ``Reply`` is that rule: ``greedy`` drives one cache with it, the batched decoder
(``batched_decode.generate_batched``) one ``Reply`` per row, and the benchmark's plain transformers baseline too.
"""

from __future__ import annotations

from typing import Callable

import torch

Step = Callable[[int, int], torch.Tensor]  # (token, step) -> logits [vocab] of the position after it
OnReply = Callable[[list[int]], None]  # the reply so far, after each token


class Reply:
    """A greedy reply being built, token by token: the stop rule in one place."""

    def __init__(self, max_new_tokens: int, stop_ids: set[int] | frozenset[int], on_token: OnReply | None = None
                 ) -> None:
        self.tokens: list[int] = []
        self.max_new_tokens, self.stop_ids, self.on_token = max_new_tokens, stop_ids, on_token
        self.done = max_new_tokens < 1

    def take(self, token: int) -> bool:
        """Add the next argmax token; True when it must be fed to get the next one (not a stop, not the last)."""
        if self.done:
            return False
        if token in self.stop_ids:
            self.done = True
            return False
        self.tokens.append(token)
        if self.on_token:
            self.on_token(self.tokens)
        self.done = len(self.tokens) == self.max_new_tokens
        return not self.done


def greedy(
    first_logits: torch.Tensor, step: Step, max_new_tokens: int, stop_ids: set[int] | frozenset[int],
    on_token: OnReply | None = None,
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy reply from ``first_logits`` [vocab], feeding each token with ``step``.

    Returns the reply and the logits that chose its tokens; the first ``len(logits) - 1`` reply
    tokens were fed.
    """
    reply = Reply(max_new_tokens, stop_ids, on_token)
    logits = [first_logits]
    while reply.take(token := int(logits[-1].argmax())):
        logits.append(step(token, len(reply.tokens) - 1))
    return reply.tokens, logits
