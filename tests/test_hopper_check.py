"""tools/hopper_check.py: the triton backend's Hopper kernel compiled for sm_90a on the CPU with Triton 3.6 (the
folder make amd-check installs), within its gates; and each gate failing on a planted figure."""

import subprocess
import sys
from pathlib import Path

import pytest

from tools import hopper_check as H

ROOT = Path(__file__).resolve().parent.parent
TRITON_36 = ROOT / ".amd-triton" / "3.6.0"
GOOD = {"fast": {"case": (0, 1, 1, 16, False, "fast"), "registers": 199, "local": 0, "stack": 0,
                 "shared": 84224, "qgmma": 34, "hgmma": 0, "e5m2": 0, "ldsm_t": 16, "ldsm": 0, "fp8_unpacks": 0,
                 "bulk_prefetches": 0},
        "precise": {"case": (0, 1, 1, 16, False, "precise"), "registers": 210, "local": 0, "stack": 0,
                    "shared": 94464, "qgmma": 0, "hgmma": 68, "e5m2": 0, "ldsm_t": 16, "ldsm": 18,
                    "fp8_unpacks": 272, "bulk_prefetches": 0},
        "mxfp4": {"case": (0, 1, 1, 16, False, "mxfp4"), "registers": 255, "local": 0, "stack": 0,
                  "shared": 84224, "qgmma": 34, "hgmma": 0, "e5m2": 34, "ldsm_t": 16, "ldsm": 0, "fp8_unpacks": 0,
                  "bulk_prefetches": 1},
        "bf16": {"case": (0, 16, 1, 16, False, "bf16"), "registers": 202, "local": 0, "stack": 0, "shared": 168192,
                 "qgmma": 0, "hgmma": 68, "e5m2": 0, "ldsm_t": 0, "ldsm": 0, "fp8_unpacks": 0, "bulk_prefetches": 0},
        # 64 query rows a program, two warpgroups
        "bf16-wide": {"case": (64, 1, 1, 128, True, "bf16", 64), "registers": 226, "local": 0, "stack": 0,
                      "shared": 230400, "qgmma": 0, "hgmma": 52, "e5m2": 0, "ldsm_t": 0, "ldsm": 0, "fp8_unpacks": 0,
                      "bulk_prefetches": 0}}
# BF16's own wrong figures where the common plants are its right ones: two FP8 programs' shared memory is within its
# one program's; its V^T comes from shared memory, without ldmatrix.trans
BF16_PLANTED = {"shared": 228 * 1024, "ldsm_t": 16}


@pytest.mark.parametrize("kind", sorted(GOOD))
@pytest.mark.parametrize("planted", [dict(local=64), dict(stack=40), dict(registers=256),
                                     dict(shared=3 * 36864 + 10240), dict(qgmma=18), dict(hgmma=32), dict(ldsm_t=0),
                                     dict(fp8_unpacks=128), dict(ldsm=9)],
                         ids=lambda d: next(iter(d)))
def test_each_gate_fails_on_a_planted_figure(planted, kind):
    if kind.startswith("bf16"):
        planted = {name: BF16_PLANTED.get(name, value) for name, value in planted.items()}
    assert H.gates(GOOD[kind]) == []
    assert len(H.gates(dict(GOOD[kind], **planted))) == 1


def test_a_wide_bf16_program_takes_its_own_products():
    """The 16-row kernel's 68 HGMMA a tile in a 64-row program (each warpgroup scoring all the rows) fails."""
    assert len(H.gates(dict(GOOD["bf16-wide"], hgmma=68))) == 1


def test_the_fast_fp8_kernel_may_not_spill():
    assert len(H.gates(dict(GOOD["fast"], stack=8))) == 1 and H.gates(dict(GOOD["precise"], stack=8)) == []


@pytest.mark.parametrize("kind,e5m2", [("fast", 34), ("mxfp4", 0), ("mxfp4", 18)])
def test_the_products_take_the_tile_in_its_format(kind, e5m2):
    """An FP8 kernel with E5M2 wgmma, or an MXFP4 one with E4M3 ones, fails."""
    assert len(H.gates(dict(GOOD[kind], e5m2=e5m2))) == 1


@pytest.mark.parametrize("kind,case,ahead", [
    ("mxfp4", (0, 1, 1, 16, False, "mxfp4"), True),  # ragged, one query token: contiguous tiles
    ("mxfp4", (128, 2, 1, 16, True, "mxfp4"), True),  # a tile in one page
    ("mxfp4", (16, 1, 4, 16, True, "mxfp4"), False),  # pages of 16: a tile's rows are not contiguous
    ("mxfp4", (0, 2, 3, 8, True, "mxfp4"), False),  # ragged MTP (it spills with the prefetch)
    ("fast", (0, 1, 1, 16, False, "fast"), False)])  # FP8's tiles come by cp.async
def test_mxfp4_with_contiguous_tiles_asks_l2_ahead_and_no_other_kernel_does(kind, case, ahead):
    right, wrong = (1, 0) if ahead else (0, 1)
    assert H.gates(dict(GOOD[kind], case=case, bulk_prefetches=right)) == []
    assert len(H.gates(dict(GOOD[kind], case=case, bulk_prefetches=wrong))) == 1


def test_the_loop_is_the_longest_backward_branch():
    """A forward branch and a shorter loop do not count; no backward branch: 0."""
    sass = "\n".join(f"        /*{at:04x}*/                   {text} ;" for at, text in [
        (0x00, "MOV R1, c[0x0][0x28]"), (0x10, "@P0 BRA 0x60"), (0x20, "IMAD R2, R3, R4, RZ"),
        (0x30, "@!P1 BRA 0x20"), (0x40, "FADD R5, R5, R6"), (0x50, "LDG.E R7, desc[UR4][R8.64]"),
        (0x60, "@P2 BRA 0x10"), (0x70, "EXIT")])
    assert H.loop_instructions(sass) == 6  # 0x10 .. 0x60
    assert H.loop_instructions(sass.replace("@P2 BRA 0x10", "@P2 BRA 0x70")) == 2  # 0x20 .. 0x30
    assert H.loop_instructions(sass.replace("@P2 BRA 0x10", "@P2 BRA 0x70").replace("BRA 0x20", "BRA 0x40")) == 0


@pytest.mark.skipif(not (TRITON_36 / "triton").is_dir(), reason="Triton 3.6 not installed (make amd-check does)")
def test_the_hopper_kernel_compiles_within_its_gates():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "hopper_check.py"), "--triton", str(TRITON_36)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"{len(H.CASES)} of {len(H.CASES)} kernels pass" in proc.stdout
