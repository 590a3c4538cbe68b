"""The cuda backend's launch plan: a unit's query rows, the units and the splits per unit, as pure functions of the
problem and the facts of its GPU and kernel library (DeviceFacts: decode.py gathers them), so that the CPU can check
every rule."""

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:  # the package imports nothing of mla_decode at run time
    from ..contract import Problem

# Query rows per CTA (a unit, H in the source): a sequence's q_len x num_heads rows, token-major, in units of these
# (a unit may span tokens: 16 heads x 2 tokens in 32 rows); the last is masked past them
QUERY_ROWS = 16
WIDE_QUERY_ROWS = 32  # the Hopper kernel's units where a sequence's query rows come in multiples of 32 (unit_rows)
WIDEST_QUERY_ROWS = 64  # the Hopper 64-row kernel's units (the FP8 and BF16 caches; one CTA of two warpgroups per SM)
# plan_unit_rows: the tiles a 32-row CTA walks at least, and where the 16-row plan splits too (a merge either way)
WIDE_MIN_TILES, WIDE_MERGED_MIN_TILES = 16, 8
# plan_unit_rows: the tiles a 64-row CTA walks at least, or at least where the 16-row plan splits too
WIDEST_MIN_TILES, WIDEST_MERGED_MIN_TILES = 16, 4
BLOCK_N = 64  # KV rows per tile (BN in the source)
# cuda_plan: the tiles a split keeps at least where its CTAs would not all fit one per SM; and the splits that FP8
# pages under BLOCK_N rows keep regardless in 16-row units (their rows are looked up one by one: more CTAs in flight
# hide the lookups, until the unit's merge of that many partials costs more)
SPLIT_MIN_TILES, GATHERED_KEEP_SPLITS = 4, 8
MAX_SPLITS = 512  # MAX_SPLITS in the source: the merge takes powers of two up to this
MAX_UNITS = 65535  # the grid's y dimension: units of query rows (batch x ceil(q_len x heads / unit_rows))
# How a plan cuts the work (DecodeCall's schedule): "fixed", num_splits equal splits of every unit sized by the plan's
# longest sequence (cuda_plan), or "balanced", the work-balanced schedule (schedule.cuh, made on the GPU from the
# lengths each call or once a step)
SCHEDULES = ("fixed", "balanced")
# The plan's default: a serving batch is uneven, where the balanced schedule wins 1.1-4.3x over the fixed splits; it
# loses a uniform batch by 2-26% (BENCHMARKS.md's uneven grid), where a caller may pass "fixed"
SCHEDULE = "balanced"
MAX_PIECES = 512  # MAX_PIECES in the source: the most parts a balanced schedule cuts
# The balanced schedule's least share, in its cost units (KV tiles, and one a sequence): a piece of fewer tiles costs
# more in its restart (Q, the pipeline's first tiles, a partial and its merge) than a part fewer on it saves
MIN_SHARE = 1
# The balanced schedule's cuts (DecodeCall's cut; mla_decode.schedule.CUTS): "line", equal shares anywhere; "fill",
# parts filled in turn, a sequence whole where it fits; "pack", the fill from the longest sequence that fits whole (at
# most PACK_MAX_BATCH sequences); and the plan's default
CUTS, CUT = ("line", "fill", "pack"), "fill"
PACK_MAX_BATCH = 4096  # PACK_MAX_BATCH in the source: the pack cut's schedule kernel sorts the batch in shared memory
# The fill cut's slack (DecodeCall's slack): the KV tiles a part may run past its share to keep a sequence whole, by
# (cache format, unit rows); 0 where not named. A cut sequence writes a partial of 64 rows from each piece and a merge
# reads them, which costs more than a few tiles' walk; a BF16 tile costs about twice an FP8 one. Smaller units lose
# more to a longer part than they save (the sweep: docs/2026-12-07-fill-slack.md)
FILL_SLACK = {("fp8", 64): 8, ("bf16", 64): 4}


def fill_slack(kv_format: str, rows: int) -> int:
    """The plan's slack for units of `rows` query rows over a `kv_format` cache (FILL_SLACK)."""
    return FILL_SLACK.get((kv_format, rows), 0)


class DeviceFacts(NamedTuple):
    """What the plan reads of a GPU and of the kernel library built for it."""

    sms: int  # the GPU's streaming multiprocessors
    ctas_per_sm: Callable[[int], int]  # CTAs of a unit's kernel resident per SM, by its rows (mla_unit_ctas_per_sm)
    max_unit_rows: int  # the widest unit the library's kernels take (mla_max_unit_rows)
    bf16_ctas_per_sm: int = 1  # the BF16 kernel's, whatever its rows (mla_bf16_ctas_per_sm)


def unit_ctas_per_sm(facts: DeviceFacts, rows: int, kv_format: str) -> int:
    """CTAs of the kernel of `rows`-row units over a `kv_format` cache resident per SM."""
    return facts.bf16_ctas_per_sm if kv_format == "bf16" else facts.ctas_per_sm(rows)


class LaunchKey(NamedTuple):
    """What a launch's split plan depends on."""

    device: torch.device
    units: int  # CTAs per split: batch x q_len x num_heads / unit_rows
    seq_len: int  # the longest sequence the split plan is sized for
    kv_format: str
    precise: bool
    unit_rows: int = QUERY_ROWS  # its kernel's CTAs per SM (mla_unit_ctas_per_sm): 1 at 64 rows, else 2 or 1
    page_size: int = 0  # 0: ragged


def cuda_plan(batch: int, seq_len: int, num_sms: int, ctas_per_sm: int = 1, keep_splits: int = 1) -> int:
    """Splits per unit (`batch` units of 16, 32 or 64 query rows): the largest power of two with batch x splits <= the
    CTAs that fit at once (ctas_per_sm x SMs; the merge's barrier needs them all resident), at most MAX_SPLITS and at
    least one 64-row tile per split; then, while a second CTA per SM would be needed (batch x splits > SMs) and there
    are more than `keep_splits`, halved as long as a split would hold fewer than SPLIT_MIN_TILES tiles (a CTA's fixed
    cost, its Q and its partial output, outweighs so little work). The sweeps behind it are in docs/design-notes.md
    (units of 16 rows) and, for keep_splits, docs/2026-12-02-paged-gap.md (section 9)."""
    tiles = max(1, seq_len // BLOCK_N)
    limit = max(1, min(ctas_per_sm * num_sms // max(batch, 1), tiles, MAX_SPLITS))
    splits = 1 << (limit.bit_length() - 1)
    while splits > keep_splits and batch * splits > num_sms and tiles // splits < SPLIT_MIN_TILES:
        splits //= 2
    return splits


def plan_splits(key: LaunchKey, facts: DeviceFacts) -> int:
    """The splits per sequence of the launch plan of `key` on a GPU of `facts` (cuda_plan with the CTAs per SM of its
    units' kernel: the cooperative launch fails unless every CTA is resident)."""
    gathered = (key.kv_format == "fp8" and not key.precise and key.unit_rows == QUERY_ROWS
                and 0 < key.page_size < BLOCK_N)
    return cuda_plan(key.units, key.seq_len, facts.sms, unit_ctas_per_sm(facts, key.unit_rows, key.kv_format),
                     GATHERED_KEEP_SPLITS if gathered else 1)


def page_divisor(page_size: int) -> tuple[int, int]:
    """(page_mul, page_shift) with pos // page_size == (pos * page_mul) >> page_shift for every 0 <= pos < 2^31 (the
    kernels' page_of): page_shift = 31 + ceil(log2(page_size)) and page_mul = 2^page_shift / page_size rounded up,
    below 2^32. Exact because page_mul * page_size exceeds 2^page_shift by less than page_size <= 2^(page_shift -
    31)."""
    shift = 31 + (page_size - 1).bit_length()
    return -(-(1 << shift) // page_size), shift


def split_rows(length: int, splits: int) -> int:
    """The positions of each of `splits` splits of a sequence of `length`: whole tiles (common.cuh's split_rows)."""
    per_split = -(-length // splits)
    return -(-per_split // BLOCK_N) * BLOCK_N


def query_units(problem: "Problem", rows: int) -> int:
    """The CTAs a problem's query rows take per split in units of `rows`: batch x ceil(q_len x num_heads / rows) (the
    grid's y; common.cuh's unit_groups: a sequence's last unit is masked past its rows)."""
    return problem.batch * -(-problem.q_len * problem.num_heads // rows)


def served_unit_rows(problem: "Problem", max_unit_rows: int) -> list[int]:
    """The query rows a unit (a CTA) of `problem` can take: 16; in the fast mode, with a library whose kernels take
    units up to `max_unit_rows` (the Hopper wgmma one's), also 32 where a sequence's q_len x num_heads query rows come
    in 32s and 64 where they come in 64s with the FP8 or the BF16 cache (the 64-row kernel has no MXFP4 path: two
    dequantized tiles beside the 4 stages would not fit). Units are of a sequence's rows, so 32 heads x 2 tokens make
    one 64-row unit; other counts take 16-row units, the last of a sequence masked."""
    rows = problem.q_len * problem.num_heads
    if problem.precision != "fast" or rows % WIDE_QUERY_ROWS:
        return [QUERY_ROWS]
    wide = [WIDE_QUERY_ROWS] if max_unit_rows >= WIDE_QUERY_ROWS else []
    if max_unit_rows >= WIDEST_QUERY_ROWS and rows % WIDEST_QUERY_ROWS == 0 and problem.kv_format != "mxfp4":
        wide.append(WIDEST_QUERY_ROWS)
    return [QUERY_ROWS, *wide]


def plan_unit_rows(problem: "Problem", facts: DeviceFacts, requested: int | None = None) -> int:
    """The query rows of a unit (a CTA) in `problem`'s plan on a GPU of `facts`, of served_unit_rows. 64 where served
    and a 64-row CTA, split as cuda_plan splits it, walks at least WIDEST_MIN_TILES tiles, or the unsplit 64-row grid
    fills the SMs, or it walks at least WIDEST_MERGED_MIN_TILES where the 16-row plan splits too. Else 32 where
    served, the 32-row grid has more CTAs than the GPU has SMs or the 16-row grid more than fit at once (BF16: one CTA
    an SM), and a 32-row CTA walks at least WIDE_MIN_TILES tiles (WIDE_MERGED_MIN_TILES where the 16-row plan splits
    too); else 16. Wider units read each KV tile for more rows
    and run the per-tile chain once for them, but their fixed cost (Q, the staged output, the merge) grows with the
    rows and they make fewer CTAs: with idle SMs or few tiles, 16 rows win. The rule picks, on each of the H200 rows
    measured in 16-, 32- and 64-row units, the fastest (docs/2026-12-02-serving.md, sections 8, 10 and 12).
    requested: the plan's backend option, checked against served_unit_rows."""
    served = served_unit_rows(problem, facts.max_unit_rows)
    if requested is not None:
        if requested not in served:
            raise ValueError(f"backend_options: unit_rows {requested!r}: this problem's cuda kernel takes {served} "
                             f"query rows a CTA ({problem.q_len} x {problem.num_heads} heads, {problem.kv_format}, "
                             f"{problem.precision} mode)")
        return requested
    if WIDE_QUERY_ROWS not in served:
        return QUERY_ROWS

    def plan(rows: int) -> tuple[int, int, int]:  # (units, splits, tiles a CTA) of the plan in units of `rows`
        units = query_units(problem, rows)
        # The ragged plan's splits (page_size 0): the unit rules were measured on them
        splits = plan_splits(LaunchKey(problem.device, units, problem.max_seqlen, problem.kv_format, False, rows),
                             facts)
        return units, splits, max(1, problem.max_seqlen // BLOCK_N) // splits

    narrow_units, narrow_splits, _ = plan(QUERY_ROWS)
    if WIDEST_QUERY_ROWS in served:
        units, splits, tiles = plan(WIDEST_QUERY_ROWS)
        if (tiles >= WIDEST_MIN_TILES or (splits == 1 and units >= facts.sms)
                or (tiles >= WIDEST_MERGED_MIN_TILES and narrow_splits > 1)):
            return WIDEST_QUERY_ROWS
    units, splits, tiles = plan(WIDE_QUERY_ROWS)
    narrow_fits = narrow_units * narrow_splits <= unit_ctas_per_sm(facts, QUERY_ROWS, problem.kv_format) * facts.sms
    if (units * splits <= facts.sms and narrow_fits) or tiles < WIDE_MERGED_MIN_TILES:
        return QUERY_ROWS
    return WIDE_QUERY_ROWS if tiles >= WIDE_MIN_TILES or narrow_splits > 1 else QUERY_ROWS


def balanced_parts(sms: int, ctas_per_sm: int, groups: int) -> int:
    """The shares a balanced schedule cuts a batch into: one per CTA that fits at once, over the `groups` units of
    each sequence (q_len x heads / unit_rows: every group runs the same cut), at most MAX_PIECES."""
    return max(1, min(MAX_PIECES, ctas_per_sm * sms // max(groups, 1)))
