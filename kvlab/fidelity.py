"""How far a policy's next-token distributions are from Full's on the same tokens."""

from __future__ import annotations

import torch


def kl_per_position(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(reference ‖ other) in nats for logits [positions, vocab] → [positions]."""
    p_log = torch.log_softmax(reference.float(), dim=-1)
    q_log = torch.log_softmax(other.float(), dim=-1)
    return (p_log.exp() * (p_log - q_log)).sum(dim=-1).clamp_min(0.0)


def fidelity(reference: torch.Tensor, other: torch.Tensor) -> dict[str, float]:
    """Mean KL and top-1 agreement of two logit sequences [positions, vocab] over the same tokens."""
    if reference.shape != other.shape:
        raise ValueError(f"logit shapes differ: {tuple(reference.shape)} vs {tuple(other.shape)}")
    if reference.shape[0] == 0:
        return {"kl": 0.0, "top1": 1.0}
    kl = kl_per_position(reference, other)
    agree = (reference.argmax(-1) == other.argmax(-1)).float()
    return {"kl": float(kl.mean()), "top1": float(agree.mean())}
