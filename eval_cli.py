"""The local CLI of eval.py (`python eval.py` with POPCORN_FD unset runs it):

    python eval.py [--mode {test,benchmark,all}] [--backend {auto,aiter,cuda,triton,torch}] [--kv-format {fp8,mxfp4}]
                   [--precision {fast,precise}] [--cases PATH] [--json PATH] [--full]
    python eval.py --write-cases [--cases task.yml]

runs the tests, then the benchmarks, of task.yml (or of a cases file, whose cases serve as both) on this machine's
device and prints one table and the geometric mean of the benchmark means; exit code 1 when anything fails, 2 on a
configuration error (an unknown or unavailable backend, an unknown KV format or precision: one message, before any
case runs).
On a CPU-only machine the shapes are scaled down unless --full is given (see scale_for_cpu). The header goes to
stdout first, per-case progress to stderr, the table to stdout last.

The cases, the timing, the checks and the worker process are eval.py's (the leaderboard protocol's), so both
faces time and judge a call alike.
"""

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import torch
import yaml

from eval import (
    BENCHMARK_RULE,
    BENCHMARK_WARMUP_RULE,
    EXIT_USAGE,
    Case,
    StopRule,
    _progress,
    _synchronize,
    _time_calls,
    clone_data,
    format_case,
    parse_cases,
    spawn_worker,
)
from reference import (
    LEADERBOARD_ATOL,
    LEADERBOARD_MAX_MISMATCH,
    LEADERBOARD_RTOL,
    REL_L2_BOUND,
    check_against,
    generate_input,
    kv_format_under_test,
    ref_kernel,
    relative_l2,
)
from utils import get_device

TASK_YML = Path(__file__).resolve().parent / "task.yml"
CASES_FILES = {"tests": "tests.txt", "benchmarks": "benchmarks.txt"}  # task.yml section -> cases file

# CPU-only machines without --full: the task.yml shapes (up to 2M KV rows) take minutes on a few cores, so each
# case keeps its seed and shape class but shrinks: batch capped, kv divided (sequences already short run as given).
CPU_MAX_BATCH = 32
CPU_KV_DIVISOR = 8
CPU_MIN_KV = 128
CPU_SCALE_RULE = (f"batchsize capped at {CPU_MAX_BATCH}; kvseqlen divided by {CPU_KV_DIVISOR}, never below "
                  f"{CPU_MIN_KV}, and kept when already shorter")

# The CLI on a CPU: half a second of summed call time per case, a mean good to a few percent in a default run that
# stays short (docs/design-notes.md, "The local CLI").
CLI_CPU_RULE = StopRule(max_repeats=100, max_time_ns=5e8)


# ---------------------------------------------------------------------------------------------------------
# Cases: task.yml's sections, the cases files made from them, the CPU's smaller stand-ins
# ---------------------------------------------------------------------------------------------------------


def load_task_cases(task_yml: Path) -> dict[str, list[Case]]:
    """task.yml's `tests` and `benchmarks` sections as cases (the file is the single source of truth)."""
    task = yaml.safe_load(task_yml.read_text())
    return {section: [Case(spec=format_case(args), args=dict(args)) for args in task[section]]
            for section in CASES_FILES}


def write_cases_files(task_yml: Path) -> list[Path]:
    """Regenerates tests.txt and benchmarks.txt next to task_yml; returns their paths."""
    written = []
    for section, cases in load_task_cases(task_yml).items():
        path = task_yml.parent / CASES_FILES[section]
        path.write_text("".join(case.spec + "\n" for case in cases))
        written.append(path)
    return written


def scale_for_cpu(case: Case) -> Case:
    """The CPU stand-in of a case (CPU_SCALE_RULE): same seed and qseqlen, smaller batch and kv."""
    args = dict(case.args)
    args["batchsize"] = min(args["batchsize"], CPU_MAX_BATCH)
    kv = args["kvseqlen"]
    args["kvseqlen"] = max(kv // CPU_KV_DIVISOR, min(kv, CPU_MIN_KV))
    return Case(spec=format_case(args), args=args)


# ---------------------------------------------------------------------------------------------------------
# One case in the worker process, and the table
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class CaseResult:
    """One row of the CLI's table (and of its --json output)."""
    kind: str  # "test" or "benchmark"
    spec: str  # the shape that ran
    task_spec: str  # the shape asked for (differs from spec when scaled down for the CPU)
    backend: str | None
    kv_format: str | None
    passed: bool
    message: str
    max_abs_err: float | None = None
    rel_l2_err: float | None = None
    runs: int | None = None
    mean_us: float | None = None
    best_us: float | None = None
    kv_gbps: float | None = None  # bytes of the KV format read / mean time


def kv_bytes_read(total_kv: int, kv_format: str) -> int:
    """Bytes of the cache a kernel must read once: FP8 rows of 576 B and the per-tensor fp32 scale, or MXFP4 rows
    of 288 B of codes and 18 E8M0 block scales."""
    if kv_format == "fp8":
        return total_kv * 576 + 4
    return total_kv * (288 + 18)


def _backend_of(submission, device: torch.device) -> tuple[str, str]:
    """(backend, KV format) the submission will run with (its leaderboard_backend, or an older file's
    select_backend(device); its select_kv_format). A submission without them (any leaderboard entry may lack them)
    gets "-" and the format the check assumes."""
    select_backend = getattr(submission, "leaderboard_backend", None) or getattr(submission, "select_backend", None)
    select_kv_format = getattr(submission, "select_kv_format", kv_format_under_test)
    return (select_backend(device) if select_backend is not None else "-"), select_kv_format()


def _worker_describe() -> dict:
    """The device, and the backend and KV format the submission will use there (an error text if it cannot: an
    unknown or unavailable backend, an unknown KV format)."""
    import submission

    device = get_device()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    info = {"device_type": device.type, "device": name}
    try:
        info["backend"], info["kv_format"] = _backend_of(submission, device)
    except (RuntimeError, ValueError) as exc:
        info["error"] = str(exc)
    return info


def _worker_evaluate(case: Case, kind: str, task_spec: str, rule: StopRule | None) -> CaseResult:
    """Check one case (and time it when rule is given) for the CLI, with the error numbers next to the verdict."""
    import submission

    device = get_device()
    backend, kv_format = _backend_of(submission, device)
    data = generate_input(**case.args)
    output = submission.custom_kernel(clone_data(data))
    _synchronize()
    expected = ref_kernel(data)
    passed, message = check_against(data, output, expected, kv_format)
    result = CaseResult(kind=kind, spec=case.spec, task_spec=task_spec, backend=backend, kv_format=kv_format,
                        passed=passed, message=message)
    if isinstance(output, torch.Tensor) and output.shape == expected.shape:
        result.max_abs_err = (output.float() - expected.float()).abs().max().item() if output.numel() else 0.0
        result.rel_l2_err = relative_l2(output, expected)
    del output, expected
    if rule is None or not passed:
        return result
    stats = _time_calls(submission.custom_kernel, case.args, data, False, rule)
    result.runs, result.mean_us, result.best_us = stats.runs, stats.mean / 1e3, stats.best / 1e3
    result.kv_gbps = kv_bytes_read(int(data[3][-1].item()), kv_format) / stats.mean
    return result


SHORT_KEYS = {"batchsize": "bs", "qseqlen": "q", "kvseqlen": "kv"}


def _label(spec: str) -> str:
    return " ".join(f"{SHORT_KEYS.get(k, k)}={v}" for k, v in parse_cases(spec)[0].args.items())


def _case_column(result: CaseResult) -> str:
    """The shape that ran, and where it was scaled down the task's values it replaced."""
    ran, asked = parse_cases(result.spec)[0].args, parse_cases(result.task_spec)[0].args
    replaced = [f"{SHORT_KEYS.get(k, k)}={v}" for k, v in asked.items() if ran.get(k) != v]
    return _label(result.spec) + (f" (from {' '.join(replaced)})" if replaced else "")


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(results: list[CaseResult]) -> str:
    header = ("kind", "case", "backend", "kv", "check", "max_abs_err", "rel_l2_err", "mean_us", "best_us", "GB/s")
    rows = []
    for r in results:
        rows.append((r.kind, _case_column(r), r.backend or "-", r.kv_format or "-", "pass" if r.passed else "FAIL",
                     _fmt(r.max_abs_err, ".3e"), _fmt(r.rel_l2_err, ".3e"), _fmt(r.mean_us, ".1f"),
                     _fmt(r.best_us, ".1f"), _fmt(r.kv_gbps, ".3g")))
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    text_columns = 5  # kind .. check left-aligned, the numbers right-aligned
    lines = ["  ".join(cell.ljust(w) if i < text_columns else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths, strict=True))) for row in [header, *rows]]
    failures = [f"  {r.kind} {_label(r.spec)}: {r.message}" for r in results if not r.passed]
    return "\n".join(lines + (["failures:", *failures] if failures else []))


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _apply_env(name: str, value: str | None) -> None:
    """The CLI's --backend / --kv-format / --precision become the submission's environment (the spawned worker
    inherits it)."""
    if value is not None:
        os.environ[name] = value


def cli_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Run the MLA decode tests and benchmarks on this machine and print one table. With POPCORN_FD "
                    "set, speaks the leaderboard's protocol instead: eval.py {test|benchmark|leaderboard|profile} "
                    "CASES_FILE.")
    parser.add_argument("--mode", choices=("test", "benchmark", "all"), default="all")
    parser.add_argument("--backend", choices=("auto", "aiter", "cuda", "triton", "torch"),
                        help="sets MLA_BACKEND for the run (default: the environment's, else auto)")
    parser.add_argument("--kv-format", choices=("fp8", "mxfp4"),
                        help="sets MLA_KV_FORMAT for the run (default: the environment's, else fp8)")
    parser.add_argument("--precision", choices=("fast", "precise"),
                        help="sets MLA_PRECISION for the run (default: the environment's, else fast)")
    parser.add_argument("--cases", type=Path, default=TASK_YML,
                        help="task.yml (tests and benchmarks sections) or a cases file (its cases serve as both)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--full", action="store_true", help="on a CPU, run the real shapes instead of scaled ones")
    parser.add_argument("--write-cases", action="store_true",
                        help="regenerate tests.txt and benchmarks.txt next to the task.yml (--cases) and exit")
    return parser


def _cli_cases(path: Path) -> tuple[list[Case], list[Case]]:
    if path.suffix in (".yml", ".yaml"):
        sections = load_task_cases(path)
        return sections["tests"], sections["benchmarks"]
    cases = parse_cases(path.read_text())
    return cases, cases


class CliWorker:
    """The CLI's spawned worker, respawned when a crash kills it so that the remaining cases still run."""

    def __init__(self):
        self.pool = spawn_worker(42)

    def call(self, fn, *args):
        try:
            return self.pool.submit(fn, *args).result()
        except BrokenProcessPool:
            self.pool.shutdown(cancel_futures=True)
            self.pool = spawn_worker(42)
            raise

    def close(self) -> None:
        self.pool.shutdown()


def _describe_run(info: dict, scaled: bool, cases_source: Path) -> list[str]:
    on_cpu = info["device_type"] == "cpu"
    lines = [f"device: {info['device']}",
             f"backend: {info['backend']} (MLA_BACKEND={os.environ.get('MLA_BACKEND', 'auto')}), "
             f"kv format: {info['kv_format']}, precision: {os.environ.get('MLA_PRECISION', 'the default')}",
             "timing: " + ("wall clock (time.perf_counter_ns)" if on_cpu else "GPU events, L2 flushed before each"),
             f"check: leaderboard rule (rtol {LEADERBOARD_RTOL:g}, atol {LEADERBOARD_ATOL:g}, at most "
             f"{100 * LEADERBOARD_MAX_MISMATCH:g}% missed) and strict gate (every sequence's rel-L2 vs the BF16 truth "
             f"<= {REL_L2_BOUND[info['kv_format']]} for {info['kv_format']} KV)",
             f"cases: {cases_source}"]
    if scaled:
        lines.append(f"CPU only: shapes scaled down ({CPU_SCALE_RULE}); --full runs the real shapes")
    return lines


def cli_main(argv: list[str]) -> int:
    parser = cli_parser()
    args = parser.parse_args(argv)
    if args.write_cases:
        if args.cases.suffix not in (".yml", ".yaml"):
            parser.error(f"--write-cases reads a task.yml, not {args.cases}")
        for path in write_cases_files(args.cases):
            print(f"wrote {path}")
        return 0
    _apply_env("MLA_BACKEND", args.backend)
    _apply_env("MLA_KV_FORMAT", args.kv_format)
    _apply_env("MLA_PRECISION", args.precision)
    try:
        tests, benchmarks = _cli_cases(args.cases)
    except (OSError, ValueError, KeyError, yaml.YAMLError) as exc:
        parser.error(f"--cases {args.cases}: {type(exc).__name__}: {exc}")
    planned = ([("test", case) for case in tests] if args.mode != "benchmark" else []) + (
        [("benchmark", case) for case in benchmarks] if args.mode != "test" else [])
    started = time.perf_counter()
    worker = CliWorker()
    results: list[CaseResult] = []
    try:
        info = worker.call(_worker_describe)
        if "error" in info:  # the same error in every case: say it once, before any runs
            print(f"eval.py: configuration error: {info['error']}", file=sys.stderr)
            return EXIT_USAGE
        on_cpu = info["device_type"] == "cpu"
        scaled = on_cpu and not args.full
        print("\n".join(_describe_run(info, scaled, args.cases)), flush=True)
        to_run = [(kind, case, scale_for_cpu(case) if scaled else case) for kind, case in planned]
        timed = [run_case for kind, _, run_case in to_run if kind == "benchmark"]
        if timed:  # as the leaderboard does: compilation and allocator growth stay out of the first case
            _progress(f"warm-up on {_label(timed[0].spec)} ...")
            try:
                worker.call(_worker_evaluate, timed[0], "benchmark", timed[0].spec, BENCHMARK_WARMUP_RULE)
            except Exception as exc:  # the case itself reports it below
                _progress(f"warm-up failed: {type(exc).__name__}: {exc}")
        for idx, (kind, case, run_case) in enumerate(to_run, 1):
            tag = f"[{idx}/{len(to_run)}] {kind} {_label(run_case.spec)}"
            _progress(f"{tag} ...")
            case_started = time.perf_counter()
            rule = (CLI_CPU_RULE if on_cpu else BENCHMARK_RULE) if kind == "benchmark" else None
            try:
                result = worker.call(_worker_evaluate, run_case, kind, case.spec, rule)
            except Exception as exc:  # the submission's error or crash fails this case
                result = CaseResult(kind, run_case.spec, case.spec, info.get("backend"), info.get("kv_format"),
                                    False, f"{type(exc).__name__}: {exc}")
            results.append(result)
            _progress(f"{tag}: {'pass' if result.passed else 'FAIL'} ({time.perf_counter() - case_started:.1f} s)")
    finally:
        worker.close()
    bench_means = [r.mean_us for r in results if r.kind == "benchmark"]
    all_timed = bool(bench_means) and None not in bench_means
    geomean = geometric_mean(bench_means) if all_timed else None
    passed = all(r.passed for r in results)
    elapsed = time.perf_counter() - started
    summary = [f"{sum(r.passed for r in results)}/{len(results)} passed in {elapsed:.1f} s"]
    if bench_means:
        summary.append(f"geometric mean of benchmark means: {geomean:.1f} us" if all_timed
                       else "geometric mean of benchmark means: n/a (a benchmark failed)")
    print("\n".join(["", format_table(results), "", *summary]))
    if args.json is not None:
        report = {"device": info["device"], "device_type": info["device_type"], "scaled": scaled,
                  "scale_rule": CPU_SCALE_RULE if scaled else None, "cases_source": str(args.cases),
                  "passed": passed, "elapsed_s": elapsed, "geomean_mean_us": geomean,
                  "results": [dataclasses.asdict(r) for r in results]}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if passed else 1
