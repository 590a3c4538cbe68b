"""The work-balanced schedule of a decode batch: the batch's work cut into equal shares, one per part (a CTA or
program of a grid sized to the GPU), however unevenly the lengths spread. docs/2026-12-06-schedule.md gives the
design; this module is its reference: pure functions of the lengths, on any device, which the kernels' GPU twins must
reproduce exactly.

The cost line. Sequence b occupies the segment [start[b], start[b + 1]) of one line of integer cost units:
SEQUENCE_COST units for its fixed work (its Q, its output), then one unit per KV tile it reads (TILE_ROWS rows, or
the kernel's own tile: the triton plans' block_n, so that a piece's bounds are whole tiles of its walk).
Part p takes the units [p * share, (p + 1) * share), share = max(ceil(total / parts), min_share). So:
  - a sequence lies in parts first_part(b) .. last_part(b), the parts its segment meets; each is one piece of it,
    and a piece may hold no tile (the part met only the fixed units): it weighs 0 in the merge;
  - a part is whole sequences in its middle and at most a tail piece of its first sequence and a head piece of its
    last one, so a batch has at most parts + batch - 1 pieces (each share boundary adds one): a partial slot each;
  - the whole cut follows from the prefix sums of the costs: one scan of the lengths, which the cuda backend's
    schedule kernel (csrc/schedule.cuh) and the triton backend's (triton/kernels.py) make on the GPU, listing the
    pieces as schedule_items does here.
A length outside [0, capacity] is invalid: it costs its fixed units alone (no tile), and the kernel that reads it
makes its rows NaN.
"""

import bisect
import math
from typing import NamedTuple

import torch

TILE_ROWS = 64  # KV rows a unit of work reads: the kernels' tile (the cuda kernels' BLOCK_N)
SEQUENCE_COST = 1  # a sequence's fixed cost in tiles (Q staged, the output written): also keeps length 0 on the line
# How a plan cuts the work (the cuda and triton backends' option): "balanced", this module's schedule, or "fixed",
# the same number of equal splits for every sequence, sized by the plan's longest
SCHEDULES = ("fixed", "balanced")
# How a balanced schedule cuts its line: "line", equal shares anywhere (make_schedule); "fill", parts filled in turn,
# a sequence whole where it fits and each piece charged PIECE_COST (fill_schedule); or "pack", the fill from the
# longest sequence that fits whole (pack_schedule). The cuda backend's option
CUTS = ("line", "fill", "pack")
PACK_MAX_BATCH = 4096  # the pack cut's largest batch: its schedule kernel sorts the batch in shared memory
PIECE_COST = SEQUENCE_COST  # the fill cut's fixed cost of every piece, in tiles (its Q, its partial or output)


class Schedule(NamedTuple):
    """The cut of one batch into `parts` shares. Tensors on the lengths' device, int32 (int64 on the CPU reference
    where sums could pass 2^31)."""

    parts: int
    share: int  # cost units a part takes (the last part may take fewer)
    start: torch.Tensor  # (batch + 1,): sequence b's segment starts at start[b]; start[batch] is the total
    tiles: torch.Tensor  # (batch,): the KV tiles of each sequence (its clamped length / the tile rows, rounded up)

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


def sequence_tiles(lengths: torch.Tensor, capacity: int, tile_rows: int = TILE_ROWS) -> torch.Tensor:
    """KV tiles of each sequence: its length in tile_rows rows, rounded up; 0 for a length outside [0, capacity]."""
    valid = (lengths >= 0) & (lengths <= capacity)
    return torch.where(valid, lengths, 0).add(tile_rows - 1).div(tile_rows, rounding_mode="floor")


def make_schedule(lengths: torch.Tensor, parts: int, capacity: int, tile_rows: int = TILE_ROWS,
                  min_share: int = 1) -> Schedule:
    """The schedule of a batch of `lengths` (batch,) int32 cut into `parts` shares of tiles of `tile_rows` rows, each
    at least `min_share` units (a batch of little work then takes fewer parts, in larger pieces; the parts past the
    line's end take none); capacity: the most rows a sequence can hold (the page table's rows, or the ragged plan's
    longest). Reads no length on the host but the total, which only the CPU reference needs (a GPU twin keeps it on
    the device)."""
    if parts < 1:
        raise ValueError(f"parts: expected >= 1, got {parts}")
    if min_share < 1:
        raise ValueError(f"min_share: expected >= 1, got {min_share}")
    tiles = sequence_tiles(lengths.long(), capacity, tile_rows)
    start = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(tiles + SEQUENCE_COST, 0, out=start[1:])
    total = int(start[-1])
    return Schedule(parts, max(min_share, -(-total // parts)), start, tiles)


def schedule_items(schedule: Schedule, max_items: int) -> torch.Tensor:
    """The pieces of `schedule` in line order, as the schedule kernel lists them: (max_items, 4) int32 rows {b, first
    tile, end tile, index << 16 | count} (piece `index` of sequence b's `count`), then {-1, 0, 0, 0}."""
    items = torch.tensor([[-1, 0, 0, 0]], dtype=torch.int32).repeat(max_items, 1)
    k = 0
    for b in range(schedule.tiles.shape[0]):
        first, last = int(schedule.first_part(b)), int(schedule.last_part(b))
        count = last - first + 1
        for j in range(count):
            lo, hi = schedule.piece_tiles(first + j, b)
            items[k] = torch.tensor([b, lo, hi, j << 16 | count], dtype=torch.int32)
            k += 1
    return items


def part_first(schedule: Schedule) -> torch.Tensor:
    """(parts + 1,) int32: part p's pieces are schedule_items' rows part_first[p] .. part_first[p + 1] - 1 (the pieces
    in line order whose part is below p), as the cuda schedule kernel lists them after its items; parts past the
    line's end take none."""
    pieces = [int(schedule.first_part(b)) + j for b in range(schedule.tiles.shape[0])
              for j in range(int(schedule.last_part(b)) - int(schedule.first_part(b)) + 1)]
    of_part = torch.tensor(pieces, dtype=torch.int64)
    return torch.searchsorted(of_part, torch.arange(schedule.parts + 1), right=False).int()



class _Walk:
    """The fill and pack cuts' walk over a batch of `lengths`: parts filled in turn with payload = make_schedule's
    share + PIECE_COST units each (the last takes the rest), items listed as the parts take them."""

    def __init__(self, lengths: torch.Tensor, parts: int, capacity: int, tile_rows: int, min_share: int, slack: int):
        if slack < 0:
            raise ValueError(f"slack: expected >= 0, got {slack}")
        line = make_schedule(lengths, parts, capacity, tile_rows, min_share)  # the share, as the cuts' kernels take it
        self.tiles: list[int] = line.tiles.tolist()
        self.parts, self.payload, self.slack = parts, line.share + PIECE_COST, slack
        self.items: list[list[int]] = []
        self.starts = [0]  # starts[p]: part p's first item
        self.room = self.payload if parts > 1 else None  # None: the last part, which takes the rest

    def most_tiles(self) -> float:
        """The most tiles that fit the part whole, with PIECE_COST, within payload + slack (inf in the last part)."""
        return math.inf if self.room is None else self.room + self.slack - PIECE_COST

    def fits(self, tiles: int) -> bool:
        return tiles <= self.most_tiles()

    def next_part(self) -> None:
        self.starts.append(len(self.items))
        self.room = self.payload if len(self.starts) < self.parts else None

    def place(self, b: int, left: int) -> None:
        """Sequence b's `left` tiles from this part on: whole where they fit, else what fits (where more than
        PIECE_COST of the payload is left) and the rest from the next part; its pieces then get their index and
        count."""
        first, lo = len(self.items), 0
        while True:
            if self.fits(left):
                self.items.append([b, lo, lo + left])
                self.room = None if self.room is None else self.room - left - PIECE_COST
                break
            if self.room > PIECE_COST:
                take = self.room - PIECE_COST
                self.items.append([b, lo, lo + take])
                lo, left = lo + take, left - take
            self.next_part()
        count = len(self.items) - first
        for j in range(count):
            self.items[first + j].append(j << 16 | count)

    def flat(self, max_items: int | None) -> torch.Tensor:
        """(max_items * 4 + parts + 1,) int32 (max_items: parts + batch by default): the items, padding {-1, 0, 0,
        0}, then part_first (parts + 1,)."""
        max_items = self.parts + len(self.tiles) if max_items is None else max_items
        starts = self.starts + [len(self.items)] * (self.parts + 1 - len(self.starts))
        flat = torch.tensor([-1, 0, 0, 0], dtype=torch.int32).repeat(max_items, 1)
        if self.items:
            flat[:len(self.items)] = torch.tensor(self.items, dtype=torch.int32)
        return torch.cat([flat.flatten(), torch.tensor(starts, dtype=torch.int32)])


def fill_schedule(lengths: torch.Tensor, parts: int, capacity: int, tile_rows: int = TILE_ROWS, min_share: int = 1,
                  max_items: int | None = None, slack: int = 0) -> torch.Tensor:
    """The fill cut of a batch of `lengths` (batch,) into `parts` parts, as the cuda schedule kernel makes it when its
    plan's cut is "fill": each part holds `payload` = make_schedule's share (max(ceil(total / parts), min_share), total
    being the line's length) + PIECE_COST units, and up to `slack` units more to keep a sequence whole. Parts are
    filled in turn: a sequence (its rest) goes whole into the part where its tiles and PIECE_COST fit within payload +
    slack; else, where more than PIECE_COST of the payload is left, the part takes what fits and the rest goes on in
    the next part; else the next part starts it. So a sequence is cut only where the share ends inside it, its pieces
    lie in consecutive parts (piece j in the part of piece 0, plus j), a piece of a cut sequence holds more than
    nothing but its last, and a batch of equal sequences that divides into the parts, or overfills them by at most
    slack, is not cut at all, where the line cuts every one (slack trades a part that long for the partials and the
    merge of a cut). The last part takes whatever is left (the walk never leaves any: each part but the last takes at
    least ceil(total / parts) units net of its own cut).
    Returns (max_items * 4 + parts + 1,) int32 (max_items: parts + batch by default): the pieces in order as
    schedule_items lists them, padding {-1, 0, 0, 0}, then part_first (parts + 1,)."""
    walk = _Walk(lengths, parts, capacity, tile_rows, min_share, slack)
    for b, left in enumerate(walk.tiles):
        walk.place(b, left)
    return walk.flat(max_items)


def pack_schedule(lengths: torch.Tensor, parts: int, capacity: int, tile_rows: int = TILE_ROWS, min_share: int = 1,
                  max_items: int | None = None, slack: int = 0) -> torch.Tensor:
    """The pack cut, as the cuda schedule kernel makes it when its plan's cut is "pack": the fill cut's parts, payload
    and slack, but each part takes, of the sequences not yet placed, the longest whose tiles and PIECE_COST fit whole
    within payload + slack (ties: the lower index). Where none fits and more than PIECE_COST of the payload is left,
    the longest left is cut as the fill cuts it (what fits here, the rest from the next part on); else the next part
    starts. A batch of uneven lengths then has few sequences cut (a part ends in a cut only where no sequence left
    fits its room), every piece of a cut sequence still in consecutive parts. Sequences are listed in the order they
    are placed, not the batch's; lengths past PACK_MAX_BATCH are refused (the kernel sorts them in shared memory).
    Returns fill_schedule's layout."""
    if lengths.shape[0] > PACK_MAX_BATCH:
        raise ValueError(f"lengths: the pack cut takes at most {PACK_MAX_BATCH} sequences, got {lengths.shape[0]}")
    walk = _Walk(lengths, parts, capacity, tile_rows, min_share, slack)
    tiles = walk.tiles
    left = sorted(range(len(tiles)), key=lambda b: (-tiles[b], b))  # not placed yet, longest first
    while left:
        i = bisect.bisect_left(left, -walk.most_tiles(), key=lambda b: -tiles[b])  # the first that fits whole
        if i < len(left):
            b = left.pop(i)
            walk.place(b, tiles[b])
        elif walk.room > PIECE_COST:
            b = left.pop(0)
            walk.place(b, tiles[b])
        else:
            walk.next_part()
    return walk.flat(max_items)
