"""The aiter path's Q quantization (submission.QQuantizer) on one GPU: its Triton form (two kernels) against its torch
form (three), each checked bit for bit against reference.quantize_fp8, then timed the leaderboard's way
(utils.Timer: L2 flushed, events around the one call; median of --iters, best of 3 interleaved rounds) and for host
time (utils.Timer.host: the median CPU time of one call to return, without a synchronize after it). Needs no aiter:
the quantizer alone, in e4m3fn (gfx950's FP8), so an NVIDIA GPU stands in for the MI355X here; the numbers are that
GPU's.

    python3 bench/q_quant.py [--batches 4,32,64,256] [--iters 60]

On the CPU it runs under TRITON_INTERPRET=1 (tests/test_bench.py does, with tests/triton_interpreter.py's patch of the
interpreter's fp32 -> fp8 rounding, without which the Triton form's casts are wrong there).
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import reference as R  # noqa: E402
import submission as S  # noqa: E402
from utils import Timer  # noqa: E402

FP8 = torch.float8_e4m3fn


def forms(batch: int, device: torch.device) -> dict[str, S.QQuantizer]:
    triton_form = S.QQuantizer(batch, FP8, device)
    torch_form = S.QQuantizer(batch, FP8, device, allow_triton=False)
    if not triton_form.blocks:
        raise SystemExit(f"q_quant.py: the Triton form does not run here ({device}: needs triton and a GPU, or "
                         "TRITON_INTERPRET=1)")
    return {"triton, 2 kernels": triton_form, "torch, 3 kernels": torch_form}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="4,32,64,256")
    parser.add_argument("--iters", type=int, default=60)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    timer = Timer(device)
    print("| batch | form | µs median (L2 flushed) | host µs per call | bit for bit reference.quantize_fp8 |")
    print("|---|---|---|---|---|")
    for batch in map(int, args.batches.split(",")):
        torch.manual_seed(batch)
        q = torch.randn((batch, S.AITER_HEADS, S.QK_HEAD_DIM), device=device).to(torch.bfloat16)
        want, want_scale = R.quantize_fp8(q, FP8)
        quantizers = forms(batch, device)
        exact = {}
        for name, quant in quantizers.items():
            q8 = quant(q)
            exact[name] = torch.equal(q8.view(torch.uint8), want.view(torch.uint8)) and torch.equal(quant.scale,
                                                                                                   want_scale)
        times: dict[str, list[float]] = {name: [] for name in quantizers}
        for _ in range(3):
            for name, quant in quantizers.items():
                times[name].append(statistics.median(timer.leaderboard(lambda quant=quant, q=q: quant(q), args.iters)))
        for name, quant in quantizers.items():
            host = timer.host(lambda quant=quant, q=q: quant(q), 20 * args.iters)
            print(f"| {batch} | {name} | {min(times[name]):.2f} | {host:.1f} | {'yes' if exact[name] else 'NO'} |",
                  flush=True)
        if not all(exact.values()):
            raise SystemExit("q_quant.py: a form differs from reference.quantize_fp8")


if __name__ == "__main__":
    main()
