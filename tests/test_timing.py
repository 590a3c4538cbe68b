"""The timing shared by eval.py and bench/ (utils.Timer, the L2 flush sized by time), leaderboard mode's fresh
inputs, and bench/modes_agree.py. The flush's sizing rule is checked here with made-up pass times; the GPU tests
(`pytest -m gpu`) check on a real device that the flush hides a slow host path and that the control without a
flush does not."""

import hashlib
import math
import os
import statistics
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch

import eval as harness
import reference as R
import utils
from bench import modes_agree

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
GIB = 1 << 30


def q_digest(data) -> str:
    return hashlib.sha256(data[0].float().cpu().numpy().tobytes()).hexdigest()


# ---------------------------------------------------------------------------------------------------------
# The flush's sizing rule, with made-up measurements
# ---------------------------------------------------------------------------------------------------------


def test_flush_buffer_is_8x_the_l2_at_least_512_mib_within_an_eighth_of_free_memory():
    assert utils.flush_buffer_bytes(50 * MIB, 140 * GIB) == 512 * MIB  # H200-like: 8 x 50 MiB < 512 MiB
    assert utils.flush_buffer_bytes(96 * MIB, 140 * GIB) == 768 * MIB  # a large L2: 8x it
    assert utils.flush_buffer_bytes(4 * MIB, 2 * GIB) == 256 * MIB  # a small GPU: an eighth of its free memory


@pytest.mark.parametrize(("pass_us", "passes"), [(150, 14), (60, 34), (1000, 2), (2000, 1), (3000, 1)])
def test_flush_repeats_a_fast_pass_until_it_lasts_the_target(pass_us, passes):
    nbytes, got = utils.flush_plan(512 * MIB, pass_us * 1e-6, 50 * MIB)
    assert (nbytes, got) == (512 * MIB, passes)
    assert got * pass_us * 1e-6 >= utils.FLUSH_TARGET_S  # long enough to hide the host's part of a call
    assert got * pass_us * 1e-6 <= utils.FLUSH_MAX_S


def test_flush_target_exceeds_the_host_path_of_a_call_with_margin():
    slowest_host_path_s = 0.2e-3  # one call on fresh inputs, H200 (the measurement)
    assert utils.FLUSH_TARGET_S >= 5 * slowest_host_path_s
    assert utils.FLUSH_TARGET_S < utils.FLUSH_MAX_S


def test_a_slow_pass_shrinks_the_buffer_but_never_below_8x_the_l2():
    nbytes, passes = utils.flush_plan(512 * MIB, 40e-3, 4 * MIB)  # 40 ms a pass: a slow GPU
    assert (nbytes, passes) == (128 * MIB, 1)  # 10 ms, the cap
    nbytes, passes = utils.flush_plan(512 * MIB, 40e-3, 32 * MIB)
    assert (nbytes, passes) == (256 * MIB, 1)  # 8x the L2 must still be written, though it takes 20 ms


def test_flush_plan_reaches_the_target_and_never_exceeds_the_cap_unless_one_pass_over_8x_the_l2_does():
    l2 = 8 * MIB
    for pass_s in (1e-6, 37e-6, 0.4e-3, 1.9e-3, 2.1e-3, 6e-3, 9.9e-3, 12e-3, 0.3):
        nbytes, passes = utils.flush_plan(512 * MIB, pass_s, l2)
        total_s = passes * pass_s * nbytes / (512 * MIB)
        one_pass_of_8x_l2_s = pass_s * 8 * l2 / (512 * MIB)
        assert nbytes >= 8 * l2 and passes >= 1
        assert total_s <= max(utils.FLUSH_MAX_S, one_pass_of_8x_l2_s) * (1 + 1e-9), pass_s
        assert total_s >= utils.FLUSH_TARGET_S * (1 - 1e-9), pass_s


def test_flush_plan_refuses_a_pass_time_that_is_not_positive():
    with pytest.raises(ValueError, match="pass_s"):
        utils.flush_plan(512 * MIB, 0.0, 50 * MIB)


def test_the_leaderboards_flush_name_is_the_flush():
    assert utils.clear_l2_cache_large is utils.clear_l2_cache


# ---------------------------------------------------------------------------------------------------------
# utils.Timer on the CPU (wall clock, no flush)
# ---------------------------------------------------------------------------------------------------------


def busy_wait(seconds: float) -> None:
    """Spins on the host (no sleep: its wake-up is too coarse for a few hundred µs)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_timer_measures_a_call_and_returns_its_output():
    timer = utils.Timer(torch.device("cpu"))
    duration_us, output = timer.call(lambda x: (busy_wait(2e-3), x + 1)[1], 41)
    assert output == 42 and 2000 <= duration_us < 50000
    times = timer.leaderboard(lambda: busy_wait(1e-3), 3)
    assert len(times) == 3 and all(1000 <= t < 50000 for t in times)
    assert 1000 <= timer.back_to_back(lambda: busy_wait(1e-3), 3) < 50000
    assert 1000 <= timer.host(lambda: busy_wait(1e-3), 3) < 50000


@pytest.mark.parametrize("measure", ["leaderboard", "host"])
def test_timer_gives_each_call_a_fresh_input_and_frees_the_last_before_the_next(measure):
    timer = utils.Timer(torch.device("cpu"))
    made, seen, alive_at_setup = [], [], []

    def setup():
        alive_at_setup.append(sum(ref() is not None for ref in made))
        tensor = torch.full((4,), float(len(made)))
        made.append(weakref.ref(tensor))
        return tensor

    def fn(tensor):
        seen.append(tensor[0].item())
        busy_wait(1e-3)

    getattr(timer, measure)(fn, 4, setup=setup)
    assert seen == [0.0, 1.0, 2.0, 3.0]  # a new input for every call, in order
    assert alive_at_setup == [0, 0, 0, 0]  # the last call's input was gone before the next was made


def test_timer_excludes_the_fresh_inputs_setup_from_the_time():
    timer = utils.Timer(torch.device("cpu"))
    slow_setup = lambda: busy_wait(20e-3)  # noqa: E731
    assert max(timer.leaderboard(lambda _: None, 3, setup=slow_setup)) < 10000
    assert timer.host(lambda _: None, 3, setup=slow_setup) < 10000


# ---------------------------------------------------------------------------------------------------------
# Leaderboard mode's fresh inputs (eval.py)
# ---------------------------------------------------------------------------------------------------------

TINY = {"batchsize": 2, "qseqlen": 1, "kvseqlen": 40, "seed": 7}


def test_fresh_inputs_differ_call_to_call_in_data_not_in_shape():
    inputs = harness.fresh_inputs(TINY)
    first = [next(inputs) for _ in range(4)]
    digests = {q_digest(data) for data in first}
    assert len(digests) == 4 and q_digest(R.generate_input(**TINY)) not in digests
    for data in first:
        assert data[0].shape == (2, R.NUM_HEADS, R.QK_HEAD_DIM) and data[3].tolist() == [0, 40, 80]
    assert TINY["seed"] == 7  # the case itself is left as it was
    assert q_digest(first[0]) == q_digest(R.generate_input(**(TINY | {"seed": 7 + 13})))


@pytest.mark.parametrize(("recheck", "distinct"), [(True, 5), (False, 1)])
def test_leaderboard_mode_times_each_call_on_new_data_benchmark_mode_on_one(recheck, distinct):
    """eval.py's timing loop itself, in-process: leaderboard mode (recheck) hands every timed call new data."""
    seen = []

    def kernel(data):
        seen.append(q_digest(data))
        return R.ref_kernel(data)

    rule = harness.StopRule(max_repeats=5, max_time_ns=math.inf, min_runs=5)
    stats = harness._time_calls(kernel, TINY, R.generate_input(**TINY), recheck, rule)
    assert isinstance(stats, harness.Stats) and stats.runs == 5 and stats.best > 0
    assert len(seen) == 5 and len(set(seen)) == distinct


def test_leaderboard_mode_checks_every_call():
    """A kernel right on the first input only (it replays its first output) fails in leaderboard mode."""
    first = []

    def replaying_kernel(data):
        if not first:
            first.append(R.ref_kernel(data))
        return first[0]

    rule = harness.StopRule(max_repeats=3, max_time_ns=math.inf)
    assert isinstance(harness._time_calls(replaying_kernel, TINY, R.generate_input(**TINY), False, rule),
                      harness.Stats)
    message = harness._time_calls(replaying_kernel, TINY, None, True, rule)
    assert isinstance(message, str) and "failed" in message


# ---------------------------------------------------------------------------------------------------------
# bench/modes_agree.py
# ---------------------------------------------------------------------------------------------------------


def popcorn_values(means_ns: list[float], check: str = "pass") -> dict[str, str]:
    values = {"benchmark-count": str(len(means_ns)), "check": check}
    for idx, mean in enumerate(means_ns):
        values |= {f"benchmark.{idx}.spec": f"case {idx}", f"benchmark.{idx}.mean": str(mean),
                   f"benchmark.{idx}.best": str(0.9 * mean)}
    return values


def test_modes_agree_compares_the_means_within_the_tolerance():
    bench = popcorn_values([10_000.0, 300_000.0])
    rows, ok = modes_agree.compare({"benchmark": bench, "leaderboard": popcorn_values([10_400.0, 290_000.0])}, 0.05)
    assert ok and [row["ratio"] for row in rows] == pytest.approx([1.04, 290 / 300])
    assert rows[0]["benchmark_mean_us"] == 10.0 and rows[1]["leaderboard_best_us"] == pytest.approx(261.0)
    rows, ok = modes_agree.compare({"benchmark": bench, "leaderboard": popcorn_values([10_600.0, 300_000.0])}, 0.05)
    assert not ok and [row["agree"] for row in rows] == [False, True]
    assert "NO" in modes_agree.render(rows).splitlines()[1]
    _, ok = modes_agree.compare({"benchmark": bench, "leaderboard": popcorn_values([10_000.0, 300_000.0], "fail")},
                                0.05)
    assert not ok  # a failed check is never agreement
    leaderboard_cut_short = {k: v for k, v in popcorn_values([10_000.0, 300_000.0]).items() if "1.mean" not in k}
    rows, ok = modes_agree.compare({"benchmark": bench, "leaderboard": leaderboard_cut_short}, 0.05)
    assert not ok and rows[1]["ratio"] is None


def test_modes_agree_runs_both_modes_of_eval(tmp_path):
    """End to end on the CPU, where the modes need not agree (no flush; the whole call is host time), so only the
    parsing and the table are checked: the tolerance is made huge."""
    cases = tmp_path / "tiny.txt"
    cases.write_text("batchsize: 2; qseqlen: 1; kvseqlen: 33; seed: 7\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("POPCORN_", "MLA_"))}
    env.update(MLA_BACKEND="torch", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "modes_agree.py"), "--cases", str(cases),
                           "--tolerance", "1e9"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    table = proc.stdout.strip().splitlines()
    assert table[1].split()[:2] == ["case", "benchmark"] and table[2].startswith("batchsize: 2;")
    assert table[2].split()[-1] == "yes" and float(table[2].split()[-2]) > 0


# ---------------------------------------------------------------------------------------------------------
# On a GPU
# ---------------------------------------------------------------------------------------------------------

HOST_DELAY_S = 300e-6  # a slow host path, longer than any real call's (0.1-0.2 ms) and far shorter than the flush


def _median_us(timer: utils.Timer, fn, iters: int = 31) -> float:
    timer.leaderboard(fn, 3)  # warm-up
    return statistics.median(timer.leaderboard(fn, iters))


@pytest.mark.gpu
def test_flush_hides_a_slow_host_path(monkeypatch):
    """A tiny GPU op behind 300 µs of host work times as the op alone: the flush still runs when the op is queued.
    Without the flush (the control) the same call times as the host delay, so the test can tell."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    timer = utils.Timer(torch.device("cuda"))
    x = torch.zeros(1, device="cuda")

    def op():
        return x.add_(1)

    def slow_host_then_op():
        busy_wait(HOST_DELAY_S)
        return x.add_(1)

    alone_us = _median_us(timer, op)
    hidden_us = _median_us(timer, slow_host_then_op)
    assert hidden_us < alone_us + 25, (alone_us, hidden_us, utils.l2_flush(torch.cuda.current_device()))
    monkeypatch.setattr(utils, "clear_l2_cache", lambda: None)
    exposed_us = _median_us(timer, slow_host_then_op)
    assert exposed_us > alone_us + 0.8 * HOST_DELAY_S * 1e6, (alone_us, exposed_us)


@pytest.mark.gpu
def test_flush_lasts_the_target_over_8x_the_l2():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    device = torch.cuda.current_device()
    flush = utils.l2_flush(device)
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    assert flush.buffer.numel() >= 8 * l2_bytes
    assert utils.FLUSH_TARGET_S <= flush.seconds <= utils.FLUSH_MAX_S or flush.passes == 1
    utils.clear_l2_cache()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    utils.clear_l2_cache()
    end.record()
    end.synchronize()
    measured_s = start.elapsed_time(end) / 1e3
    assert 0.8 * utils.FLUSH_TARGET_S <= measured_s <= 1.5 * max(flush.seconds, utils.FLUSH_TARGET_S), (
        measured_s, flush)


@pytest.mark.gpu
def test_eval_modes_agree_on_a_small_and_a_large_case(tmp_path):
    """benchmark and leaderboard modes within 10% per case on the submission's default backend (the integrator's
    full check is bench/modes_agree.py on benchmarks.txt at 5%)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    cases = tmp_path / "cases.txt"
    cases.write_text("batchsize: 4; qseqlen: 1; kvseqlen: 1024; seed: 4220\n"
                     "batchsize: 64; qseqlen: 1; kvseqlen: 8192; seed: 5432\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("POPCORN_")}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "modes_agree.py"), "--cases", str(cases),
                           "--tolerance", "0.10"], env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
