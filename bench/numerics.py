"""Accuracy under stress: every backend and precision on logits shifted by a common offset and on attention sinks.

Softmax is shift-invariant, so a common logit offset leaves the exact output unchanged; what changes is how much
of each score's precision the kernels keep. Inputs from testkit.inputs.generate_shifted_input (q[..., 575] = offset,
k[..., 575] = 24, so every logit grows by the offset; a sink: one key per sequence the offset above the others).
Every figure is the worst sequence's relative L2 error against the BF16 truth (reference.ref_kernel), the quantity
the strict gate bounds (0.08 for the FP8 cache).

Error sources apart (float64 emulations of what the kernels round, on the same inputs):
  cache     fp32-exact attention with bf16 Q over the dequantized FP8 cache: the cache's own error (the torch
            backend's computation, and the floor for every FP8 kernel)
  +Q        Q rounded to e4m3 with one scale per head (448 / max|q_h|): the fast score product's Q
  +Q+P      and the softmax weights rounded to e4m3 as 2^8 p (the cuda backend's fast kernel; its row sums are not
            rounded); in the truth columns for one split of 64-row tiles, in the "cuda fast vs emulation" column
            (testkit.emulation.emulate) with the splits of the kernel's launch plan
What a kernel adds beyond its emulation is its score product's accumulation (the FP8 MMA's, for the fast modes),
which a common logit offset makes visible.

Usage (a GPU: cuda, triton and torch rows; the CPU: torch, and triton under TRITON_INTERPRET=1, where the dots are
exact fp32 and show only the rounding):
    python3 bench/numerics.py [--lens 10,118,64,64,1,33] [--backends cuda,triton,torch] [--json P] [--markdown P]
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import reference as R  # noqa: E402
import submission as S  # noqa: E402
from testkit.emulation import EMULATIONS, emulation_of, kernel_emulation  # noqa: E402
from testkit.inputs import generate_shifted_input  # noqa: E402
from utils import scoped_env  # noqa: E402

CASES = [("shift 0", 0.0, False), ("shift 30", 30.0, False), ("shift 100", 100.0, False), ("shift 300", 300.0, False),
         ("shift 1000", 1000.0, False), ("sink 30", 30.0, True), ("sink 100", 100.0, True)]
def run_backend(data, backend: str, precision: str) -> torch.Tensor | str:
    """custom_kernel's output with the backend and precision forced, or why it cannot run here."""
    with scoped_env({"MLA_BACKEND": backend, "MLA_PRECISION": precision, "MLA_KV_FORMAT": "fp8"}):
        try:
            return S.custom_kernel(data)
        except (RuntimeError, ValueError, NotImplementedError) as e:
            return f"skipped: {str(e).splitlines()[0][:100]}"


def measure(lens: list[int], backends: list[str], device: torch.device) -> dict:
    rows, skipped = [], {}
    for name, shift, sink in CASES:
        data = generate_shifted_input(lens, seed=len(lens) + int(shift), shift=shift, sink=sink, device=device)
        truth = R.ref_kernel(data)
        row = {"case": name}
        emulations = {(e, None): kernel_emulation(data, e) for e in EMULATIONS}  # (name, tiling) -> output
        for (emulation, _), exact in emulations.items():
            row[emulation] = R.worst_row_relative_l2(exact.to(torch.bfloat16), truth)
        for backend in backends:
            for precision in ("fast", "precise"):
                out = run_backend(data, backend, precision)
                column = f"{backend} {precision}"
                if isinstance(out, str):
                    skipped[column] = out
                    continue
                finite = bool(torch.isfinite(out).all())
                row[column] = R.worst_row_relative_l2(out, truth) if finite else float("nan")
                # the kernel's own output against the emulation of what it rounds, not against the truth
                how = emulation_of(data, backend, "fp8", precision)
                if how not in emulations:  # the cuda wgmma kernel's walk
                    emulations[how] = kernel_emulation(data, how[0], "fp8", how[1])
                exact = emulations[how]
                row[f"{column} vs emulation"] = R.worst_row_relative_l2(out, exact) if finite else float("nan")
        rows.append(row)
    return {"lens": lens, "device": str(device), "bound": R.REL_L2_BOUND["fp8"], "rows": rows, "skipped": skipped}


def markdown(result: dict) -> str:
    columns = [c for c in result["rows"][0] if c != "case"]
    bound = result["bound"]
    lines = [f"Worst-sequence rel-L2 vs the BF16 truth, KV lengths {result['lens']} on {result['device']} "
             f"(strict gate {bound:g}; `*` = over it)", "",
             "| case | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for row in result["rows"]:
        cells = [f"{row[c]:.4f}{'*' if not row[c] <= bound else ''}" if c in row else "-" for c in columns]
        lines.append(f"| {row['case']} | " + " | ".join(cells) + " |")
    lines += [f"- {column}: {why}" for column, why in result["skipped"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lens", default="10,118,64,64,1,33", help="KV lengths of the batch, comma-separated")
    parser.add_argument("--backends", default=None, help="default: cuda,triton,torch on a GPU, torch on the CPU "
                        "(and triton under TRITON_INTERPRET=1)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if args.backends:
        backends = args.backends.split(",")
    elif device.type == "cuda":
        backends = ["cuda", "triton", "torch"]
    else:
        backends = ["triton", "torch"] if os.environ.get("TRITON_INTERPRET") == "1" else ["torch"]
    with torch.no_grad():
        result = measure([int(n) for n in args.lens.split(",")], backends, device)
    text = markdown(result)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
