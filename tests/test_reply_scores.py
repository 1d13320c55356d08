"""A reply's fidelity scores take Full's predictions as the reference whatever order the batches hand them over in."""

from __future__ import annotations

import pytest
import torch

from kvlab.engine.fidelity import fidelity
from kvlab.workloads.chat.records import PolicyTurn
from kvlab.workloads.chat.scoring import ReplyScores

NAMES = ("full", "h2o", "window")


def logits() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per policy: the logits that predicted a 5-token reply's first token [1, vocab], and the fed ones [5, vocab]."""
    gen = torch.Generator().manual_seed(0)
    before = {n: torch.randn(1, 11, generator=gen) for n in NAMES}
    return before, {n: torch.randn(5, 11, generator=gen) for n in NAMES}


@pytest.mark.parametrize("order", [("full", "h2o", "window"), ("h2o", "full", "window"), ("window", "h2o", "full")])
def test_every_order_scores_against_full(order: tuple[str, ...]) -> None:
    before, fed = logits()
    records = {n: PolicyTurn(policy=n) for n in NAMES}
    scores = ReplyScores(before, records)
    for name in order:
        scores(name, fed[name])
    reference = torch.cat([before["full"], fed["full"][:-1]])
    for name in NAMES:
        by_hand = fidelity(reference, torch.cat([before[name], fed[name][:-1]]))
        assert (records[name].kl, records[name].top1) == (by_hand.kl, by_hand.top1)
    assert records["full"].kl == 0.0 and records["full"].top1 == 1.0
    assert records["h2o"].kl > 0.0  # a different prediction, scored, not skipped
