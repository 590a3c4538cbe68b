"""Evaluation harness for the amd-mixed-mla leaderboard, with two faces.

Leaderboard protocol (POPCORN_FD set), as the runner drives the leaderboard's own eval.py:

    POPCORN_FD=<fd> [POPCORN_SEED=<n>] python eval.py {test|benchmark|leaderboard|profile} <cases-file>

Every line of the cases file is `batchsize: 4; qseqlen: 1; kvseqlen: 1024; seed: 4220`. Results go to the fd as
`key: value` lines: test-count, test.N.spec, test.N.status (pass|fail), test.N.error or test.N.message;
benchmark-count, benchmark.N.spec, benchmark.N.runs|mean|std|err|best|worst (nanoseconds), or
benchmark.N.status: fail and benchmark.N.error; profile mode benchmark.N.report (base64); finally check: pass|fail.
POPCORN_SEED, when set, is mixed into every case's seed and hidden from the submission. Exit codes are the
leaderboard's: 0; 112 when a test or benchmark fails (leaderboard and profile modes exit 0 whatever happens: the
`check` line carries their verdict); 113 when the cases file cannot be read or parsed; 2 for a bad command line.
The submission runs in one spawned worker process that inherits neither the fd nor POPCORN_SEED.

Local CLI (POPCORN_FD unset):

    python eval.py [--mode {test,benchmark,all}] [--backend {auto,aiter,cuda,triton,torch}] [--kv-format {fp8,mxfp4}]
                   [--precision {fast,precise}] [--cases PATH] [--json PATH] [--full]
    python eval.py --write-cases [--cases task.yml]

runs the tests, then the benchmarks, of task.yml (or of a cases file, whose cases serve as both) on this machine's
device and prints one table and the geometric mean of the benchmark means; exit code 1 when anything fails, 2 on a
configuration error (an unknown or unavailable backend, an unknown KV format or precision: one message, before any
case runs).
On a CPU-only machine the shapes are scaled down unless --full is given (see scale_for_cpu). The header goes to
stdout first, per-case progress to stderr, the table to stdout last.

Timing: utils.Timer.call, the leaderboard's way: CUDA/HIP events around each call, with the L2 flushed before it
(utils.clear_l2_cache, which also keeps the GPU busy long enough to hide the host's part of the call); the wall
clock on the CPU. Every check reads a copy of the inputs that the submission never received (it
gets the other copy), so writing into its inputs cannot change what its output is compared with.
"""

import argparse
import base64
import dataclasses
import json
import math
import multiprocessing
import os
import re
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import torch
import yaml

from reference import (
    LEADERBOARD_ATOL,
    LEADERBOARD_MAX_MISMATCH,
    LEADERBOARD_RTOL,
    REL_L2_BOUND,
    check_against,
    check_implementation,
    generate_input,
    kv_format_under_test,
    ref_kernel,
    relative_l2,
)
from utils import Timer, get_device, set_seed

REPO_DIR = Path(__file__).resolve().parent
TASK_YML = REPO_DIR / "task.yml"
CASES_FILES = {"tests": "tests.txt", "benchmarks": "benchmarks.txt"}  # task.yml section -> cases file

EXIT_USAGE = 2
EXIT_CHECK_FAILED = 112
EXIT_BAD_CASES = 113

# One `key: value` field of a cases line, exactly the leaderboard's grammar.
CASE_FIELD = re.compile(r"\s*([a-zA-Z_]\w*):\s*([a-zA-Z_]\w*|[+-]?[0-9]+)\s*")

# CPU-only machines without --full: the task.yml shapes (up to 2M KV rows) take minutes on a few cores, so each
# case keeps its seed and shape class but shrinks: batch capped, kv divided (sequences already short run as given).
CPU_MAX_BATCH = 32
CPU_KV_DIVISOR = 8
CPU_MIN_KV = 128
CPU_SCALE_RULE = (f"batchsize capped at {CPU_MAX_BATCH}; kvseqlen divided by {CPU_KV_DIVISOR}, never below "
                  f"{CPU_MIN_KV}, and kept when already shorter")


# ---------------------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    spec: str  # the line as written: the runner reports results under it
    args: dict  # keyword arguments of reference.generate_input


def _parse_value(token: str) -> int | bool | str:
    if re.fullmatch(r"[+-]?[0-9]+", token):
        return int(token)
    return {"true": True, "false": False}.get(token, token)


def _format_value(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def format_case(args: dict) -> str:
    """The cases-file line of a task.yml case: the form the runner hands to eval.py."""
    return "; ".join(f"{key}: {_format_value(value)}" for key, value in args.items())


def parse_cases(text: str) -> list[Case]:
    """Cases-file lines -> cases; blank lines are skipped, anything else off the grammar raises ValueError."""
    cases = []
    for line in text.splitlines():
        if not line.strip():
            continue
        args = {}
        for part in line.split(";"):
            field = CASE_FIELD.fullmatch(part)
            if field is None:
                raise ValueError(f"invalid test case: {line!r}: {part!r}")
            args[field[1]] = _parse_value(field[2])
        cases.append(Case(spec=line, args=args))
    return cases


def combine_seeds(case_seed: int, secret: int) -> int:
    """Cantor pairing of a public case seed and the runner's secret seed, as the leaderboard does: a large secret
    gives a large combined seed whatever the (small, public) case seed is, so the public seed reveals nothing."""
    return case_seed + (case_seed + secret) * (case_seed + secret + 1) // 2


def mix_secret_seed(cases: list[Case], secret: int) -> None:
    for case in cases:
        if "seed" in case.args:
            case.args["seed"] = combine_seeds(case.args["seed"], secret)


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
# Work done in the worker process: data generation, the submission's calls, checks and timing
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Stats:
    """Durations of the timed calls in nanoseconds; the field names are the protocol's keys."""
    runs: int
    mean: float
    std: float
    err: float
    best: float
    worst: float


@dataclasses.dataclass(frozen=True)
class StopRule:
    """When a benchmark stops repeating: after at least 3 calls, once the standard error of the mean falls under
    0.1% of it, the summed call time exceeds max_time_ns, or 120 s of wall clock have passed; at most max_repeats."""
    max_repeats: int
    max_time_ns: float
    min_runs: int = 3
    target_rel_err: float = 1e-3
    max_wall_ns: float = 120e9


# The leaderboard's rules: benchmark mode, leaderboard mode and the warm-up each of them runs first.
BENCHMARK_RULE = StopRule(max_repeats=1000, max_time_ns=50e9)
BENCHMARK_WARMUP_RULE = StopRule(max_repeats=100, max_time_ns=1e8)
LEADERBOARD_RULE = StopRule(max_repeats=100, max_time_ns=30e9)
LEADERBOARD_WARMUP_RULE = StopRule(max_repeats=100, max_time_ns=1e7)
# The CLI on a CPU: half a second of summed call time per case gives a mean good to a few percent, and the
# whole default run stays under a minute on 2 cores.
CLI_CPU_RULE = StopRule(max_repeats=100, max_time_ns=5e8)


def calculate_stats(durations: list[float]) -> Stats:
    runs = len(durations)
    mean = sum(durations) / runs
    std = math.sqrt(sum((d - mean) ** 2 for d in durations) / (runs - 1)) if runs > 1 else 0.0
    return Stats(runs=runs, mean=mean, std=std, err=std / math.sqrt(runs), best=float(min(durations)),
                 worst=float(max(durations)))


def _should_stop(rule: StopRule, durations: list[float], started_ns: int) -> bool:
    if len(durations) < rule.min_runs:
        return False
    stats = calculate_stats(durations)
    return (stats.err / stats.mean < rule.target_rel_err or stats.mean * stats.runs > rule.max_time_ns
            or time.perf_counter_ns() - started_ns > rule.max_wall_ns)


def clone_data(data):
    """A deep copy of every tensor in data (nested tuples, lists, dicts), other values shared."""
    if isinstance(data, tuple):
        return tuple(clone_data(x) for x in data)
    if isinstance(data, list):
        return [clone_data(x) for x in data]
    if isinstance(data, dict):
        return {key: clone_data(value) for key, value in data.items()}
    if isinstance(data, torch.Tensor):
        return data.clone()
    return data


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def fresh_inputs(args: dict):
    """Leaderboard mode's input for each timed call, endlessly: the case's shape from a new seed each time (+13 per
    call), so that no call sees data an earlier call saw and a kernel cannot cache results. The caller drops its
    last input before asking for the next (memory)."""
    args = dict(args)
    while True:
        if "seed" in args:
            args["seed"] += 13
        yield generate_input(**args)


def _time_calls(custom_kernel, args: dict, data, recheck: bool, rule: StopRule) -> Stats | str:
    """Times repeated calls with a cold L2 (utils.Timer.call). With recheck (leaderboard mode) every call gets fresh
    data (fresh_inputs) and its output is checked, so a kernel cannot cache results or pass only the first check;
    returns the check's message on a failure."""
    timer = Timer()
    inputs = fresh_inputs(args) if recheck else None
    durations: list[float] = []
    started_ns = time.perf_counter_ns()
    for _ in range(rule.max_repeats):
        if recheck:
            data = reference_view = None  # free the last call's data before the next is generated (memory bound)
            data = next(inputs)
            reference_view = clone_data(data)
        duration_us, output = timer.call(custom_kernel, data)
        if recheck:
            good, message = check_implementation(reference_view, output, _kv_format_read())
            if not good:
                return message
        del output
        durations.append(duration_us * 1e3)
        if _should_stop(rule, durations, started_ns):
            break
    return calculate_stats(durations)


def _kv_format_read() -> str:
    """The KV format the submission reads (its select_kv_format, which sees its DEFAULT_KV_FORMAT), whose bound the
    check applies; a submission without one: the environment's (kv_format_under_test)."""
    import submission

    return getattr(submission, "select_kv_format", kv_format_under_test)()


def _worker_test(case: Case) -> tuple[bool, str]:
    from submission import custom_kernel

    data = generate_input(**case.args)
    _synchronize()
    output = custom_kernel(clone_data(data))
    _synchronize()
    return check_implementation(data, output, _kv_format_read())


def _worker_benchmark(case: Case, recheck: bool, rule: StopRule) -> Stats | str:
    """One obligatory check, then the timed calls; the check's message when it fails."""
    from submission import custom_kernel

    data = generate_input(**case.args)
    reference_view = clone_data(data)
    good, message = check_implementation(reference_view, custom_kernel(data), _kv_format_read())
    if not good:
        return message
    del reference_view
    if recheck:
        data = None  # every timed call brings its own data: this copy would only raise the peak memory
    return _time_calls(custom_kernel, case.args, data, recheck, rule)


def _worker_profile(case: Case) -> str:
    from torch.profiler import ProfilerActivity, profile

    from submission import custom_kernel

    data = generate_input(**case.args)
    _synchronize()
    on_gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        custom_kernel(data)
        _synchronize()
    sort_by = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort_by, row_limit=20)


def spawn_worker(seed: int) -> ProcessPoolExecutor:
    """One spawned worker process for the submission: a crash or a poisoned CUDA context stays out of the harness
    (a dead worker raises BrokenProcessPool instead of hanging), and it starts without the POPCORN fd."""
    return ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                               initializer=set_seed, initargs=(seed,))


# ---------------------------------------------------------------------------------------------------------
# Face 1: the leaderboard protocol
# ---------------------------------------------------------------------------------------------------------


class PopcornLog:
    """`key: value` lines to the runner's fd, flushed one by one so a crash keeps everything logged before it."""

    def __init__(self, fd: int):
        self.file = os.fdopen(fd, "w")
        os.set_inheritable(fd, False)  # no child process may write (fake) results to the runner

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.file.close()

    def log(self, key: str, value) -> None:
        print(f"{key}: {value}", file=self.file, flush=True)


def _log_stats(log: PopcornLog, idx: int, stats: Stats) -> None:
    for field in dataclasses.fields(Stats):
        log.log(f"benchmark.{idx}.{field.name}", getattr(stats, field.name))


def worker_call(worker: ProcessPoolExecutor, announce: bool) -> Callable:
    """call(fn, case, *args): fn run on case in the worker; with announce, each call and its duration on stderr
    (full-size cases on a CPU take a while)."""
    def call(fn, case: Case, *args):
        if not announce:
            return worker.submit(fn, case, *args).result()
        what = f"{fn.__name__.removeprefix('_worker_')} {case.spec}"
        _progress(f"{what} ...")
        started = time.perf_counter()
        result = worker.submit(fn, case, *args).result()
        _progress(f"{what}: done in {time.perf_counter() - started:.1f} s")
        return result

    return call


def popcorn_test(log: PopcornLog, call: Callable, cases: list[Case]) -> bool:
    passed = True
    log.log("test-count", len(cases))
    for idx, case in enumerate(cases):
        log.log(f"test.{idx}.spec", case.spec)
        good, message = call(_worker_test, case)
        log.log(f"test.{idx}.status", "pass" if good else "fail")
        if not good:
            log.log(f"test.{idx}.error", message)
            passed = False
        elif message:
            log.log(f"test.{idx}.message", message)
    log.log("check", "pass" if passed else "fail")
    return passed


def popcorn_benchmark(log: PopcornLog, call: Callable, cases: list[Case], recheck: bool,
                      rule: StopRule, warmup_rule: StopRule) -> bool:
    """Benchmark (recheck False) and leaderboard (recheck True) modes: a warm-up on the first case (compilation,
    autotuning, allocator growth stay out of the numbers), then every case; the first failure ends the run."""
    if cases:
        call(_worker_benchmark, cases[0], False, warmup_rule)
    log.log("benchmark-count", len(cases))
    passed = True
    for idx, case in enumerate(cases):
        log.log(f"benchmark.{idx}.spec", case.spec)
        result = call(_worker_benchmark, case, recheck, rule)
        if isinstance(result, Stats):
            _log_stats(log, idx, result)
        else:
            log.log(f"benchmark.{idx}.status", "fail")
            log.log(f"benchmark.{idx}.error", str(result))
            passed = False
            break
    log.log("check", "pass" if passed else "fail")
    return passed


def popcorn_profile(log: PopcornLog, call: Callable, cases: list[Case]) -> None:
    log.log("benchmark-count", len(cases))
    for idx, case in enumerate(cases):
        log.log(f"benchmark.{idx}.spec", case.spec)
        report = call(_worker_profile, case)
        log.log(f"benchmark.{idx}.report", base64.b64encode(report.encode("utf-8"), b"+*").decode("utf-8"))
    log.log("check", "pass")


def popcorn_main(fd: int, argv: list[str]) -> int:
    if len(argv) < 2:
        return EXIT_USAGE
    mode, cases_path = argv[0], argv[1]
    secret_text = os.environ.pop("POPCORN_SEED", None)  # gone before the worker spawns: the submission never sees it
    secret = int(secret_text) if secret_text else None
    set_seed(secret or 42)
    try:
        cases = parse_cases(Path(cases_path).read_text())
    except (OSError, ValueError) as exc:
        print(f"Could not read test cases from `{cases_path}`: {exc}", file=sys.stderr)
        return EXIT_BAD_CASES
    if secret is not None:
        mix_secret_seed(cases, secret)
    on_cpu = get_device().type == "cpu"
    if on_cpu:  # the protocol has no scaled shapes: say why it is slow instead of running silently. The torch
        # backend's largest tests.txt case (256 x 8192) takes about a minute on 2 cores; benchmark modes repeat each.
        max_rows = max((c.args.get("batchsize", 1) * c.args.get("kvseqlen", 0) for c in cases), default=0)
        _progress(f"eval.py: no GPU here: the {len(cases)} cases run at full size (up to {max_rows:,} KV rows "
                  "each), a minute or more per large case on a CPU; `python eval.py` without POPCORN_FD scales "
                  "them down")
    with PopcornLog(fd) as log, spawn_worker(secret or 42) as worker:
        call = worker_call(worker, announce=on_cpu)
        if mode == "test":
            return 0 if popcorn_test(log, call, cases) else EXIT_CHECK_FAILED
        if mode == "benchmark":
            passed = popcorn_benchmark(log, call, cases, False, BENCHMARK_RULE, BENCHMARK_WARMUP_RULE)
            return 0 if passed else EXIT_CHECK_FAILED
        if mode == "leaderboard":
            popcorn_benchmark(log, call, cases, True, LEADERBOARD_RULE, LEADERBOARD_WARMUP_RULE)
            return 0
        if mode == "profile":
            popcorn_profile(log, call, cases)
            return 0
    return EXIT_USAGE


# ---------------------------------------------------------------------------------------------------------
# Face 2: the local CLI
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


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


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


def main() -> int:
    fd = os.environ.get("POPCORN_FD")
    if fd:
        return popcorn_main(int(fd), sys.argv[1:])
    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
