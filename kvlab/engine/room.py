"""Room: the storage a cache layer's keys and values grow into, so that a decoding step appends without a copy."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Room:
    """Storage [1, kv_heads, capacity, head_dim] for a layer's keys and values, which are views of its first ``end``
    slots: a decoding step writes its key in place instead of copying every key held (``torch.cat``).

    A layer appends in place only while its tensors are exactly those ``end`` slots; ``end`` never shrinks, so no
    other tensor (a snapshot, a state sharing the cache, a truncated view) sees a slot past it.
    """

    keys: torch.Tensor
    values: torch.Tensor
    end: int

    @classmethod
    def around(cls, keys: torch.Tensor, values: torch.Tensor, like: torch.Tensor, slots: int) -> "Room":
        """A room for ``slots`` slots and a sixteenth more (at least 16), holding ``keys``/``values`` [1, kv, n, d]
        first (n = 0 for an empty layer); ``like`` [1, kv, new, d] gives shape, dtype and device."""
        n = keys.shape[-2] if keys.ndim == 4 else 0
        shape = (1, like.shape[1], slots + max(16, slots // 16), like.shape[-1])
        room = cls(like.new_empty(shape), like.new_empty(shape), n)
        if n:
            room.keys[:, :, :n], room.values[:, :, :n] = keys, values
        return room

    def holds(self, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Whether ``keys``/``values`` are this room's first ``end`` slots."""
        return (keys.ndim == 4 and keys.shape[-2] == self.end and keys.data_ptr() == self.keys.data_ptr()
                and values.data_ptr() == self.values.data_ptr() and keys.stride() == self.keys.stride())
