"""How far each GPU kernel is from the emulation of what it rounds, and how far the same kernel is with a planted
bug: the measurement the GPU tests' bounds come from (tests/test_negative_controls.py).

Per kernel (cuda wgmma and mma.sync, triton fast, precise and MXFP4, cuda MXFP4) and batch, the worst sequence's
relative L2 error of custom_kernel's output against testkit.emulation.emulate (float64, rounding what the kernel
rounds, the wgmma kernel's walk of splits and tiles included) of the true input, for the correct call and for the
planted bugs of testkit.controls. Each batch comes as random-normal data and as grid data
(testkit.inputs.generate_grid_input: the fast kernels' roundings exact, so that only their accumulations and bf16
outputs remain).

    python3 bench/negative_controls.py [--json PATH]      (a GPU; prints a Markdown table)
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import reference as R  # noqa: E402
from testkit.controls import BATCHES, BUGS, KERNELS, batch_input, call, exact  # noqa: E402


def measure(kernels, batches) -> list[dict]:
    rows = []
    for batch_name in batches:
        data = batch_input(batch_name)
        for kernel in kernels:
            row = {"kernel": kernel, "batch": " ".join(batch_name)}
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
