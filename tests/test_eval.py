"""eval.py end to end on tiny cases, on the CPU with the torch backend (any GPU hidden, so a GPU machine runs the
same checks).

The popcorn face is driven as the runner drives it: a real pipe fd handed to a subprocess through pass_fds, its
`key: value` lines parsed back. The CLI face (eval_cli.py, which `python eval.py` runs without POPCORN_FD) runs as a
user runs it. A stand-in submission that returns zeros (in a copy of the harness, as the leaderboard lays files out)
shows that both faces fail it: at kv 4096 the outputs are ~0.05, so only the strict gate can reject it.
"""

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import eval as harness
import eval_cli

ROOT = Path(__file__).resolve().parent.parent
HARNESS_FILES = ("eval.py", "eval_cli.py", "reference.py", "task.py", "utils.py", "task.yml")
TINY_CASES = "batchsize: 2; qseqlen: 1; kvseqlen: 33; seed: 7\nbatchsize: 1; qseqlen: 1; kvseqlen: 64; seed: 11\n"
# One long sequence: outputs so small (~0.05) that the leaderboard's rule alone accepts zeros (2% miss).
STRICT_CASE = "batchsize: 1; qseqlen: 1; kvseqlen: 4096; seed: 5\n"
ZEROS_SUBMISSION = '''import torch


def custom_kernel(data):
    q = data[0]
    return torch.zeros((q.shape[0], 16, 512), dtype=torch.bfloat16, device=q.device)
'''
# Returns zeros and zeroes its inputs' bf16 cache: a reference computed on those inputs would be zeros too, so
# only a check that reads its own copy of the data rejects it.
POISONING_SUBMISSION = '''import torch


def custom_kernel(data):
    q, kv_data = data[0], data[1]
    kv_data["bf16"].zero_()
    return torch.zeros((q.shape[0], 16, 512), dtype=torch.bfloat16, device=q.device)
'''
STATS_KEYS = ("runs", "mean", "std", "err", "best", "worst")
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def tiny_cases(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cases") / "tiny.txt"
    path.write_text(TINY_CASES)
    return path


def stand_in_harness(directory: Path, submission_source: str) -> Path:
    """A copy of the harness with submission_source as submission.py, and a cases file strict.txt."""
    for name in HARNESS_FILES:
        shutil.copy(ROOT / name, directory / name)
    (directory / "submission.py").write_text(submission_source)
    (directory / "strict.txt").write_text(STRICT_CASE)
    return directory


@pytest.fixture(scope="module")
def zeros_harness(tmp_path_factory) -> Path:
    return stand_in_harness(tmp_path_factory.mktemp("zeros"), ZEROS_SUBMISSION)


def _env(**extra: str) -> dict[str, str]:
    """The torch backend on FP8 KV on the CPU; one CPU thread, because tiny cases gain nothing from two and, on a
    loaded machine, two threads spinning at every op's barrier made the calls ten times slower."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("POPCORN_", "MLA_"))}
    env.update(MLA_BACKEND="torch", MLA_KV_FORMAT="fp8", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               HIP_VISIBLE_DEVICES="")
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}  # None: unset


def run_popcorn(mode: str, cases: Path, cwd: Path = ROOT, **extra_env: str) -> tuple[int, dict[str, str], str]:
    """Runs `eval.py mode cases` with POPCORN_FD on a real pipe; returns (exit code, key -> value, stderr)."""
    read_fd, write_fd = os.pipe()
    with tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen([sys.executable, "eval.py", mode, str(cases)], cwd=cwd, stdout=subprocess.DEVNULL,
                                stderr=stderr, pass_fds=(write_fd,), env=_env(POPCORN_FD=str(write_fd), **extra_env))
        os.close(write_fd)  # the child holds the only writer: EOF comes when it (and only it) is done
        with os.fdopen(read_fd) as reader:
            lines = reader.read().splitlines()
        code = proc.wait(timeout=TIMEOUT_S)
        stderr.seek(0)
        err_text = stderr.read().decode()
    pairs = [line.split(": ", 1) for line in lines]
    assert all(len(pair) == 2 for pair in pairs), lines
    keys = [key for key, _ in pairs]
    assert len(keys) == len(set(keys)), f"a key logged twice: {keys}"
    return code, dict(pairs), err_text


def run_cli(*args: str, cwd: Path = ROOT, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "eval.py", *args], cwd=cwd, env=_env(**extra_env), capture_output=True,
                          text=True, timeout=TIMEOUT_S)


def _expected_benchmark_keys(count: int) -> set[str]:
    keys = {"benchmark-count", "check"}
    for idx in range(count):
        keys |= {f"benchmark.{idx}.spec"} | {f"benchmark.{idx}.{field}" for field in STATS_KEYS}
    return keys


def _assert_stats(values: dict[str, str], idx: int, max_runs: int) -> None:
    runs = int(values[f"benchmark.{idx}.runs"])
    mean, std, err, best, worst = (float(values[f"benchmark.{idx}.{field}"]) for field in STATS_KEYS[1:])
    assert 3 <= runs <= max_runs
    assert 0 < best <= mean <= worst
    assert std >= 0 and err == pytest.approx(std / runs**0.5)


@pytest.fixture(scope="module")
def test_mode_run(tiny_cases):
    return run_popcorn("test", tiny_cases)


def test_popcorn_test_mode(test_mode_run):
    code, values, stderr = test_mode_run
    specs = TINY_CASES.splitlines()
    expected = {"test-count", "check"} | {f"test.{i}.{k}" for i in range(2) for k in ("spec", "status", "message")}
    assert code == 0, stderr
    assert set(values) == expected
    assert values["test-count"] == "2" and values["check"] == "pass"
    for idx, spec in enumerate(specs):
        assert values[f"test.{idx}.spec"] == spec
        assert values[f"test.{idx}.status"] == "pass"
        assert "rel_l2=" in values[f"test.{idx}.message"]


def test_popcorn_on_a_cpu_says_the_shapes_are_full_size_and_shows_progress(test_mode_run):
    _, _, stderr = test_mode_run
    lines = stderr.splitlines()
    assert "no GPU here: the 2 cases run at full size (up to 66 KV rows each)" in lines[0], stderr
    for spec in TINY_CASES.splitlines():
        assert f"test {spec} ..." in lines and any(line.startswith(f"test {spec}: done in ") for line in lines)


@pytest.mark.parametrize(("mode", "max_runs"), [("benchmark", 1000), ("leaderboard", 100)])
def test_popcorn_benchmark_modes(tiny_cases, mode, max_runs):
    code, values, stderr = run_popcorn(mode, tiny_cases)
    assert code == 0, stderr
    assert set(values) == _expected_benchmark_keys(2)
    assert values["benchmark-count"] == "2" and values["check"] == "pass"
    for idx, spec in enumerate(TINY_CASES.splitlines()):
        assert values[f"benchmark.{idx}.spec"] == spec
        _assert_stats(values, idx, max_runs)


def test_popcorn_profile_mode(tmp_path):
    cases = tmp_path / "one.txt"
    cases.write_text(TINY_CASES.splitlines()[0] + "\n")
    code, values, stderr = run_popcorn("profile", cases)
    assert code == 0, stderr
    assert set(values) == {"benchmark-count", "benchmark.0.spec", "benchmark.0.report", "check"}
    assert values["benchmark-count"] == "1" and values["check"] == "pass"
    report = base64.b64decode(values["benchmark.0.report"], altchars=b"+*").decode()
    assert "Self CPU" in report


def test_popcorn_rejects_zeros_in_test_mode(zeros_harness):
    code, values, stderr = run_popcorn("test", zeros_harness / "strict.txt", cwd=zeros_harness)
    assert code == harness.EXIT_CHECK_FAILED, stderr
    assert values["test.0.status"] == "fail" and values["check"] == "fail"
    assert values["test.0.error"].startswith("strict gate failed"), values["test.0.error"]


def test_the_check_applies_the_bound_of_the_format_the_submission_reads(tmp_path):
    """DEFAULT_KV_FORMAT = "mxfp4" in the file, no MLA_KV_FORMAT set (as on the leaderboard): the check applies the
    MXFP4 bound (0.25), which a correct MXFP4 output meets at kv 4096 where the FP8 bound (0.08) would reject it."""
    source = (ROOT / "submission.py").read_text()
    assert source.count('DEFAULT_KV_FORMAT = "fp8"') == 1
    harness_dir = stand_in_harness(tmp_path, source.replace('DEFAULT_KV_FORMAT = "fp8"', 'DEFAULT_KV_FORMAT = "mxfp4"'))
    code, values, stderr = run_popcorn("test", harness_dir / "strict.txt", cwd=harness_dir, MLA_KV_FORMAT=None)
    assert code == 0 and values["check"] == "pass", (values, stderr)
    assert "bound 0.25 for mxfp4 KV" in values["test.0.message"], values
    proc = run_cli("--cases", "strict.txt", "--mode", "test", "--full", cwd=harness_dir, MLA_KV_FORMAT=None)
    assert proc.returncode == 0 and "mxfp4" in proc.stdout, proc.stdout + proc.stderr


def test_popcorn_checks_a_copy_the_submission_cannot_poison(tmp_path):
    directory = stand_in_harness(tmp_path, POISONING_SUBMISSION)
    code, values, stderr = run_popcorn("test", directory / "strict.txt", cwd=directory)
    assert code == harness.EXIT_CHECK_FAILED, stderr
    assert values["test.0.status"] == "fail" and "rel_l2=1.000e+00" in values["test.0.error"]


def test_popcorn_rejects_zeros_in_leaderboard_mode(zeros_harness):
    code, values, stderr = run_popcorn("leaderboard", zeros_harness / "strict.txt", cwd=zeros_harness)
    assert code == 0, stderr  # as the leaderboard's eval.py: this mode's verdict is the check line alone
    assert values["benchmark.0.status"] == "fail" and values["check"] == "fail"
    assert "strict gate failed" in values["benchmark.0.error"]


def test_popcorn_seed_changes_the_data(tiny_cases, test_mode_run):
    _, unseeded, _ = test_mode_run
    code, seeded, stderr = run_popcorn("test", tiny_cases, POPCORN_SEED="123456789")
    assert code == 0 and seeded["check"] == "pass", stderr
    assert seeded["test.0.spec"] == unseeded["test.0.spec"]  # results stay filed under the public spec
    assert seeded["test.0.message"] != unseeded["test.0.message"]


def test_popcorn_seed_combines_like_the_leaderboard():
    cases = harness.parse_cases(TINY_CASES)
    harness.mix_secret_seed(cases, 123456789)
    for case, public_seed in zip(cases, (7, 11), strict=True):
        total = public_seed + 123456789
        assert case.args["seed"] == public_seed + total * (total + 1) // 2
    assert harness.combine_seeds(7, 1000) != harness.combine_seeds(8, 1000) != harness.combine_seeds(7, 1001)


def test_popcorn_bad_cases_file_exits_113(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("batchsize = 4\n")
    code, values, stderr = run_popcorn("test", bad)
    assert code == harness.EXIT_BAD_CASES and values == {}
    assert "invalid test case" in stderr


def test_parse_cases_grammar():
    (case,) = harness.parse_cases("batchsize: 4; qseqlen: +1; kvseqlen: 1024; seed: -3; causal: true; tag: abc\n\n")
    assert case.args == {"batchsize": 4, "qseqlen": 1, "kvseqlen": 1024, "seed": -3, "causal": True, "tag": "abc"}
    with pytest.raises(ValueError, match="invalid test case"):
        harness.parse_cases("batchsize: 4, seed: 1")


def test_cpu_scaling_rule():
    def scaled(batch: int, kv: int) -> tuple[int, int]:
        case = eval_cli.scale_for_cpu(harness.Case("", {"batchsize": batch, "qseqlen": 1, "kvseqlen": kv, "seed": 1}))
        return case.args["batchsize"], case.args["kvseqlen"]

    assert scaled(256, 8192) == (32, 1024)
    assert scaled(4, 1024) == (4, 128)
    assert scaled(2, 33) == (2, 33)


def test_cli_on_tiny_cases(tiny_cases, tmp_path):
    json_path = tmp_path / "results.json"
    proc = run_cli("--cases", str(tiny_cases), "--json", str(json_path), "--backend", "torch")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[4/4] benchmark" in proc.stderr  # progress goes to stderr
    assert (proc.stdout + proc.stderr).count("device: ") == 1  # one header, on stdout, before the table
    assert proc.stdout.startswith("device: CPU") and proc.stdout.index("timing:") < proc.stdout.index("max_abs_err")
    table = proc.stdout
    for column in ("case", "backend", "check", "max_abs_err", "rel_l2_err", "mean_us", "best_us", "GB/s"):
        assert column in table
    assert "4/4 passed" in table and "geometric mean of benchmark means" in table and "FAIL" not in table
    report = json.loads(json_path.read_text())
    assert report["passed"] is True and report["device_type"] == "cpu" and report["geomean_mean_us"] > 0
    assert report["scaled"] is True  # the CPU default, though these cases are too small to shrink
    assert [r["kind"] for r in report["results"]] == ["test", "test", "benchmark", "benchmark"]
    for result in report["results"]:
        assert result["passed"] and result["backend"] == "torch" and result["kv_format"] == "fp8"
        assert result["spec"] == result["task_spec"]  # tiny cases are not scaled down
        assert 0 < result["rel_l2_err"] < 0.08 and result["max_abs_err"] > 0
    benchmark = report["results"][2]
    assert benchmark["best_us"] <= benchmark["mean_us"]
    assert benchmark["kv_gbps"] == pytest.approx((2 * 33 * 576 + 4) / (benchmark["mean_us"] * 1e3))


def _assert_configuration_error(proc: subprocess.CompletedProcess, *reason: str) -> None:
    """Exit 2, one line on stderr naming the reason, and nothing else: no header, no case run."""
    assert proc.returncode == harness.EXIT_USAGE, proc.stdout + proc.stderr
    assert proc.stdout == "" and len(proc.stderr.splitlines()) == 1, proc.stdout + proc.stderr
    assert proc.stderr.startswith("eval.py: configuration error: ")
    for text in reason:
        assert text in proc.stderr, proc.stderr


def test_cli_unknown_backend_fails_once_before_any_case():
    _assert_configuration_error(run_cli("--mode", "test", MLA_BACKEND="nonsense"), "MLA_BACKEND", "'nonsense'")


def test_cli_unknown_kv_format_fails_once_before_any_case():
    _assert_configuration_error(run_cli("--mode", "test", MLA_KV_FORMAT="int4"), "MLA_KV_FORMAT", "'int4'")


def test_cli_unknown_precision_fails_once_before_any_case():
    _assert_configuration_error(run_cli("--mode", "test", MLA_PRECISION="exact"), "MLA_PRECISION", "'exact'")


def test_cli_unavailable_backend_fails_with_the_reason():
    _assert_configuration_error(run_cli("--backend", "cuda"), "MLA_BACKEND=cuda", "needs an NVIDIA GPU")


def test_cli_triton_that_does_not_import_names_the_import_error(tmp_path):
    """TRITON_INTERPRET=1 set, triton broken: the message is triton's own import error, not a missing GPU."""
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text('raise ImportError("triton stand-in: broken on purpose")\n')
    proc = run_cli("--backend", "triton", PYTHONPATH=str(tmp_path), TRITON_INTERPRET="1")
    _assert_configuration_error(proc, "MLA_BACKEND=triton: triton does not import", "broken on purpose")


def test_cli_fails_zeros(zeros_harness):
    proc = run_cli("--cases", "strict.txt", "--mode", "test", "--full", cwd=zeros_harness)  # kv 4096 as written
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout and "strict gate failed" in proc.stdout and "0/1 passed" in proc.stdout


def test_write_cases_matches_the_committed_files(tmp_path):
    shutil.copy(ROOT / "task.yml", tmp_path / "task.yml")
    assert eval_cli.cli_main(["--write-cases", "--cases", str(tmp_path / "task.yml")]) == 0
    for name in ("tests.txt", "benchmarks.txt"):
        assert (tmp_path / name).read_text() == (ROOT / name).read_text(), name
