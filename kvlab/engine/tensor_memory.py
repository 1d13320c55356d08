"""Counting the tensor memory torch operations allocate: the bytes of storage live now, and their peak."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class TensorMemory(TorchDispatchMode):
    """Counts the bytes of tensor storage that torch operations create while active: live now and peak.

    Each new storage (an output that is not a view of an input) is added when an operation returns
    it and removed when the tensor that brought it in is freed. Kernel-internal scratch buffers are
    not tensors and are not seen; they are the same with and without attention statistics.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._storages: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # oneDNN's reordered weights (``engine.linear``) are opaque: they expose no storage, and no operation makes one
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and not t.is_mkldnn}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_mkldnn:
                storage = t.untyped_storage()
                ptr, size = storage.data_ptr(), storage.nbytes()
                if size == 0 or ptr in inputs or ptr in self._storages:
                    continue
                self._storages.add(ptr)
                self.live += size
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._release, ptr, size)
        return out

    def _release(self, ptr: int, size: int) -> None:
        self._storages.discard(ptr)
        self.live -= size
