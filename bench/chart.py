"""A bar chart of leaderboard.py's JSON: median µs per call (leaderboard timing) per shape and method, log scale,
with the FP8 read floor (the FP8 cache's bytes over the measured read ceiling) as a line. Needs matplotlib (not a
project dependency: `pip install matplotlib`).

    python3 bench/chart.py BENCH.json [BENCH2.json ...] --out chart.png [--title TEXT]

Several JSON files are merged (later rows of the same shape and method replace earlier ones), so a run of the
kernels and a run of the floor walks make one chart.
"""

import argparse
import json
import math
from pathlib import Path


def load(paths) -> tuple[list[str], dict, dict]:
    """(shapes in order, {(shape, method): µs}, {shape: FP8 floor µs})."""
    shapes, times, floors = [], {}, {}
    for path in paths:
        doc = json.loads(Path(path).read_text())
        for row in doc["rows"]:
            if row["shape"] not in shapes:
                shapes.append(row["shape"])
            if row.get("floor_us") is not None and row.get("kv_format") == "fp8":
                floors[row["shape"]] = row["floor_us"]
            if row.get("status") == "ok" and row.get("median_us"):
                times[(row["shape"], row["method"])] = row["median_us"]
    return shapes, times, floors


def draw(shapes, times, floors, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(m for _, m in times))
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(min(14, max(8, 1.6 * len(shapes))), 5.5))
    for i, method in enumerate(methods):
        xs = [s + (i - (len(methods) - 1) / 2) * width for s in range(len(shapes))]
        ax.bar(xs, [times.get((shape, method), math.nan) for shape in shapes], width, label=method,
               color=plt.cm.tab20(i % 20))
    if floors:
        ax.plot(range(len(shapes)), [floors.get(shape, math.nan) for shape in shapes], "k_", markersize=30,
                markeredgewidth=2, label="FP8 read floor")
    ax.set_xticks(range(len(shapes)), shapes)
    ax.set_yscale("log")
    ax.set_ylabel("µs per call (median, L2 flushed)")
    ax.set_xlabel("batch x kv length")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--title", default="MLA decode, µs per call")
    args = p.parse_args()
    draw(*load(args.json), args.out, args.title)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
