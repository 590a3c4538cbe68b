"""bench/tune_cuda.py: its variant specs and source patches on the CPU (the timeline's anchors must all be in the
kernel as it stands, so an edit that moves one fails here, not on a GPU), its stamped source built by nvcc, and both
modes run on an NVIDIA GPU."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import submission as S

ROOT = Path(__file__).resolve().parent.parent
TUNE = ROOT / "bench" / "tune_cuda.py"
needs_nvcc = pytest.mark.skipif(S._nvcc() is None, reason="needs nvcc (the CUDA toolkit)")


@pytest.fixture(scope="module")
def tune():
    spec = importlib.util.spec_from_file_location("tune_cuda", TUNE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("text,expected", [
    ("now=", ("now", {}, None)),
    ("a=STAGES_ALONE:4", ("a", {"STAGES_ALONE": 4}, None)),
    ("b=STAGES_ALONE:2;STAGES_SHARED:3@16", ("b", {"STAGES_ALONE": 2, "STAGES_SHARED": 3}, 16)),
    ("c=@8", ("c", {}, 8)),
])
def test_variant_specs(tune, text, expected):
    assert tune.parse_variant(text) == expected


@pytest.mark.parametrize("text", ["STAGES_ALONE:4", "=x", "a=STAGES_ALONE"])
def test_a_malformed_variant_is_refused(tune, text):
    with pytest.raises(ValueError):
        tune.parse_variant(text)


def test_patched_source_changes_only_the_named_constants(tune):
    patched = tune.patched_source(tune.SOURCE, {"STAGES_ALONE": 7})
    changed = [(a, b) for a, b in zip(tune.SOURCE.splitlines(), patched.splitlines(), strict=True) if a != b]
    assert changed == [("constexpr int STAGES_ALONE = 3;", "constexpr int STAGES_ALONE = 7;")]
    with pytest.raises(ValueError, match="NO_SUCH_CONSTANT"):
        tune.patched_source(tune.SOURCE, {"NO_SUCH_CONSTANT": 1})


@pytest.mark.parametrize("clock", [False, True])
def test_every_timeline_mark_finds_its_place(tune, clock):
    stamped = tune.timeline_source(tune.SOURCE, clock)
    assert stamped.count("%%clock64" if clock else "%%globaltimer") == len(tune.MARKS)
    assert 'extern "C" int mla_timeline_get' in stamped
    assert sorted(tune.MARK_SLOTS.values()) == sorted(set(tune.MARK_SLOTS.values()))
    assert max(tune.MARK_SLOTS.values()) == tune.SLOTS - 1


@needs_nvcc
@pytest.mark.parametrize("clock", [False, True])
def test_the_stamped_source_builds(tune, monkeypatch, tmp_path, clock):
    monkeypatch.setenv("MLA_CUDA_CACHE", str(tmp_path))
    monkeypatch.setattr(S, "_CUDA_SRC", tune.timeline_source(tune.SOURCE, clock))
    monkeypatch.setattr(S, "_CUDA_LIBS", {})
    assert S._cuda_library((9, 0)).mla_timeline_get is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("mode", ["ab", "timeline", "timeline --clock"])
def test_gpu_both_modes_run(mode, tmp_path):
    base = tmp_path / "base.py"
    base.write_text((ROOT / "submission.py").read_text())
    args = [sys.executable, str(TUNE), *mode.split(), "--shapes", "4x1k", "--iters", "3", "--runs", "3",
            "--variant", "now=", "--variant", "s2=STAGES_ALONE:2@8"]
    out = subprocess.run(args + (["--module", f"base={base}"] if mode == "ab" else []), capture_output=True,
                         text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "FAIL" not in out.stdout
    assert ("geomean fp8: now" if mode == "ab" else "4x1024 s2: 8 splits") in out.stdout
