"""MemoryRows: which memory row holds each request slot's sparse memory (SparseMemory's
`rows`). Without a row count every slot holds its own row (row_of[p] = p); with R rows
there are R + 1 of them, row 0 belonging to no request, and the host gives a row to a slot
and takes it back. Device-agnostic; no SGLang import."""

from __future__ import annotations

from typing import Optional

import torch


class MemoryRows:
    def __init__(self, max_slots: int, rows: Optional[int], device):
        self.count = None if rows is None else int(rows)
        # row_of [max_slots] int32, read by the kernels; its host copy holds the rows given out
        self.row_of = (torch.arange(max_slots, dtype=torch.int32, device=device) if rows is None
                       else torch.zeros(max_slots, dtype=torch.int32, device=device))
        self._held: dict[int, int] = {}
        self._free = list(range(self.count, 0, -1)) if rows is not None else []

    @property
    def allocated(self) -> int:
        """Rows the memory tensors need."""
        return self.row_of.shape[0] if self.count is None else self.count + 1

    @property
    def total(self) -> int:
        """Rows requests can hold: `count`, or one per slot."""
        return self.row_of.shape[0] if self.count is None else self.count

    @property
    def free(self) -> int:
        """Rows no slot holds (-1: one per slot)."""
        return -1 if self.count is None else len(self._free)

    def has(self, slot: int) -> bool:
        return self.count is None or slot in self._held

    def row(self, slot: int) -> int:
        """The slot's row, from the host copy (0: none)."""
        return slot if self.count is None else self._held.get(slot, 0)

    def give(self, slot: int) -> Optional[int]:
        """A free row for the slot (host), or None when none is free. The caller resets it."""
        if not self._free or slot in self._held:
            return None
        row = self._held[slot] = self._free.pop()
        self.row_of[slot] = row
        return row

    def take(self, slot: int) -> None:
        """The slot's row is free again; the slot reads row 0."""
        row = self._held.pop(slot, None)
        if row is not None:
            self.row_of[slot] = 0
            self._free.append(row)

    def kernel_arg(self) -> Optional[torch.Tensor]:
        """The kernels' row_of argument: None where every slot holds its own row."""
        return None if self.count is None else self.row_of

    def of(self, slots: torch.Tensor) -> torch.Tensor:
        """The rows of slots [b] int64 (device)."""
        return slots if self.count is None else self.row_of[slots].long()
