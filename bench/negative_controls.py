"""How far each GPU kernel is from the emulation of what it rounds, and how far the same kernel is with a planted
bug: the measurement the GPU tests' bounds come from (tests/test_negative_controls.py).

Per kernel (cuda wgmma and mma.sync, triton fast, precise and MXFP4, cuda MXFP4) and batch, the worst sequence's
relative L2 error of custom_kernel's output against numerics.emulate (float64, rounding what the kernel rounds, the
wgmma kernel's walk of splits and tiles included) of the true input, for the correct call and for three bugs made by
changing the call, not the kernel. Each batch comes as random-normal data and as grid data
(reference.generate_grid_input: the fast kernels' roundings exact, so that only their accumulations and bf16 outputs
remain). The bugs:
  sm_scale x 1.01   the kernel run with config["sm_scale"] 1% high
  out x 1.02        its output scaled by 1.02
  last row dropped  the first sequence's last KV row left out (kv_indptr[1] - 1: the next sequence gains it)

    python3 bench/negative_controls.py [--json PATH]      (a GPU; prints a Markdown table)
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

from numerics import emulate  # noqa: E402

import reference as R  # noqa: E402
import submission as S  # noqa: E402
from utils import scoped_env  # noqa: E402

# name -> (backend, KV format, precision)
KERNELS = {
    "cuda wgmma fp8": ("cuda", "fp8", "fast"),
    "cuda mma.sync fp8": ("cuda", "fp8", "precise"),
    "cuda mxfp4": ("cuda", "mxfp4", "fast"),
    "triton fp8 fast": ("triton", "fp8", "fast"),
    "triton fp8 precise": ("triton", "fp8", "precise"),
    "triton mxfp4": ("triton", "mxfp4", "fast"),
}
LENGTHS = {"mixed": [8191, 1, 4096, 0, 517, 33], "uniform 64x1024": [1024] * 64}
DATA = {"random": R.generate_varlen_input, "grid": R.generate_grid_input}
BATCHES = [f"{kind} {lengths}" for kind in DATA for lengths in LENGTHS]  # "random mixed", ..., "grid uniform 64x1024"


def batch_input(batch: str):
    """The input of a BATCHES entry, the same on every call."""
    kind, lengths = batch.split(" ", 1)
    return DATA[kind](LENGTHS[lengths], seed=len(LENGTHS[lengths]))


BUGS = ("correct", "sm_scale x 1.01", "out x 1.02", "last row dropped")


def with_bug(run, data, bug: str) -> torch.Tensor:
    """run(data) (a decode of an input tuple) with `bug` (BUGS) planted by changing the call, not the kernel."""
    q, kv_data, qo, kvp, config = data
    if bug == "sm_scale x 1.01":
        config = dict(config, sm_scale=config["sm_scale"] * 1.01)
    elif bug == "last row dropped":
        kvp = kvp.clone()
        kvp[1] -= 1
        config = dict(config, kv_seq_len=None)
    out = run((q, kv_data, qo, kvp, config))
    return out.float() * 1.02 if bug == "out x 1.02" else out


def exact(kernel: str, data) -> torch.Tensor:
    """The float64 emulation of what the kernel rounds on `data` (numerics.emulate), what every call is held to."""
    return emulate(data, *KERNELS[kernel])


def call(kernel: str, data, bug: str) -> torch.Tensor:
    """custom_kernel with the kernel's backend, format and precision forced, and `bug` planted."""
    backend, kv_format, precision = KERNELS[kernel]
    with scoped_env({"MLA_BACKEND": backend, "MLA_KV_FORMAT": kv_format, "MLA_PRECISION": precision}):
        return with_bug(S.custom_kernel, data, bug)


def measure(kernels, batches) -> list[dict]:
    rows = []
    for batch_name in batches:
        data = batch_input(batch_name)
        for kernel in kernels:
            row = {"kernel": kernel, "batch": batch_name}
            try:
                expected = exact(kernel, data)
                for bug in BUGS:
                    row[bug] = R.worst_row_relative_l2(call(kernel, data, bug), expected)
            except (RuntimeError, ValueError, ImportError) as e:  # a backend that cannot run here
                row.update({bug: f"skip: {e}"[:80] for bug in BUGS if bug not in row})
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| kernel | batch | " + " | ".join(BUGS) + " |", "|---|---|" + "---|" * len(BUGS)]
    for row in rows:
        cells = [f"{row[b]:.2e}" if isinstance(row[b], float) else row[b] for b in BUGS]
        lines.append(f"| {row['kernel']} | {row['batch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernels", default=",".join(KERNELS))
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    rows = measure(args.kernels.split(","), BATCHES)
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
