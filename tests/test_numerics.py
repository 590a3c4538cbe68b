"""Accuracy under stress: large common logit offsets and attention sinks (testkit.inputs.generate_shifted_input), in the
fast and the precise mode.

CPU: bench/numerics.py under Triton's interpreter, whose dots are exact fp32, so the Triton kernel must match the
float64 emulation of exactly what it rounds (fast: Q to e4m3 per head; precise: nothing beyond the cache).
GPU (`pytest -m gpu`): every backend on the real hardware, against the strict gate.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import reference as R
from testkit.emulation import emulate, emulation_of
from testkit.inputs import SHIFT_KEY_VALUE, generate_shifted_input

ROOT = Path(__file__).resolve().parent.parent
LENS = [10, 118, 64, 64, 1, 33]
MARGIN_BOUND = 0.9 * R.REL_L2_BOUND["fp8"]  # no case may sit within 10% of the strict gate


def test_shifted_input_shifts_every_logit_by_the_offset():
    base = generate_shifted_input([3, 0, 5], seed=1, shift=0.0, device=torch.device("cpu"))
    shifted = generate_shifted_input([3, 0, 5], seed=1, shift=100.0, device=torch.device("cpu"))
    scores = [torch.einsum("bhd,nd->bhn", d[0].double(), d[1]["bf16"][:, 0].double()) * R.SM_SCALE
              for d in (base, shifted)]
    torch.testing.assert_close(scores[1] - scores[0], torch.full_like(scores[0], 100.0), rtol=0, atol=1e-9)


def test_sink_input_puts_one_key_per_sequence_above_the_rest():
    data = generate_shifted_input([3, 0, 5, 1], seed=2, shift=30.0, sink=True, device=torch.device("cpu"))
    last = data[1]["bf16"][:, 0, -1]
    assert last.tolist() == [SHIFT_KEY_VALUE, 0, 0, SHIFT_KEY_VALUE, 0, 0, 0, 0, SHIFT_KEY_VALUE]
    assert (data[0][..., -1] == 30.0).all()


# bench/numerics.py run as a script, after the test-only patch of the interpreter (tests/triton_interpreter.py)
RUN_PATCHED = """
import runpy, sys
sys.path[:0] = [sys.argv[1] + "/tests"]
import triton_interpreter
triton_interpreter.patch()
sys.argv = [sys.argv[1] + "/bench/numerics.py"] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("numerics") / "numerics.json"
    # the CPU even on a GPU machine: the interpreter runs the kernels on host memory
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", RUN_PATCHED, str(ROOT), "--backends", "triton,torch", "--json",
                           str(out)], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_interpreted_kernels_round_only_what_they_say(interpreted):
    assert not interpreted["skipped"], interpreted["skipped"]
    for row in interpreted["rows"]:
        # the outputs themselves against the emulation of what each kernel rounds: the interpreter's dots are exact
        # fp32, so what remains is the output's bf16 rounding (~2-3e-3) and fp32 sums
        assert row["triton fast vs emulation"] < 5e-3, row
        assert row["triton precise vs emulation"] < 5e-3, row
        assert row["torch fast vs emulation"] < 5e-3, row
        assert row["torch fast"] == row["torch precise"], row  # fp32 either way
        assert all(row[c] < MARGIN_BOUND for c in row if c != "case"), row


# ---------------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
STRESS = {"shift100": (100.0, False), "sink30": (30.0, True), "shift1000": (1000.0, False)}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", sorted(STRESS))
@pytest.mark.parametrize("precision", ["fast", "precise"])
@pytest.mark.parametrize("backend", ["cuda", "triton", "torch"])
def test_gpu_stress_passes_the_strict_gate(monkeypatch, backend, precision, case):
    """The fast mode on +100 and the sink; the precise mode on everything (the fast FP8 score product's error at
    +1000 is measured by bench/numerics.py, not promised)."""
    shift, sink = STRESS[case]
    if case == "shift1000" and precision == "fast" and backend != "torch":
        pytest.skip("the fast mode's FP8 score product is not promised at +1000 (README)")
    monkeypatch.setenv("MLA_BACKEND", backend)
    monkeypatch.setenv("MLA_PRECISION", precision)
    monkeypatch.setenv("MLA_KV_FORMAT", "fp8")
    import submission as S

    data = generate_shifted_input(LENS, seed=11, shift=shift, sink=sink)
    out = S.custom_kernel(data)
    ok, msg = R.check_implementation(data, out)
    assert ok, msg
    # The output itself against the emulation of what the kernel rounds, worst sequence (bounds as
    # tests/test_negative_controls.py measured them on random data). Not for the kernels that round P to e4m3 (cuda
    # fast; triton fast on Hopper): under a common offset their FP8 scores lose bits that move P's roundings, which no
    # bound here was measured for (bench/numerics.py's "cuda fast vs emulation" column). The portable triton fast
    # kernel's FP8 MMA loses to a common offset what its emulation keeps: 1.28e-2 at +100 (H200, bench/numerics.py),
    # hence 2e-2 there.
    bound = {("triton", "fast"): 2e-2}.get((backend, precision), 6e-3)
    if emulation_of(data, backend, "fp8", precision)[0] != "+Q+P":
        exact = emulate(data, backend, "fp8", precision)
        assert R.worst_row_relative_l2(out, exact) < bound
