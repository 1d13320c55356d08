"""How far next-token distributions are from a reference's on the same tokens (policies, strategies, schemes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def kl_per_position(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(reference ‖ other) in nats for logits [positions, vocab] → [positions]."""
    p_log = torch.log_softmax(reference.float(), dim=-1)
    q_log = torch.log_softmax(other.float(), dim=-1)
    return (p_log.exp() * (p_log - q_log)).sum(dim=-1).clamp_min(0.0)


@dataclass(frozen=True)
class Fidelity:
    """Agreement of two logit sequences over the same positions."""

    kl: float  # mean KL(reference ‖ other), nats
    kl_max: float
    top1: float  # share of positions with the same argmax
    positions: int


def fidelity(reference: torch.Tensor, other: torch.Tensor) -> Fidelity:
    """Compare logits [positions, vocab] position by position."""
    if reference.shape != other.shape:
        raise ValueError(f"logit shapes differ: {tuple(reference.shape)} vs {tuple(other.shape)}")
    if reference.shape[0] == 0:
        return Fidelity(kl=0.0, kl_max=0.0, top1=1.0, positions=0)
    kl = kl_per_position(reference, other)
    agree = (reference.argmax(-1) == other.argmax(-1)).float()
    return Fidelity(kl=float(kl.mean()), kl_max=float(kl.max()), top1=float(agree.mean()),
                    positions=int(reference.shape[0]))
