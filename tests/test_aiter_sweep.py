"""bench/aiter_sweep.py on the CPU: the dry run against the stand-in aiter (every variant on two tiny shapes, checked
and timed by wall clock), its pasteable AITER_VARIANTS block, a negative control (a variant with a wrong output is
FAIL, never recommended, exit status 1), and the recommendation rule."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import submission as S
from bench import aiter_sweep, leaderboard

ROOT = Path(__file__).resolve().parent.parent
SWEEP = ROOT / "bench" / "aiter_sweep.py"

# Runs the sweep with one variant broken: its output zeroed after the (correct) computation. aiter_forward writes
# into `out`, its 8th argument (the library's AiterDecode passes it by position), and returns nothing.
BROKEN = """
import os, runpy, sys
root = sys.argv[1]
sys.path.insert(0, root)
os.environ["TRITON_INTERPRET"] = "1"  # as the sweep's dry run sets it, before triton is first imported
import submission
forward = submission.aiter_forward
def broken(*args, **kwargs):
    forward(*args, **kwargs)
    if os.environ["MLA_AITER_VARIANT"] == "fp8_nps":
        (kwargs["out"] if "out" in kwargs else args[7]).zero_()
submission.aiter_forward = broken
sys.argv = [root + "/bench/aiter_sweep.py", *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_sweep(tmp_path: Path, *args: str, broken: bool = False) -> tuple[subprocess.CompletedProcess, dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLA_") and k != "TRITON_INTERPRET"}
    out = tmp_path / "sweep.json"
    argv = ["--dry-run", "--json", str(out), *args]
    cmd = [sys.executable, "-c", BROKEN, str(ROOT), *argv] if broken else [sys.executable, str(SWEEP), *argv]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return proc, json.loads(out.read_text())


def pasted_table(stdout: str) -> dict:
    """The AITER_VARIANTS block the sweep printed, evaluated as mla_decode/aiter_backend.py would."""
    paste = "# Paste into mla_decode/aiter_backend.py (replacing AITER_VARIANTS), then run `make bundle`:\n"
    block = stdout.split(paste, 1)[1].split("\n}\n", 1)[0] + "\n}"
    assert all(len(line) <= 120 for line in block.splitlines()), block
    tree = ast.parse(block)
    (assign,) = tree.body
    assert assign.targets[0].id == "AITER_VARIANTS"
    return ast.literal_eval(assign.value)


TRITON_PATHS = (S.ROCM_TRITON, "triton-fp8-precise", "triton-mxfp4")


def test_dry_run_sweeps_every_variant_and_prints_a_table_to_paste(tmp_path):
    chart = tmp_path / "sweep.png"
    proc, result = run_sweep(tmp_path, "--chart", str(chart))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {(r["shape"], r["variant"]): r for r in result["rows"]}
    assert set(rows) == {(shape, v) for shape in ("2x64", "3x37") for v in (*S.AITER_VARIANT_SPECS, *TRITON_PATHS)}
    for (_, variant), row in rows.items():
        if variant in TRITON_PATHS:  # the triton backend beside them, in the interpreter
            assert row["status"] == "OK" and row["ran_as"].startswith("triton, ") and row["launches"] in (1, 2)
        else:
            spec = S.AITER_VARIANT_SPECS[variant]
            assert row["status"] == "OK" and row["ran_as"] == spec.call and row["launches"] == spec.launches
        assert len(row["times_us"]) == 3 and row["median_us"] > 0
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and result["read_ceiling"]["gbps"] > 0
    assert set(result["fp8_floor_us"]) == {"2x64", "3x37"}
    assert [q["exact"] for q in result["q_quant"]] == [True, True]
    table = pasted_table(proc.stdout)
    assert set(table) == {(2, 64), (3, 37)}
    for variant, source in table.values():
        assert variant in (*S.AITER_VARIANT_SPECS, S.ROCM_TRITON), variant
        assert source.startswith("aiter_sweep ") and "CPU (dry run)" in source
    assert [[b, kv, *table[(b, kv)]] for b, kv in table] == result["recommended"]


def test_a_variant_with_a_wrong_output_fails_and_is_never_recommended(tmp_path):
    proc, result = run_sweep(tmp_path, "--variants", "fp8_nps,a16w8_ps", "--min-gain", "0", "--no-triton", broken=True)
    assert proc.returncode == 1, proc.stderr[-3000:]
    statuses = {(r["shape"], r["variant"]): r["status"] for r in result["rows"]}
    assert statuses == {(shape, v): ("FAIL" if v == "fp8_nps" else "OK")
                        for shape in ("2x64", "3x37") for v in ("fp8_ps", "fp8_nps", "a16w8_ps")}
    assert "FAIL: 2x64 fp8_nps" in proc.stdout
    assert all(variant != "fp8_nps" for variant, _ in pasted_table(proc.stdout).values())


def test_recommendation_rule():
    shapes = [leaderboard.Shape(4, 1024, 0), leaderboard.Shape(4, 8192, 0), leaderboard.Shape(32, 1024, 0),
              leaderboard.Shape(32, 8192, 0)]

    def row(shape, variant, us, status="OK"):
        return aiter_sweep.Row(shape, variant, status=status, median_us=us)

    rows = [row("4x1024", "fp8_ps", 100.0), row("4x1024", "fp8_nps", 98.0),  # 2% faster: noise, keep the default
            row("4x8192", "fp8_ps", 100.0), row("4x8192", "a16w8_ps", 90.0), row("4x8192", "fp8_nps", 50.0, "FAIL"),
            row("32x1024", "fp8_ps", 0.0, "ERROR"), row("32x1024", "a16w8_ps", 70.0),
            row("32x8192", "fp8_ps", 0.0, "ERROR")]
    chosen = aiter_sweep.recommend(rows, shapes, 0.03, "label")
    assert chosen == {
        (4, 1024): ("fp8_ps", "label: 100.0 us; best other fp8_nps 98.0 us"),
        (4, 8192): ("a16w8_ps", "label: 90.0 us; fp8_ps 100.0 us"),  # the faster FAIL row is never chosen
        (32, 1024): ("a16w8_ps", "label: 70.0 us; fp8_ps failed its check"),
        (32, 8192): ("fp8_ps", "label: no variant passed its check"),
    }
    assert ast.literal_eval(aiter_sweep.render_table(chosen).split(" = ", 1)[1]) == chosen
