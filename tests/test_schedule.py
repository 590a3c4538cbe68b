"""The work-balanced schedule (mla_decode/schedule.py) as a pure function on the CPU: every (sequence, tile) taken
exactly once, by the parts and by the listed pieces (schedule_items, the cuda schedule kernel's twin), no part over
the mean by more than one unit, at most parts + batch - 1 pieces, and a decode merged from its pieces equal to the
whole decode in float64. Each check is shown to fail on a planted bug."""

import math

import pytest
import torch

import mla_decode.schedule as sched
from mla_decode.cuda.plan import MAX_PIECES, balanced_parts
from mla_decode.schedule import (
    PIECE_COST,
    SEQUENCE_COST,
    TILE_ROWS,
    Schedule,
    fill_schedule,
    make_schedule,
    pack_schedule,
    part_first,
    schedule_items,
    sequence_tiles,
)

CAPACITY = 1 << 16


def spread(batch: int, kind: str, seed: int) -> torch.Tensor:
    """Lengths of a batch: "normal" (mean 4096, sd 2048, as FlashMLA's test draws), "lognormal" (median 2k, a tail
    past 32k), "edges" (0, 1, 63, 64, 65 and odd lengths), "one-long" (one 64k sequence among 1k ones)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "normal":
        lengths = (torch.randn(batch, generator=gen) * 2048 + 4096).clamp(min=1)
    elif kind == "lognormal":
        lengths = torch.exp(torch.randn(batch, generator=gen) * 1.2 + math.log(2048))
    elif kind == "edges":
        lengths = torch.tensor([0, 1, 63, 64, 65, 127, 1001, 0][:batch] * (batch // 8 + 1))[:batch].float()
    else:
        lengths = torch.full((batch,), 1024.0)
        lengths[batch // 2] = 65536
    return lengths.clamp(max=CAPACITY).int()


def coverage(s: Schedule) -> list[torch.Tensor]:
    """How many times each tile of each sequence is read across the parts."""
    counts = [torch.zeros(int(t), dtype=torch.int64) for t in s.tiles]
    for p in range(s.parts):
        first, last = s.part_range(p)
        for b in range(first, last + 1):
            lo, hi = s.piece_tiles(p, b)
            counts[b][lo:hi] += 1
    return counts


def item_coverage(items: torch.Tensor, tiles: torch.Tensor, order: list[int] | None = None) -> list[torch.Tensor]:
    """How many times each tile of each sequence is read across the listed pieces; each sequence's pieces are listed
    together, in order, with their index and count, and the sequences in `order` (default: the batch's; the pack cut
    lists them as it places them)."""
    counts = [torch.zeros(int(t), dtype=torch.int64) for t in tiles]
    listed = [row for row in items.tolist() if row[0] >= 0]
    assert all(row[0] < 0 for row in items.tolist()[len(listed):])  # the pieces first, then the padding
    k = 0
    for b in range(len(tiles)) if order is None else order:
        count = listed[k][3] & 0xFFFF
        for j in range(count):
            seq, lo, hi, packed = listed[k + j]
            assert (seq, packed >> 16, packed & 0xFFFF) == (b, j, count) and 0 <= lo <= hi <= int(tiles[b])
            counts[b][lo:hi] += 1
        k += count
    assert k == len(listed)
    return counts


def listed_order(items: torch.Tensor) -> list[int]:
    """The sequences in the order their first pieces are listed."""
    return [int(row[0]) for row in items if row[0] >= 0 and row[3] >> 16 == 0]


def part_units(s: Schedule, p: int) -> int:
    return max(0, min((p + 1) * s.share, int(s.start[-1])) - p * s.share)


CASES = [(batch, kind, parts) for batch, kind in ((1, "normal"), (7, "edges"), (8, "edges"), (32, "one-long"),
                                                  (64, "lognormal"), (128, "normal"), (1024, "lognormal"))
         for parts in (1, 3, 132, 264, 1000)]


@pytest.mark.parametrize("batch,kind,parts", CASES)
def test_every_tile_is_read_once_and_parts_are_balanced(batch, kind, parts):
    lengths = spread(batch, kind, seed=batch + parts)
    s = make_schedule(lengths, parts, CAPACITY)
    assert [int(t) for t in s.tiles] == [-(-int(n) // TILE_ROWS) for n in lengths]
    for b, count in enumerate(coverage(s)):
        assert bool((count == 1).all()), (b, count)
        assert int(s.first_part(b)) <= int(s.last_part(b))  # length 0 too: its output is written by a part
    mean = int(s.start[-1]) / parts
    assert all(part_units(s, p) <= mean + 1 for p in range(parts))
    assert sum(part_units(s, p) for p in range(parts)) == int(s.start[-1])
    items = schedule_items(s, parts + batch)
    assert int((items[:, 0] >= 0).sum()) <= parts + batch - 1
    assert all(bool((count == 1).all()) for count in item_coverage(items, s.tiles))


def part_pieces_misplaced(s: Schedule, items: torch.Tensor, starts: torch.Tensor) -> list[tuple[int, int]]:
    """(part, item) pairs where part_first gives part p an item whose line segment (its tiles, and its sequence's
    fixed units for a first piece) is not inside p's share, or leaves a listed piece to no part or to two."""
    wrong, owner = [], {}
    for p in range(s.parts):
        for k in range(int(starts[p]), int(starts[p + 1])):
            b, lo, hi, word = (int(v) for v in items[k])
            line_lo = int(s.start[b]) + (0 if word >> 16 == 0 else SEQUENCE_COST + lo)
            line_hi = max(int(s.start[b]) + SEQUENCE_COST + hi, line_lo + 1)
            if b < 0 or not (p * s.share <= line_lo and line_hi <= (p + 1) * s.share):
                wrong.append((p, k))
            owner[k] = owner.get(k, 0) + 1
    listed = int((items[:, 0] >= 0).sum())
    wrong += [(-1, k) for k in range(listed) if owner.get(k) != 1]
    return wrong


@pytest.mark.parametrize("batch,kind,parts", CASES)
def test_each_part_lists_the_pieces_of_its_share(batch, kind, parts):
    """part_first (the cuda kernels' persistent CTAs walk part p's items part_first[p] .. part_first[p + 1] - 1)
    gives every listed piece to exactly the part whose share holds it; a shifted boundary is caught."""
    s = make_schedule(spread(batch, kind, seed=batch + parts), parts, CAPACITY)
    items, starts = schedule_items(s, parts + batch), part_first(s)
    assert starts.shape == (parts + 1,) and int(starts[0]) == 0
    assert int(starts[-1]) == int((items[:, 0] >= 0).sum())
    assert part_pieces_misplaced(s, items, starts) == []
    used = [p for p in range(parts) if starts[p + 1] > starts[p]]
    if len(used) > 1:  # the negative control: the second part's first piece handed to the first part
        shifted = starts.clone()
        shifted[used[1]] += 1
        assert part_pieces_misplaced(s, items, shifted) != []


@pytest.mark.parametrize("batch,kind", [(32, "one-long"), (8, "edges"), (128, "normal")])
@pytest.mark.parametrize("min_share", [4, 16, 1 << 20])
def test_a_least_share_cuts_fewer_larger_pieces(batch, kind, min_share):
    """With min_share, a batch of little work takes only the parts its shares fill, in pieces of at least min_share
    units but at a sequence's ends; every tile is still read once, and the parts past the line's end list none."""
    parts = 264
    s = make_schedule(spread(batch, kind, seed=batch), parts, CAPACITY, min_share=min_share)
    total = int(s.start[-1])
    assert s.share == max(min_share, -(-total // parts))
    used = -(-total // s.share)
    assert all(part_units(s, p) == 0 for p in range(used, parts))
    items, starts = schedule_items(s, parts + batch), part_first(s)
    assert all(bool((count == 1).all()) for count in item_coverage(items, s.tiles))
    assert part_pieces_misplaced(s, items, starts) == []
    assert bool((starts[used:] == int((items[:, 0] >= 0).sum())).all())
    for b in range(batch):  # a sequence's pieces: its cost over the share, and one more where a boundary cuts it
        cost = int(s.start[b + 1] - s.start[b])
        assert int(s.last_part(b) - s.first_part(b)) + 1 <= -(-cost // s.share) + 1


def test_invalid_lengths_cost_their_fixed_units_alone():
    """A negative length or one past the table's rows reads no tile (the kernel that reads the sequence makes it
    NaN), and still has a piece, which writes it."""
    s = make_schedule(torch.tensor([-5, 0, 10**6, 64], dtype=torch.int32), 4, 640)
    assert s.tiles.tolist() == [0, 0, 0, 1]
    assert s.start.tolist() == [0, SEQUENCE_COST, 2 * SEQUENCE_COST, 3 * SEQUENCE_COST, 4 * SEQUENCE_COST + 1]
    assert [row[0] for row in schedule_items(s, 8).tolist()[:4]] == [0, 1, 2, 3]


def test_parts_follow_the_resident_grid():
    assert balanced_parts(132, 2, 1) == 264
    assert balanced_parts(132, 2, 8) == 33  # 128 heads x q_len 2 in units of 32 rows: 8 CTAs a share
    assert balanced_parts(4, 1, 64) == 1
    assert balanced_parts(1000, 2, 1) == MAX_PIECES  # a unit's pieces: the merge's weights in shared memory
    with pytest.raises(ValueError, match="parts: expected >= 1"):
        make_schedule(torch.ones(3, dtype=torch.int32), 0, CAPACITY)
    with pytest.raises(ValueError, match="min_share: expected >= 1"):
        make_schedule(torch.ones(3, dtype=torch.int32), 4, CAPACITY, min_share=0)


def attend_pieces(s: Schedule, q: torch.Tensor, keys: list[torch.Tensor], weight) -> list[torch.Tensor]:
    """The decode of each sequence merged from its pieces, as the kernels do it: per piece the softmax numerator's
    sum o, its denominator l and its max m over the piece's tiles (float64); merged with weight(m, l, m_all)."""
    merged = []
    for b, k in enumerate(keys):
        pieces = []
        for p in range(int(s.first_part(b)), int(s.last_part(b)) + 1):
            lo, hi = s.piece_tiles(p, b)
            rows = k[lo * TILE_ROWS:hi * TILE_ROWS]
            if rows.shape[0] == 0:  # a piece of no tile: m = -inf, l = 0
                pieces.append((torch.zeros(q.shape[0], k.shape[1]), torch.full((q.shape[0], 1), -math.inf),
                               torch.zeros(q.shape[0], 1)))
                continue
            scores = q @ rows.T
            m = scores.amax(dim=1, keepdim=True)
            e = torch.exp(scores - m)
            pieces.append((e @ rows, m, e.sum(dim=1, keepdim=True)))
        m_all = torch.stack([m for _, m, _ in pieces]).amax(dim=0)
        if not bool(torch.isfinite(m_all).all()):  # no row at all
            merged.append(torch.zeros(q.shape[0], k.shape[1], dtype=torch.float64))
            continue
        w = [weight(m, l, m_all) for _, m, l in pieces]
        num = sum(wi * o for wi, (o, _, _) in zip(w, pieces, strict=True))
        den = sum(wi * l for wi, (_, _, l) in zip(w, pieces, strict=True))
        merged.append(num / den)
    return merged


def exact_weight(m, l, m_all):
    """exp(m - m_all), 0 for a piece of no row."""
    return torch.where(torch.isfinite(m), torch.exp(m - m_all), 0.0)


def merge_error(s: Schedule, weight=exact_weight, seed: int = 0) -> float:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(4, 8, generator=gen, dtype=torch.float64)
    keys = [torch.randn(int(t) * TILE_ROWS, 8, generator=gen, dtype=torch.float64) for t in s.tiles]
    worst = 0.0
    for k, out in zip(keys, attend_pieces(s, q, keys, weight), strict=True):
        if k.shape[0]:
            truth = torch.softmax(q @ k.T, dim=1) @ k
            worst = max(worst, float((out - truth).norm() / truth.norm()))
    return worst


@pytest.mark.parametrize("kind,parts", [("one-long", 33), ("edges", 5), ("lognormal", 40)])
def test_a_decode_merged_from_its_pieces_is_the_whole_decode(kind, parts):
    s = make_schedule(spread(16, kind, seed=3), parts, CAPACITY)
    assert any(int(s.first_part(b)) < int(s.last_part(b)) for b in range(16))  # some sequence is split
    assert merge_error(s) < 1e-12


def fill_misfits(flat: torch.Tensor, tiles: torch.Tensor, parts: int, payload: int) -> list[str]:
    """What breaks the fill cut's promises in `flat` (fill_schedule's layout): a part over its payload, part_first
    not in order or not closing at the listed pieces, or a piece j >= 1 of a sequence not the first item of the part
    after piece j - 1's."""
    items, starts = flat[:-(parts + 1)].view(-1, 4), flat[-(parts + 1):].tolist()
    listed = int((items[:, 0] >= 0).sum())
    wrong = []
    if starts[0] != 0 or starts[-1] != listed or starts != sorted(starts):
        wrong.append(f"part_first {starts}")
    part_of = {k: p for p in range(parts) for k in range(starts[p], starts[p + 1])}
    for p in range(parts):
        load = sum(int(items[k, 2] - items[k, 1]) + PIECE_COST for k in range(starts[p], starts[p + 1]))
        if load > payload:
            wrong.append(f"part {p}: {load} units, payload {payload}")
    for k in range(listed):
        if items[k, 3] >> 16 and (starts[part_of.get(k, -1)] != k or part_of.get(k) != part_of.get(k - 1, -2) + 1):
            wrong.append(f"item {k}: piece {int(items[k, 3] >> 16)} not first in the next part")
    return wrong


def fill_payload(tiles: torch.Tensor, parts: int, min_share: int) -> int:
    return max(-(-(int(tiles.sum()) + PIECE_COST * tiles.shape[0]) // parts), min_share) + PIECE_COST


FILL_CUTS = {"fill": fill_schedule, "pack": pack_schedule}  # the cuts that fill parts in turn, and their references


@pytest.mark.parametrize("cut", sorted(FILL_CUTS))
@pytest.mark.parametrize("min_share,slack", [(1, 0), (16, 0), (1, 5), (1, 40)])
@pytest.mark.parametrize("batch,kind,parts", CASES)
def test_the_fill_cuts_read_every_tile_once_within_each_part(batch, kind, parts, min_share, slack, cut):
    """Every tile once, and no part past its payload and the slack; the fill cut lists the sequences in the batch's
    order, the pack cut each sequence once in the order it placed them."""
    lengths = spread(batch, kind, seed=batch + parts)
    flat = FILL_CUTS[cut](lengths, parts, CAPACITY, min_share=min_share, slack=slack)
    assert flat.shape == ((parts + batch) * 4 + parts + 1,) and flat.dtype == torch.int32
    tiles = sequence_tiles(lengths, CAPACITY)
    items = flat[:-(parts + 1)].view(-1, 4)
    order = listed_order(items)
    assert sorted(order) == list(range(batch)) and (cut == "pack" or order == list(range(batch)))
    assert all(bool((count == 1).all()) for count in item_coverage(items, tiles, order))
    assert int((items[:, 0] >= 0).sum()) <= parts + batch - 1
    assert fill_misfits(flat, tiles, parts, fill_payload(tiles, parts, min_share) + slack) == []


def cut_sequences(flat: torch.Tensor, parts: int) -> int:
    items = flat[:-(parts + 1)].view(-1, 4)
    return int(((items[:, 0] >= 0) & (items[:, 3] >> 16 == 1)).sum())


@pytest.mark.parametrize("batch,parts,slack", [(128, 66, 0), (128, 66, 8), (128, 33, 0), (256, 132, 0)])
def test_the_pack_cut_cuts_few_sequences_of_an_uneven_batch(batch, parts, slack):
    """Normal(4k, 2k) lengths, two or more sequences a part (64-row units at 128 heads: 66 or 33 parts): the pack cut
    places whole sequences where the fill cut cuts one at nearly every part's end (22 of 128 cut against 60, 4 against
    52 with slack 8); its fullest part stays within the payload and the slack (the test above)."""
    lengths = spread(batch, "normal", seed=7)
    fill = cut_sequences(fill_schedule(lengths, parts, CAPACITY, slack=slack), parts)
    pack = cut_sequences(pack_schedule(lengths, parts, CAPACITY, slack=slack), parts)
    assert pack * 2 < fill, (pack, fill)


def test_the_pack_cut_places_the_longest_sequence_that_fits():
    """Tiles [5, 7, 1, 3] on 3 parts of payload 8 (share 7 and a piece's unit): the first part takes the 7; the second
    the 5, then the 1 that fits its room of 2, not the 3 sorted before it; the last the 3. Tiles [5, 7, 3, 3] (payload
    9): the second part has 3 units left after the 5, where no 3 fits whole, so it cuts the longest left, sequence 2,
    whose rest starts the last part."""
    def pack(tiles):
        flat = pack_schedule(torch.tensor(tiles, dtype=torch.int32) * TILE_ROWS, 3, CAPACITY)
        return flat[:-4].view(-1, 4).tolist()[:5], flat[-4:].tolist()

    assert pack([5, 7, 1, 3]) == ([[1, 0, 7, 1], [0, 0, 5, 1], [2, 0, 1, 1], [3, 0, 3, 1], [-1, 0, 0, 0]], [0, 1, 3, 4])
    assert pack([5, 7, 3, 3]) == ([[1, 0, 7, 1], [0, 0, 5, 1], [2, 0, 2, 2], [2, 2, 3, 1 << 16 | 2], [3, 0, 3, 1]],
                                  [0, 1, 3, 5])


@pytest.mark.parametrize("batch,kv,parts,slack,pieces", [
    (128, 4096, 132, 0, 128), (128, 4096, 264, 0, 256), (32, 3008, 264, 0, 256),
    # 64-row units at 128 heads: 66 parts of 127 + 1 units, two sequences of 65 each overfill one by 2
    (128, 4096, 66, 0, 191), (128, 4096, 66, 1, 191), (128, 4096, 66, 2, 128),
    (128, 16384, 66, 0, 193), (128, 16384, 66, 13, 190), (128, 16384, 66, 14, 128)])
def test_the_fill_cut_keeps_equal_sequences_whole_where_they_fit(batch, kv, parts, slack, pieces):
    """Equal sequences: none cut where the batch fits the parts (128 on 132), or overfills them by at most the slack;
    else each cut once or as the share falls; the line cut makes a piece more of most (128 x 4k on 264 parts: 3
    pieces, the last of 1 tile)."""
    lengths = torch.full((batch,), kv, dtype=torch.int32)
    items = fill_schedule(lengths, parts, CAPACITY, slack=slack)[:-(parts + 1)].view(-1, 4)
    assert int((items[:, 0] >= 0).sum()) == pieces


# Negative controls: each check above fails on a planted bug.


@pytest.mark.parametrize("fault", ["payload", "slack", "order", "scattered"])
def test_a_wrong_fill_cut_fails_its_checks(fault, monkeypatch):
    lengths = spread(32, "one-long", 1)
    tiles = sequence_tiles(lengths, CAPACITY)
    payload = fill_payload(tiles, 132, 1)
    if fault == "payload":  # parts filled one unit past their payload
        monkeypatch.setattr(sched, "PIECE_COST", PIECE_COST - 1)
    # a slack the bound does not allow: sequences kept whole past the payload
    flat = fill_schedule(lengths, 132, CAPACITY, slack=8 if fault == "slack" else 0)
    starts = flat[-133:]
    if fault == "order":
        starts[5], starts[6] = starts[6].clone(), starts[5].clone()
    elif fault == "scattered":  # a later piece moved into the part of its predecessor
        k = next(k for k in range(1, 132) if flat[4 * k + 3] >> 16 == 2)
        starts[int(torch.searchsorted(starts, k, right=True)) - 1] += 1
    assert fill_misfits(flat, tiles, 132, payload) != []


# Negative controls of the line cut: each check above fails on a planted bug.


def test_a_dropped_tile_fails_coverage(monkeypatch):
    tiles = sched.Schedule.piece_tiles
    monkeypatch.setattr(sched.Schedule, "piece_tiles", lambda self, p, b: (tiles(self, p, b)[0],
                                                                           max(tiles(self, p, b)[0],
                                                                               tiles(self, p, b)[1] - 1)))
    s = make_schedule(spread(32, "one-long", 1), 132, CAPACITY)
    assert not all(bool((count == 1).all()) for count in coverage(s))


def test_a_tile_taken_twice_fails_coverage(monkeypatch):
    tiles = sched.Schedule.piece_tiles
    monkeypatch.setattr(sched.Schedule, "piece_tiles", lambda self, p, b: (max(0, tiles(self, p, b)[0] - 1),
                                                                           tiles(self, p, b)[1]))
    s = make_schedule(spread(32, "one-long", 1), 132, CAPACITY)
    assert not all(bool((count == 1).all()) for count in coverage(s))


def test_a_share_rounded_down_leaves_work_uncut():
    s = make_schedule(spread(64, "lognormal", 2), 132, CAPACITY)
    short = s._replace(share=int(s.start[-1]) // s.parts)
    assert int(s.start[-1]) % s.parts  # a total the parts do not divide
    assert sum(part_units(short, p) for p in range(short.parts)) < int(short.start[-1])


@pytest.mark.parametrize("fault", ["dropped", "twice", "shifted"])
def test_a_wrong_item_fails_item_coverage(fault):
    s = make_schedule(spread(32, "one-long", 1), 132, CAPACITY)
    items = schedule_items(s, 132 + 32)
    k = next(k for k, row in enumerate(items.tolist()) if row[2] - row[1] >= 2)
    if fault == "dropped":
        items[k, 2] -= 1
    elif fault == "twice":
        items[k + 1, 1] -= 1
    else:
        items[k, 1] += 1
    with pytest.raises(AssertionError):
        assert all(bool((count == 1).all()) for count in item_coverage(items, s.tiles))


def test_a_piece_merged_with_the_wrong_weight_fails():
    s = make_schedule(spread(16, "one-long", 3), 33, CAPACITY)
    assert merge_error(s, weight=lambda m, l, m_all: torch.where(torch.isfinite(m), 1.0, 0.0)) > 1e-3
    assert merge_error(s, weight=lambda m, l, m_all: torch.where(torch.isfinite(m), torch.exp(m_all - m), 0.0)) > 1e-3


def test_the_cuda_plan_knows_the_schedule_module_cuts():
    """The cuda package keeps its own copy of the cuts it takes (it imports nothing of mla_decode at run time)."""
    from mla_decode.cuda import plan as cuda_plan
    assert cuda_plan.CUTS == sched.CUTS and cuda_plan.SCHEDULES == sched.SCHEDULES and cuda_plan.CUT in sched.CUTS
    assert cuda_plan.PACK_MAX_BATCH == sched.PACK_MAX_BATCH
