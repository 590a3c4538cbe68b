"""The triton backend's Hopper kernel (mla_decode/triton/hopper.py, Gluon) compiled for sm_90a on this CPU with the
Triton it is written for, and its figures gated: what an H200 would run, checked without one.

    python tools/hopper_check.py --triton .amd-triton/3.6.0 [--file submission.py]

`--triton` is a folder holding Triton 3.6 (make amd-check installs the runner's there; its NVIDIA backend brings
ptxas and cuobjdump). The kernel of `--file` (the leaderboard file, which inlines the package) is compiled with the
constexprs its plans launch it with (ragged and paged, splits or none or the balanced schedule's pieces, MTP and head
counts, with and without the LSE, FP8 fast and precise, MXFP4, BF16 in programs of 16, 32 and 64 query rows), its
pointers 16-byte aligned as the launch path specializes them. Gates, per kernel:
  - no local memory, registers within 255, and no stack frame (where ptxas puts spills) in the fast FP8 kernel the
    plans take; the precise variant of MTP with pages of 1, the MXFP4 variants of MTP and MXFP4 with 128 heads
    spill a few registers at 255 (STL/LDL in the loop): their stack is held to SPILL_BYTES, a ratchet until they are
    brought to none;
  - shared memory for two programs an SM (the plan's splits assume two), BF16's for one (HOPPER_BF16_PROGRAMS_PER_SM);
  - fast: the products on FP8 wgmma (18 score + 16 value QGMMA a tile), no fp16 MMA, and with MXFP4 all of them on
    the E5M2 tile the codes expand to; precise and BF16: on 16-bit wgmma (36 + 32 HGMMA), no FP8 one; BF16 of 32
    or 64 rows: 36 + 16 HGMMA (a warpgroup scores half the rows, and takes half of each block's dims);
  - FP8: V^T through ldmatrix.trans and byte permutes; fast: no FP8 -> fp16 unpacks (which an fp16 copy of V would
    need); precise: each tile byte unpacked once for each product (K's 576 and V's 512 columns: 272 unpacks of two),
    K's fragments by ldmatrix. BF16: both products read the tile from shared memory (no ldmatrix, no unpacks);
  - MXFP4 whose tiles' rows are contiguous (ragged with one query token, pages of a multiple of 64): the L2 bulk
    prefetch of a tile ahead; every other kernel: none.
It also prints, ungated, the SASS instructions of each kernel's tile loop (the span of its longest backward branch):
the figure the journal's instruction counts a warp a tile come from. A balanced kernel's longest is its walk over a
part's pieces, which holds the tile loop: its figure is the whole piece's.
"""

import argparse
import collections
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (page size (0: ragged), splits (0: the balanced schedule's pieces), q_len, heads, LSE written, kind: KINDS)
KINDS = ("fast", "precise", "mxfp4", "bf16")  # FP8 fast, FP8 precise, MXFP4 (fast), BF16
CASES = ((0, 16, 1, 16, False, "fast"), (0, 1, 1, 16, False, "fast"), (64, 4, 1, 16, True, "fast"),
         (1, 8, 2, 32, True, "fast"), (16, 1, 4, 16, True, "fast"), (0, 2, 3, 8, True, "fast"),
         (64, 1, 1, 128, True, "fast"), (0, 16, 1, 16, False, "precise"), (64, 1, 1, 16, True, "precise"),
         (1, 8, 2, 32, True, "precise"), (0, 2, 3, 8, True, "precise"), (64, 1, 1, 128, True, "precise"),
         (0, 16, 1, 16, False, "mxfp4"), (0, 1, 1, 16, False, "mxfp4"), (64, 4, 1, 16, True, "mxfp4"),
         (1, 8, 2, 32, True, "mxfp4"), (16, 1, 4, 16, True, "mxfp4"), (0, 2, 3, 8, True, "mxfp4"),
         (64, 1, 1, 128, True, "mxfp4"), (128, 2, 1, 16, True, "mxfp4"),
         (0, 16, 1, 16, False, "bf16"), (64, 4, 1, 16, True, "bf16"), (1, 8, 2, 32, True, "bf16"),
         (16, 1, 4, 16, True, "bf16"), (0, 2, 3, 8, True, "bf16"), (64, 1, 1, 128, True, "bf16"),
         (0, 0, 1, 16, False, "fast"), (64, 0, 1, 16, True, "fast"), (1, 0, 2, 32, True, "fast"),
         (64, 0, 1, 16, True, "precise"), (0, 0, 1, 16, False, "mxfp4"), (64, 0, 1, 128, True, "mxfp4"),
         (64, 0, 1, 16, True, "bf16"), (1, 0, 2, 32, True, "bf16"),
         # BF16 programs of 32 and 64 query rows (two warpgroups): the seventh field, else 16
         (0, 16, 1, 64, False, "bf16", 64), (64, 1, 1, 128, True, "bf16", 64), (1, 8, 2, 32, True, "bf16", 64),
         (16, 1, 4, 16, True, "bf16", 64), (64, 0, 1, 72, True, "bf16", 64), (1, 0, 2, 32, True, "bf16", 64),
         (64, 4, 1, 24, True, "bf16", 32), (0, 2, 3, 8, True, "bf16", 32), (64, 0, 2, 16, True, "bf16", 32))
# A tile's QGMMA, HGMMA, FP8 unpacks, ldmatrix (K's fragments: 576 B x 64 rows in 16-byte pieces) and the least
# ldmatrix.trans (V^T's fragments), by kind; "bf16-wide": two warpgroups, each 36 score HGMMA (half the rows) and 16
# value HGMMA (64 of each block's 128 dims)
PRODUCTS = {"fast": (34, 0, 0, 0, 16), "mxfp4": (34, 0, 0, 0, 16), "precise": (0, 68, 272, 18, 16),
            "bf16": (0, 68, 0, 0, 0), "bf16-wide": (0, 52, 0, 0, 0)}
SPILL_BYTES = {"fast": 0, "precise": 16, "mxfp4": 32, "bf16": 0}  # stack allowed (the variants' worst, Triton 3.6.0)
SHARED_PER_SM = 228 * 1024
PROGRAMS_PER_SM = {"fast": 2, "precise": 2, "mxfp4": 2, "bf16": 1}  # the plans' (hopper.HOPPER_BF16_PROGRAMS_PER_SM)
SIGNATURE = {"q_ptr": "*bf16", "kv_ptr": "*fp8e4nv", "kscale_ptr": "*fp32", "kscale_stride": "i32", "seq_ptr": "*i32",
             "table_ptr": "*i32", "max_pages": "i32", "kv_rows": "i32", "out_ptr": "*bf16", "lse_ptr": "*fp32",
             "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "items_ptr": "*i32", "part_first_ptr": "*i32",
             "qk_scale": "fp32"}
MXFP4_SIGNATURE = dict(SIGNATURE, kv_ptr="*u8", kscale_ptr="*u8")  # the codes and the E8M0 scales, as bytes
BF16_SIGNATURE = dict(SIGNATURE, kv_ptr="*bf16", kscale_ptr="*bf16")  # no scale: the cache as an unused pointer


def case_rows(case) -> int:
    """The query rows a program of `case` takes: its seventh field, else 16."""
    return case[6] if len(case) > 6 else 16


def shared_per_program(kind: str) -> int:
    """The shared memory a program of `kind` may take: its share of an SM, 1 KB reserved each."""
    return SHARED_PER_SM // PROGRAMS_PER_SM[kind] - 1024


def instructions(sass: str) -> list[tuple[int, str]]:
    """cuobjdump's SASS listing as (address, instruction text) pairs."""
    return [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]


def loop_instructions(sass: str) -> int:
    """The SASS instructions between the target of the longest backward branch and the branch itself (0 if none)."""
    at = instructions(sass)
    spans = [(int(b.group(1), 16), a) for a, text in at
             if (b := re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)) and int(b.group(1), 16) < a]
    if not spans:
        return 0
    start, end = max(spans, key=lambda span: span[1] - span[0])
    return sum(start <= a <= end for a, _ in at)


def compile_case(module, triton, case) -> dict:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    page, splits, q_len, heads, lse, kind = case[:6]
    rows = case_rows(case)
    constexprs = dict(NUM_SPLITS=max(splits, 1), PAGE_SIZE=page, FP8_MAX=448.0, WRITE_LSE=lse, NUM_HEADS=heads,
                      Q_LEN=q_len, CAUSAL=q_len > 1, PRECISE=kind == "precise", MXFP4=kind == "mxfp4",
                      BF16=kind == "bf16", BALANCED=splits == 0, BLOCK_H=rows)
    arguments = {"mxfp4": MXFP4_SIGNATURE, "bf16": BF16_SIGNATURE}.get(kind, SIGNATURE)
    signature = dict(arguments, **{name: "constexpr" for name in constexprs})
    aligned = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(arguments.values()) if kind.startswith("*")}
    source = GluonASTSource(module.hopper_split_kernel, signature, constexprs, aligned)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": module.hopper_num_warps(rows)})
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage, sass = (subprocess.run([cuobjdump, flag, cubin], capture_output=True, text=True, check=True).stdout
                       for flag in ("--dump-resource-usage", "-sass"))
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", text).split()[0] for _, text in instructions(sass))
    return {"case": case, "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "local": int(re.search(r"LOCAL:(\d+)", usage).group(1)),
            "stack": int(re.search(r"STACK:(\d+)", usage).group(1)), "shared": kernel.metadata.shared,
            "qgmma": sum(n for op, n in ops.items() if op.startswith("QGMMA")),
            "hgmma": sum(n for op, n in ops.items() if op.startswith("HGMMA")),
            "e5m2": sum(n for op, n in ops.items() if op.startswith("QGMMA") and ".E5M2." in op),
            "ldsm_t": ops.get("LDSM.16.MT88.4", 0), "ldsm": ops.get("LDSM.16.M88.4", 0),
            "fp8_unpacks": ops.get("F2FP.F16.E4M3.UNPACK_B", 0),
            "bulk_prefetches": sum(n for op, n in ops.items() if op.startswith("UBLKPF")),
            "loop": loop_instructions(sass)}


def prefetches_ahead(case) -> bool:
    """Whether the kernel of `case` asks L2 for a tile ahead: MXFP4 whose tiles' rows are contiguous."""
    page, _, q_len, _, _, kind = case[:6]
    return kind == "mxfp4" and ((page == 0 and q_len == 1) or (page > 0 and page % 64 == 0))


def gates(k: dict) -> list[str]:
    failed = []
    if k["local"]:
        failed.append(f"{k['local']} B of local memory")
    kind = k["case"][5]
    if k["stack"] > SPILL_BYTES[kind]:
        failed.append(f"{k['stack']} B of stack (spills; {kind}: at most {SPILL_BYTES[kind]})")
    if k["registers"] > 255:
        failed.append(f"{k['registers']} registers")
    if k["shared"] > shared_per_program(kind):
        failed.append(f"{k['shared']} B of shared memory: more than {PROGRAMS_PER_SM[kind]} program(s) an SM leave "
                      "each")
    qgmma, hgmma, unpacks, ldsm, ldsm_t = PRODUCTS["bf16-wide" if case_rows(k["case"]) > 16 else kind]
    if (k["qgmma"], k["hgmma"]) != (qgmma, hgmma):
        failed.append(f"products: {k['qgmma']} FP8 and {k['hgmma']} fp16 wgmma (want {qgmma} and {hgmma})")
    if k["e5m2"] != (qgmma if kind == "mxfp4" else 0):
        failed.append(f"{k['e5m2']} wgmma on an E5M2 tile (want all of them with MXFP4, else none)")
    if k["ldsm_t"] < ldsm_t or (ldsm_t == 0 and k["ldsm_t"]) or k["fp8_unpacks"] != unpacks:
        failed.append(f"V^T: {k['ldsm_t']} ldmatrix.trans, {k['fp8_unpacks']} FP8 -> fp16 unpacks (want "
                      f"{f'>= {ldsm_t}' if ldsm_t else 0}, {unpacks})")
    if k["ldsm"] < ldsm or (ldsm == 0 and k["ldsm"]):  # fast: the score product reads K from shared memory
        failed.append(f"K's fragments: {k['ldsm']} ldmatrix (want {f'>= {ldsm}' if ldsm else 0})")
    ahead = prefetches_ahead(k["case"])
    if (k["bulk_prefetches"] > 0) != ahead:
        failed.append(f"{k['bulk_prefetches']} L2 bulk prefetches (want {'some' if ahead else 0})")
    return failed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--triton", type=Path, required=True, help="a folder holding Triton 3.6")
    ap.add_argument("--file", type=Path, default=ROOT / "submission.py")
    args = ap.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)  # the compiler, not the interpreter (tests run under it)
    sys.path.insert(0, str(args.triton.resolve()))
    import triton

    spec = importlib.util.spec_from_file_location("submission_under_check", args.file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if module.HOPPER_KERNEL_REASON is not None:
        print(f"hopper check: {module.HOPPER_KERNEL_REASON}", file=sys.stderr)
        return 1
    print(f"Triton {triton.__version__}, sm_90a: (page, splits, q_len, heads, lse, kind[, rows]) | registers | "
          "local | stack | shared | QGMMA (E5M2) | HGMMA | LDSM.T | LDSM | FP8 unpacks | L2 bulk prefetches | loop")
    failures = 0
    for case in CASES:
        k = compile_case(module, triton, case)
        failed = gates(k)
        failures += bool(failed)
        print(f"{case} | {k['registers']} | {k['local']} | {k['stack']} | {k['shared']} | {k['qgmma']} ({k['e5m2']}) | "
              f"{k['hgmma']} | {k['ldsm_t']} | {k['ldsm']} | {k['fp8_unpacks']} | {k['bulk_prefetches']} | {k['loop']}"
              + (f"  FAILED: {'; '.join(failed)}" if failed else ""))
    print(f"hopper check: {len(CASES) - failures} of {len(CASES)} kernels pass")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
