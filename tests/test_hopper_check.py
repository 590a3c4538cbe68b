"""tools/hopper_check.py: the triton backend's Hopper kernel compiled for sm_90a on the CPU with Triton 3.6 (the
folder make amd-check installs), within its gates; and each gate failing on a planted figure."""

import subprocess
import sys
from pathlib import Path

import pytest

from tools import hopper_check as H

ROOT = Path(__file__).resolve().parent.parent
TRITON_36 = ROOT / ".amd-triton" / "3.6.0"
GOOD = {False: {"case": (0, 1, 1, 16, False, False), "registers": 199, "local": 0, "shared": 84224, "qgmma": 34,
               "hgmma": 0, "ldsm_t": 16, "ldsm": 0, "fp8_unpacks": 0},
        True: {"case": (0, 1, 1, 16, False, True), "registers": 210, "local": 0, "shared": 94464, "qgmma": 0,
               "hgmma": 68, "ldsm_t": 16, "ldsm": 18, "fp8_unpacks": 272}}


@pytest.mark.parametrize("precise", [False, True], ids=["fast", "precise"])
@pytest.mark.parametrize("planted", [dict(local=64), dict(registers=256), dict(shared=3 * 36864 + 10240),
                                     dict(qgmma=18), dict(hgmma=32), dict(ldsm_t=0), dict(fp8_unpacks=128),
                                     dict(ldsm=9)],
                         ids=lambda d: next(iter(d)))
def test_each_gate_fails_on_a_planted_figure(planted, precise):
    assert H.gates(GOOD[precise]) == []
    assert len(H.gates(dict(GOOD[precise], **planted))) == 1


@pytest.mark.skipif(not (TRITON_36 / "triton").is_dir(), reason="Triton 3.6 not installed (make amd-check does)")
def test_the_hopper_kernel_compiles_within_its_gates():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "hopper_check.py"), "--triton", str(TRITON_36)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"{len(H.CASES)} of {len(H.CASES)} kernels pass" in proc.stdout
