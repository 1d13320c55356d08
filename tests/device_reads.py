"""A count of values read back from tensors (``item``, ``int``, ``bool``): on a GPU each waits for the device."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Reads(TorchDispatchMode):
    """Counts reads of a tensor's value by ``item``, ``int`` or ``bool`` (``tolist`` is not counted)."""

    count = 0

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: tuple, args: tuple = (),
                           kwargs: dict | None = None) -> object:
        Reads.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))
