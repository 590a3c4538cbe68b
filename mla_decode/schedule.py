"""The work-balanced schedule of a decode batch: the batch's work cut into equal shares, one per part (a CTA or
program of a grid sized to the GPU), however unevenly the lengths spread. docs/2026-12-06-schedule.md gives the
design; this module is its reference: pure functions of the lengths, on any device, which the kernels' GPU twins must
reproduce exactly.

The cost line. Sequence b occupies the segment [start[b], start[b + 1]) of one line of integer cost units:
SEQUENCE_COST units for its fixed work (its Q, its output), then one unit per KV tile of TILE_ROWS rows it reads.
Part p takes the units [p * share, (p + 1) * share), share = ceil(total / parts). So:
  - a sequence lies in parts first_part(b) .. last_part(b), the parts its segment meets; each is one piece of it,
    and a piece may hold no tile (the part met only the fixed units): it weighs 0 in the merge;
  - a part is whole sequences in its middle and at most a tail piece of its first sequence and a head piece of its
    last one: two partial slots a part hold every piece that needs a merge (PIECE_SLOTS);
  - every part computes its own range from the prefix sums alone (a scan of the lengths and a binary search), so a
    GPU twin needs no table made before the decode, and a CPU one (this module) fills the same numbers in.
Lengths are clamped to [0, capacity] for the cut: an invalid length still gets its NaN from the kernel that reads it.
"""

from typing import NamedTuple

import torch

TILE_ROWS = 64  # KV rows a unit of work reads: the kernels' tile (the cuda kernels' BLOCK_N)
SEQUENCE_COST = 1  # a sequence's fixed cost in tiles (Q staged, the output written): also keeps length 0 on the line
PIECE_SLOTS = 2  # partial slots a part holds: the tail of its first sequence and the head of its last


class Schedule(NamedTuple):
    """The cut of one batch into `parts` shares. Tensors on the lengths' device, int32 (int64 on the CPU reference
    where sums could pass 2^31)."""

    parts: int
    share: int  # cost units a part takes (the last part may take fewer)
    start: torch.Tensor  # (batch + 1,): sequence b's segment starts at start[b]; start[batch] is the total
    tiles: torch.Tensor  # (batch,): the KV tiles of each sequence (its clamped length / TILE_ROWS, rounded up)

    def first_part(self, b: torch.Tensor | int) -> torch.Tensor:
        """The part holding sequence b's first unit."""
        return torch.as_tensor(self.start[b]) // self.share

    def last_part(self, b: torch.Tensor | int) -> torch.Tensor:
        """The part holding sequence b's last unit."""
        return (torch.as_tensor(self.start[torch.as_tensor(b) + 1]) - 1) // self.share

    def part_range(self, p: int) -> tuple[int, int]:
        """The sequences part p touches, [first, last] (first > last for a part past the total)."""
        lo, hi = p * self.share, min((p + 1) * self.share, int(self.start[-1]))
        first = int(torch.searchsorted(self.start, torch.tensor(lo, dtype=self.start.dtype), right=True)) - 1
        last = int(torch.searchsorted(self.start, torch.tensor(hi - 1, dtype=self.start.dtype), right=True)) - 1
        return first, last if hi > lo else first - 1

    def piece_tiles(self, p: int, b: int) -> tuple[int, int]:
        """The tiles [lo, hi) of sequence b that part p reads (lo == hi: a piece of no tile, or none)."""
        tiles_from = int(self.start[b]) + SEQUENCE_COST  # the line position of b's tile 0
        lo = max(p * self.share, tiles_from) - tiles_from
        hi = min((p + 1) * self.share, int(self.start[b + 1])) - tiles_from
        return max(lo, 0), max(hi, max(lo, 0))

    def slot(self, p: int, b: int) -> int:
        """The partial slot of part p where sequence b's piece goes: 0 for the part's first sequence, 1 for its
        last (a part's middle sequences are whole and need none)."""
        return 0 if b == self.part_range(p)[0] else 1


def sequence_tiles(lengths: torch.Tensor, capacity: int) -> torch.Tensor:
    """KV tiles of each sequence: its length clamped to [0, capacity], in TILE_ROWS rows, rounded up."""
    return (lengths.clamp(0, capacity) + (TILE_ROWS - 1)) // TILE_ROWS


def make_schedule(lengths: torch.Tensor, parts: int, capacity: int) -> Schedule:
    """The schedule of a batch of `lengths` (batch,) int32 cut into `parts` shares; capacity: the most rows a
    sequence can hold (the page table's rows, or the ragged plan's longest). Reads no length on the host but the
    total, which only the CPU reference needs (a GPU twin keeps it on the device)."""
    if parts < 1:
        raise ValueError(f"parts: expected >= 1, got {parts}")
    tiles = sequence_tiles(lengths.long(), capacity)
    start = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(tiles + SEQUENCE_COST, 0, out=start[1:])
    total = int(start[-1])
    return Schedule(parts, max(1, -(-total // parts)), start, tiles)


def schedule_parts(sms: int, ctas_per_sm: int, row_groups: int) -> int:
    """Parts of a grid whose CTAs must all be resident (the merge's barrier waits on them): ctas_per_sm x SMs CTAs,
    each row group of a sequence (q_len x heads / unit rows) running the same schedule."""
    return max(1, ctas_per_sm * sms // max(1, row_groups))
