"""Evaluation harness for the amd-mixed-mla leaderboard: the leaderboard's protocol, as the runner drives the
leaderboard's own eval.py (which replaces this file there, so this one must keep speaking the same protocol):

    POPCORN_FD=<fd> [POPCORN_SEED=<n>] python eval.py {test|benchmark|leaderboard|profile} <cases-file>

Every line of the cases file is `batchsize: 4; qseqlen: 1; kvseqlen: 1024; seed: 4220`. Results go to the fd as
`key: value` lines: test-count, test.N.spec, test.N.status (pass|fail), test.N.error or test.N.message;
benchmark-count, benchmark.N.spec, benchmark.N.runs|mean|std|err|best|worst (nanoseconds), or
benchmark.N.status: fail and benchmark.N.error; profile mode benchmark.N.report (base64); finally check: pass|fail.
POPCORN_SEED, when set, is mixed into every case's seed and hidden from the submission. Exit codes are the
leaderboard's: 0; 112 when a test or benchmark fails (leaderboard and profile modes exit 0 whatever happens: the
`check` line carries their verdict); 113 when the cases file cannot be read or parsed; 2 for a bad command line.
The submission runs in one spawned worker process that inherits neither the fd nor POPCORN_SEED.

With POPCORN_FD unset, `python eval.py [options]` is the local CLI of eval_cli.py (one table of the tests and
benchmarks on this machine; `python eval.py --help`), which builds on the cases, timing and checks here.

Timing: utils.Timer.call, the leaderboard's way: CUDA/HIP events around each call, with the L2 flushed before it
(utils.clear_l2_cache, which also keeps the GPU busy long enough to hide the host's part of the call); the wall
clock on the CPU. Every check reads a copy of the inputs that the submission never received (it
gets the other copy), so writing into its inputs cannot change what its output is compared with.
"""

import base64
import dataclasses
import math
import multiprocessing
import os
import re
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from reference import check_implementation, generate_input, kv_format_under_test
from utils import Timer, get_device, set_seed

EXIT_USAGE = 2
EXIT_CHECK_FAILED = 112
EXIT_BAD_CASES = 113

# One `key: value` field of a cases line, exactly the leaderboard's grammar.
CASE_FIELD = re.compile(r"\s*([a-zA-Z_]\w*):\s*([a-zA-Z_]\w*|[+-]?[0-9]+)\s*")


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
# The leaderboard protocol
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


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


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


def main() -> int:
    fd = os.environ.get("POPCORN_FD")
    if fd:
        return popcorn_main(int(fd), sys.argv[1:])
    from eval_cli import cli_main  # imported here: eval_cli imports this module, and the runner never needs it

    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
