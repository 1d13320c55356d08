"""The one stop rule: a stop token ends a reply and is not part of it, at most max_new_tokens, the last never fed."""

from __future__ import annotations

import pytest
import torch

from kvlab.engine.decode import Reply, greedy

VOCAB = 8


def one_hot(token: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(token), VOCAB).float()  # [vocab]


@pytest.mark.parametrize("script, max_new, stop, reply, fed", [
    ([3, 4, 5, 6], 4, set(), [3, 4, 5, 6], [3, 4, 5]),  # the last token is never fed
    ([3, 4, 7, 6], 4, {7}, [3, 4], [3, 4]),  # the stop token ends it and is not kept
    ([7, 4], 4, {7}, [], []),
    ([3, 4, 5], 1, set(), [3], []),
    ([3], 0, set(), [], []),
])
def test_greedy_follows_the_stop_rule(script: list[int], max_new: int, stop: set[int], reply: list[int],
                                      fed: list[int]) -> None:
    steps: list[tuple[int, int]] = []

    def step(token: int, i: int) -> torch.Tensor:
        steps.append((token, i))
        return one_hot(script[i + 1])

    seen: list[list[int]] = []
    out, logits = greedy(one_hot(script[0]), step, max_new, stop, lambda ids: seen.append(list(ids)))
    assert out == reply and steps == [(t, i) for i, t in enumerate(fed)] and len(logits) == len(fed) + 1
    assert seen == [reply[: i + 1] for i in range(len(reply))]


def test_a_reply_takes_nothing_once_done() -> None:
    r = Reply(2, {7})
    assert r.take(1) and not r.take(2) and r.done
    assert not r.take(3) and r.tokens == [1, 2]
