"""The worst-sequence error of the cuda and triton backends' fast kernels against the emulation of what they round,
over the GPU tests' random-data batches (the 8 task shapes and the variable-length batches of tests/test_cuda_gpu.py
and tests/test_triton_gpu.py, with their seeds): the measurements behind test_cuda_gpu's RANDOM_WGMMA_BOUND and
test_triton_gpu's KERNEL_REL_L2 on a GPU.

Columns: cuda (the wgmma kernel on Hopper) against testkit.emulation's emulate (its splits and tiles walked), against
the "+Q+P" emulation of one split (kernel_emulation), and against fp32 attention with bf16 Q; triton against
testkit.attention's triton_reference (fp32 with its Q's rounding).

    python3 bench/emulation_errors.py      (an NVIDIA GPU; prints one row per batch and the worst per column)
"""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

import reference as R  # noqa: E402
import submission as S  # noqa: E402
from testkit.attention import fp32_attention, triton_reference  # noqa: E402
from testkit.emulation import emulate, kernel_emulation  # noqa: E402
from utils import scoped_env  # noqa: E402

TASK = [(4, 1024), (4, 8192), (32, 1024), (32, 8192), (64, 1024), (64, 8192), (256, 1024), (256, 8192)]
VARLEN = [[1], [0, 5, 1, 77, 1000, 3], [8191, 1, 4096, 0], [513] * 40, list(range(0, 3000, 97)), [1, 777, 0, 3001]]
TASK_SEED = {"cuda": lambda batch, kv: batch + kv, "triton": lambda batch, kv: batch * 7 + kv}  # as each test seeds


def references(backend: str, kv_format: str, data) -> dict[str, torch.Tensor]:
    if backend == "cuda":
        return {"vs emulate": emulate(data, "cuda", kv_format, "fast"),
                "vs +Q+P one split": kernel_emulation(data, "+Q+P", kv_format),
                "vs fp32": fp32_attention(data, kv_format)}
    return {"vs triton_reference": triton_reference(data, kv_format)}


def main() -> None:
    worst: dict[tuple, float] = {}
    for backend, seed in TASK_SEED.items():
        batches = [(f"{b}x{kv}", lambda b=b, kv=kv, seed=seed: R.generate_input(b, 1, kv, seed=seed(b, kv)))
                   for b, kv in TASK]
        batches += [(f"b{len(lens)}_max{max(lens)}", lambda lens=lens: R.generate_varlen_input(lens, seed=len(lens)))
                    for lens in VARLEN]
        for kv_format in ("fp8", "mxfp4"):
            for name, make in batches:
                data = make()
                with scoped_env({"MLA_BACKEND": backend, "MLA_KV_FORMAT": kv_format, "MLA_PRECISION": "fast"}):
                    out = S.custom_kernel(data)
                errors = {col: R.worst_row_relative_l2(out, ref) for col, ref in references(backend, kv_format,
                                                                                             data).items()}
                for col, error in errors.items():
                    worst[(backend, kv_format, col)] = max(worst.get((backend, kv_format, col), 0.0), error)
                print(backend, kv_format, name, {col: f"{e:.2e}" for col, e in errors.items()}, flush=True)
                del data, out
                torch.cuda.empty_cache()
    for (backend, kv_format, col), error in worst.items():
        print(f"worst {backend} {kv_format} {col}: {error:.2e}")


if __name__ == "__main__":
    main()
