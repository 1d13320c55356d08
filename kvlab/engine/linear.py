"""The model's linear layers on a few rows at a time, as weight @ inputᵀ on a CPU.

Side by side, a decoding step runs one row per policy through every linear layer. On CPU BLAS a float32
product of 2–8 rows as ``linear`` (input @ weightᵀ) takes a path that costs as much as computing each row
on its own, while the same product the other way round (weight @ inputᵀ) reads the weights once and costs
about one row's time (issue 23: SmolLM2's 210 linears, 5 rows, 17 ms against 23–34 ms as ``linear``, 17 ms
for one row). Each output is the same dot product either way round; one row and long prefills keep
``linear``.
"""

from __future__ import annotations

from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn

FEW_ROWS = range(2, 9)


def _few_rows_first(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` of x [..., in] → [..., out], as weight @ xᵀ when x holds a few rows on a CPU."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows not in FEW_ROWS or x.device.type != "cpu" or self.weight.dtype != torch.float32:
        return F.linear(x, self.weight, self.bias)
    out = torch.matmul(self.weight, x.reshape(rows, -1).T).T  # [rows, out]
    if self.bias is not None:
        out = out + self.bias
    return out.contiguous().view(*x.shape[:-1], -1)


def few_rows_first(model: nn.Module) -> None:
    """Give every ``nn.Linear`` of ``model`` the few-rows product (subclasses, which may compute otherwise,
    keep their own forward)."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.forward = MethodType(_few_rows_first, module)
