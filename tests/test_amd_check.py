"""tools/amd_check.py: it passes submission.py through the real launch paths for an AMD target (the leaderboard
adapter's ragged call and the library's paged call with the LSE), and fails on each way the triton backend was once
broken there (a launch option AMD's backend refuses, an e4m3fnuz -> e4m3fn conversion, a plan over the LDS), on a
bf16 cache's products off bf16 MFMAs and on an adapter plan of another kind than the leaderboard's, each planted in a
copy of submission.py (the bundle of mla_decode/). One shape and mode per run, with the tests' Triton."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "amd_check.py"

pytest.importorskip("triton")


# The MI355X runner's Triton, as `make amd-check` installs it: its LDS figures are the ones a plan must fit (Triton
# 3.9 takes less LDS for the same plan, 28,760 B against 75,776 B for the FP8 kernel at 3 stages).
RUNNER_TRITON = ROOT / ".amd-triton" / "3.6.0"


def run_check(submission: Path, target: str, tmp_path: Path, mode: str = "fp8-fast", shape: str = "4x1024",
              triton: str = "env", library: str = ""):
    """The check of one leaderboard shape (`shape`, empty: none) and the library's cases (`library`: batch x kv
    length x page size, comma-separated; empty: none)."""
    out = tmp_path / f"{target}.json"
    proc = subprocess.run([sys.executable, str(TOOL), "--triton", triton, "--targets", target, f"--shapes={shape}",
                           "--modes", mode, f"--library={library}", "--submission", str(submission), "--json",
                           str(out)],
                          capture_output=True, text=True, timeout=600)
    results = json.loads(out.read_text()) if out.exists() else []
    return proc.returncode, proc.stdout + proc.stderr, results


def planted(tmp_path: Path, old: str, new: str) -> Path:
    source = (ROOT / "submission.py").read_text()
    assert source.count(old) == 1, f"the text to replace is not in submission.py once: {old!r}"
    path = tmp_path / "submission.py"
    path.write_text(source.replace(old, new))
    return path


def kernels_of(result: dict, case: str) -> dict:
    return {k["name"]: k for k in result["kernels"] if case in k["cases"]}


@pytest.mark.parametrize("target", ["gfx950", "gfx942"])
def test_the_launch_path_runs_for_amd_with_the_combine(tmp_path, target):
    rc, output, results = run_check(ROOT / "submission.py", target, tmp_path)
    assert rc == 0, output
    (result,) = results
    case = "triton fp8-fast 4x1024"
    (made,) = next(c for c in result["cases"] if c["case"] == case)["plans"]  # the adapter's ragged plan, no LSE
    assert (made["layout"], made["write_lse"], made["kv_format"], made["precise"]) == ("ragged", False, "fp8", False)
    by_name = kernels_of(result, case)
    assert set(by_name) == {"mla_split_kernel", "mla_combine_kernel"}, output  # 4x1024 splits: both launch
    split = by_name["mla_split_kernel"]
    assert split["constexprs"]["NUM_SPLITS"] > 1 and not split["scratch"] and not split["failed"]
    assert split["constexprs"]["PAGE_SIZE"] == 0 and not split["constexprs"]["WRITE_LSE"]
    assert any("fp8" in m or "f8f6f4" in m for m in split["mfma"]), split["mfma"]
    assert split["lds"] <= result["gpu"]["lds_bytes"]
    assert result["errors"] == [] and "amd-check: pass" in output


def test_the_library_call_runs_for_amd_paged_with_the_lse(tmp_path):
    """bf16 pages of 16 rows (smaller than a tile), with the LSE: with the library's default, fixed splits, through
    the combine and through the split kernel alone (one split); with the balanced schedule through the schedule
    kernel, the split kernel over its pieces and the combine over theirs."""
    rc, output, results = run_check(ROOT / "submission.py", "gfx950", tmp_path, mode="bf16", shape="",
                                    library="4x1024x16,512x256x16")
    assert rc == 0, output
    (result,) = results
    for case, splits in (("library bf16 page 16 lse 4x1024", "many"),
                         ("library bf16 page 16 lse 512x256", 1), ("library bf16 page 16 lse 4x1024 balanced", None),
                         ("library bf16 page 16 lse 512x256 balanced", None)):
        (made,) = next(c for c in result["cases"] if c["case"] == case)["plans"]
        assert (made["layout"], made["page_size"], made["write_lse"], made["kv_format"]) == ("paged", 16, True, "bf16")
        assert made["schedule"] == ("balanced" if splits is None else "fixed"), made
        by_name = kernels_of(result, case)
        split = by_name["mla_split_kernel"]
        assert split["constexprs"]["PAGE_SIZE"] == 16 and split["constexprs"]["WRITE_LSE"], split["constexprs"]
        assert split["mfma"] and all("bf16" in m for m in split["mfma"]), split["mfma"]
        assert split["constexprs"]["BALANCED"] == (splits is None)
        if splits is None:
            assert set(by_name) == {"mla_schedule_kernel", "mla_split_kernel", "mla_combine_kernel"}, by_name
            assert by_name["mla_combine_kernel"]["constexprs"]["BALANCED"], by_name["mla_combine_kernel"]
        elif splits == 1:
            assert split["constexprs"]["NUM_SPLITS"] == 1 and set(by_name) == {"mla_split_kernel"}, by_name
        else:
            assert split["constexprs"]["NUM_SPLITS"] > 1 and by_name["mla_combine_kernel"]["constexprs"]["WRITE_LSE"]
    assert result["errors"] == [] and "amd-check: pass" in output


def assert_fails(path: Path, target: str, tmp_path: Path, *wanted: str, triton: str = "env", **case) -> None:
    """The check of `path` on `target` exits 1, with FAIL and each of `wanted` (any one of a tuple) in its output."""
    rc, output, _ = run_check(path, target, tmp_path, triton=triton, **case)
    assert rc == 1 and "amd-check: FAIL" in output, output
    for want in wanted:
        assert any(w in output for w in ((want,) if isinstance(want, str) else want)), (want, output)


def test_fails_on_a_launch_option_amd_refuses(tmp_path):
    path = planted(tmp_path, '    if target.vendor == "nvidia":\n        options["launch_pdl"] = pdl\n',
                   '    options["launch_pdl"] = pdl\n')
    assert_fails(path, "gfx950", tmp_path, "launch_pdl")


def test_fails_on_an_e4m3fnuz_to_e4m3fn_conversion(tmp_path):
    path = planted(tmp_path, "            K_DTYPE: tl.constexpr = kv_ptr.dtype.element_ty\n",
                   "            K_DTYPE: tl.constexpr = tl.float8e4nv\n")
    assert_fails(path, "gfx942", tmp_path, "triton fp8-fast 4x1024")


def test_fails_on_bf16_products_off_bf16_mfmas(tmp_path):
    path = planted(tmp_path, 'tl.bfloat16 if key.kv_format == "bf16" else tl.float16', "tl.float16")
    assert_fails(path, "gfx950", tmp_path, "not all on bf16 MFMAs", mode="bf16", shape="", library="4x1024x64")


def test_fails_on_a_leaderboard_plan_of_another_kind(tmp_path):
    """The adapter's plan asking for an LSE it does not pass (the kernels would write it over the output)."""
    path = planted(tmp_path, 'return_lse=False, scale_dtype=scale.dtype,', 'return_lse=True, scale_dtype=scale.dtype,')
    assert_fails(path, "gfx950", tmp_path, "triton plans are not the kind", "'write_lse': True")


@pytest.mark.skipif(not (RUNNER_TRITON / "triton").is_dir(), reason="the runner's Triton: make amd-check installs it")
def test_fails_on_a_plan_over_the_lds(tmp_path):
    path = planted(tmp_path, '"gfx942": 64 * 1024,', '"gfx942": 160 * 1024,')  # the plan then takes 3 stages
    assert_fails(path, "gfx942", tmp_path, ("OutOfResources", "over the MI300X's"), triton=str(RUNNER_TRITON))
