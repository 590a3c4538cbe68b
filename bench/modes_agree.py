"""Do eval.py's benchmark mode and leaderboard mode agree? Both run as the leaderboard's runner runs them, one after
the other, and their means are compared per case.

    python3 bench/modes_agree.py [--cases benchmarks.txt] [--tolerance 0.05] [--json PATH]

Each mode runs as `POPCORN_FD=<pipe> python3 eval.py {benchmark|leaderboard} CASES` in a subprocess (the
environment, MLA_BACKEND and MLA_KV_FORMAT included, passes through; its console output goes to stderr); the
`benchmark.N.*` lines it writes to the pipe are parsed back. Benchmark mode times one input over and over,
leaderboard mode a fresh input (new seed) every call, each call checked. With an L2 flush that hides the host's
part of a call (utils.FLUSH_TARGET_S) the two means agree; a flush too short lets leaderboard mode's slower host
path on new tensors into its times. Prints per case both means and bests in µs and the ratio of the means
(leaderboard / benchmark); the exit status is 1 when a mode fails or a ratio is off 1 by more than --tolerance.
On the CPU the modes need not agree: there is no flush, and the whole call, host path included, is timed.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("benchmark", "leaderboard")
STDERR_FD = 2  # the console output of eval.py goes here: stdout carries only the table


def run_mode(mode: str, cases: Path, timeout_s: float) -> tuple[int, dict[str, str]]:
    """(exit code, key -> value of every line written to the fd) of `eval.py mode cases` under POPCORN_FD."""
    read_fd, write_fd = os.pipe()
    env = {k: v for k, v in os.environ.items() if not k.startswith("POPCORN_")} | {"POPCORN_FD": str(write_fd)}
    proc = subprocess.Popen([sys.executable, str(ROOT / "eval.py"), mode, str(cases)], cwd=ROOT, env=env,
                            stdout=STDERR_FD, pass_fds=(write_fd,))
    os.close(write_fd)  # the child holds the only writer: EOF comes when it is done
    with os.fdopen(read_fd) as reader:
        lines = reader.read().splitlines()
    code = proc.wait(timeout=timeout_s)
    return code, dict(line.split(": ", 1) for line in lines if ": " in line)


def compare(results: dict[str, dict[str, str]], tolerance: float) -> tuple[list[dict], bool]:
    """Rows of the comparison (one per case, µs) and whether every case ran in both modes within tolerance."""
    bench, board = results["benchmark"], results["leaderboard"]
    count = int(bench.get("benchmark-count", 0))
    rows, ok = [], bench.get("check") == "pass" and board.get("check") == "pass"
    for idx in range(count):
        row = {"spec": bench.get(f"benchmark.{idx}.spec", "?")}
        for mode, values in results.items():
            for field in ("mean", "best"):
                value = values.get(f"benchmark.{idx}.{field}")
                row[f"{mode}_{field}_us"] = float(value) / 1e3 if value is not None else None
        timed = row["benchmark_mean_us"] is not None and row["leaderboard_mean_us"] is not None
        row["ratio"] = row["leaderboard_mean_us"] / row["benchmark_mean_us"] if timed else None
        row["agree"] = timed and abs(row["ratio"] - 1) <= tolerance
        ok = ok and row["agree"]
        rows.append(row)
    return rows, ok and count > 0


def render(rows: list[dict]) -> str:
    header = ("case", "benchmark mean", "benchmark best", "leaderboard mean", "leaderboard best", "ratio", "agree")
    cells = [header] + [(r["spec"], *(f"{r[key]:.1f}" if r[key] is not None else "-" for key in (
        "benchmark_mean_us", "benchmark_best_us", "leaderboard_mean_us", "leaderboard_best_us")),
        f"{r['ratio']:.3f}" if r["ratio"] is not None else "-", "yes" if r["agree"] else "NO") for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in
                               enumerate(zip(row, widths, strict=True))) for row in cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=Path, default=ROOT / "benchmarks.txt", help="a cases file (eval.py's)")
    parser.add_argument("--tolerance", type=float, default=0.05, help="largest |leaderboard / benchmark - 1|")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds each mode may take")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    results = {}
    for mode in MODES:
        code, values = run_mode(mode, args.cases.resolve(), args.timeout)
        results[mode] = values
        if code != 0 or values.get("check") != "pass":
            errors = {k: v for k, v in values.items() if k.endswith(".error")}
            print(f"{mode} mode failed (exit {code}, check {values.get('check', 'missing')}): {errors}",
                  file=sys.stderr)
    rows, ok = compare(results, args.tolerance)
    print(f"µs per call, eval.py's timing; ratio = leaderboard mean / benchmark mean, agree within "
          f"{100 * args.tolerance:g}%")
    print(render(rows))
    if args.json is not None:
        args.json.write_text(json.dumps({"tolerance": args.tolerance, "ok": ok, "rows": rows}, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
