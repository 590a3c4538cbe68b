"""bench/tune_cuda.py: its variant specs and source patches on the CPU (the timeline's `// TUNE: name` anchors must
all be in the kernel sources as they stand, so an edit that drops or moves one fails here, not on a GPU), its stamped
sources built by nvcc, and both modes run on an NVIDIA GPU."""

import difflib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cuda_standin import standin_library

import mla_decode.cuda.build as B
from bench import tune_cuda as tune

ROOT = Path(__file__).resolve().parent.parent
TUNE = ROOT / "bench" / "tune_cuda.py"
needs_nvcc = pytest.mark.skipif(B.find_nvcc() is None, reason="needs nvcc (the CUDA toolkit)")


@pytest.fixture
def csrc(tmp_path):
    """A copy of the package's sources, as the tool patches them."""
    return tune.copy_sources(B.CSRC, tmp_path / "csrc")


def changed_lines(before: Path, after: Path) -> list[tuple[str, str, str]]:
    """(file, old line, new line) for every line that differs between two copies of the sources."""
    changes = []
    for path in B.source_files(before):
        old, new = path.read_text().splitlines(), (after / path.name).read_text().splitlines()
        assert len(old) == len(new), path.name
        changes += [(path.name, a, b) for a, b in zip(old, new, strict=True) if a != b]
    return changes


@pytest.mark.parametrize("text,expected", [
    ("now=", ("now", {}, None)),
    ("a=STAGES_ALONE:4", ("a", {"STAGES_ALONE": 4}, None)),
    ("b=STAGES_ALONE:2;STAGES_SHARED:3@16", ("b", {"STAGES_ALONE": 2, "STAGES_SHARED": 3}, 16)),
    ("c=@8", ("c", {}, 8)),
])
def test_variant_specs(text, expected):
    assert tune.parse_variant(text) == expected


@pytest.mark.parametrize("text", ["STAGES_ALONE:4", "=x", "a=STAGES_ALONE"])
def test_a_malformed_variant_is_refused(text):
    with pytest.raises(ValueError):
        tune.parse_variant(text)


def test_the_copy_holds_every_source_file(csrc):
    assert [p.name for p in B.source_files(csrc)] == [p.name for p in B.source_files(B.CSRC)]
    assert B.MAIN_SOURCE in [p.name for p in B.source_files(csrc)]
    assert changed_lines(B.CSRC, csrc) == []


def test_patched_sources_change_only_the_named_constants(csrc):
    tune.patch_constants(csrc, {"STAGES_ALONE": 7})
    assert changed_lines(B.CSRC, csrc) == [("wgmma.cuh", "constexpr int STAGES_ALONE = 3;",
                                            "constexpr int STAGES_ALONE = 7;")]
    with pytest.raises(ValueError, match="NO_SUCH_CONSTANT"):
        tune.patch_constants(csrc, {"NO_SUCH_CONSTANT": 1})


@pytest.mark.parametrize("clock", [False, True])
def test_every_timeline_mark_finds_its_place(csrc, clock):
    tune.add_timeline(csrc, clock)
    stamped = "".join(p.read_text() for p in B.source_files(csrc))
    assert stamped.count("%%clock64" if clock else "%%globaltimer") == len(tune.MARKS)
    assert 'extern "C" int mla_timeline_get' in (csrc / B.MAIN_SOURCE).read_text()
    assert sorted(tune.MARK_SLOTS.values()) == sorted(set(tune.MARK_SLOTS.values()))
    assert max(tune.MARK_SLOTS.values()) == tune.SLOTS - 1
    # each stamp sits right after its anchor: the rest of the sources is untouched
    added = [line for p in B.source_files(B.CSRC) for line in difflib.ndiff(
        p.read_text().splitlines(), (csrc / p.name).read_text().splitlines()) if line.startswith(("+ ", "- "))]
    assert not [line for line in added if line.startswith("- ")]
    assert len(added) == len(tune.MARKS) + 2 + 4  # the stamps, the timeline's declaration (2 lines), the export


@pytest.mark.parametrize("edit", ["drop", "repeat", "move"])
def test_a_kernel_edit_that_loses_a_timeline_anchor_fails(csrc, edit):
    """An anchor deleted, duplicated, or moved into the other file (here: the merge's "lse" into the wgmma kernel)."""
    merge, kernel = csrc / "merge.cuh", csrc / "wgmma.cuh"
    text = merge.read_text()
    assert text.count("  // TUNE: lse\n") == 1
    if edit == "drop":
        merge.write_text(text.replace("  // TUNE: lse\n", ""))
    elif edit == "repeat":
        merge.write_text(text.replace("  // TUNE: lse\n", "  // TUNE: lse\n  // TUNE: lse\n"))
    else:
        merge.write_text(text.replace("  // TUNE: lse\n", ""))
        kernel.write_text(kernel.read_text().replace("  // TUNE: merged\n", "  // TUNE: merged\n  // TUNE: lse\n"))
    with pytest.raises(ValueError, match="timeline mark 'lse': expected one `// TUNE: lse` line, in merge.cuh"):
        tune.add_timeline(csrc)


@pytest.mark.parametrize("library,refusal", [("same", None), ("fields", "26 fields, not {fields}"),
                                             ("offsets", r"field 4 \(seqs\)"), ("no export", "does not report")])
def test_a_variant_whose_decode_call_differs_is_refused(monkeypatch, library, refusal):
    """A variant's library must read the DecodeCall mla_decode.cuda passes (a --source from before a change to the
    struct would read garbage): one whose field count or offsets differ, or that cannot say, is refused at its load
    (build.check_decode_call), naming the variant. The build and the load are faked (tests/cuda_standin.py)."""
    layout = B.decode_call_layout()
    lib = standin_library(layout={"same": layout, "fields": layout[:26] + layout[-1:], "no export": layout,
                                  "offsets": layout[:4] + [layout[4] + 8] + layout[5:]}[library])
    if library == "no export":
        del lib.mla_decode_call_fields
    monkeypatch.setattr(B, "find_nvcc", lambda: "/opt/nvcc")
    monkeypatch.setattr(B, "build_library", lambda nvcc, arch, wgmma, csrc=None: "libvariant.so")
    monkeypatch.setattr(B.ctypes, "CDLL", lambda path: lib)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    variant = tune.Variant("old", Path("/nowhere"), None)
    monkeypatch.setattr(B, "_LIBS", variant.libs)  # as variant.activate() sets it, restored after the test
    if refusal is None:
        variant.check_layout()
        assert variant.checked and variant.libs[((9, 0), False)] is lib
    else:
        refusal = refusal.format(fields=len(layout) - 1)  # the ctypes DecodeCall's field count
        with pytest.raises(SystemExit, match=f"^variant 'old' \\(/nowhere\\): cuda backend: .*{refusal}"):
            variant.check_layout()
        assert not variant.checked


@needs_nvcc
@pytest.mark.parametrize("clock", [False, True])
def test_the_stamped_sources_build(csrc, monkeypatch, tmp_path, clock):
    """The timeline's stamps (globaltimer, or clock64 with `clock`) build. The clock build carries the phases' stamps
    too: they compose, and each nvcc build of the sources takes about a minute of the suite."""
    monkeypatch.setenv("MLA_CUDA_CACHE", str(tmp_path / "cache"))
    tune.add_timeline(csrc, clock)
    if clock:
        tune.add_phases(csrc)
    monkeypatch.setattr(B, "CSRC", csrc)
    monkeypatch.setattr(B, "_LIBS", {})
    lib = B.library((9, 0))
    assert lib.mla_timeline_get is not None
    if clock:
        assert lib.mla_phases_get is not None and lib.mla_phases_clear is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("mode", ["ab", "timeline", "timeline --clock"])
def test_gpu_both_modes_run(mode, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(B.CSRC, base)
    args = [sys.executable, str(TUNE), *mode.split(), "--shapes", "4x1k", "--iters", "3", "--runs", "3",
            "--variant", "now=", "--variant", "s2=STAGES_ALONE:2@8"]
    out = subprocess.run(args + ["--source", f"base={base}"], capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env=dict(os.environ, MLA_CUDA_CACHE=str(tmp_path / "cache")))
    assert out.returncode == 0, out.stderr
    assert "FAIL" not in out.stdout
    assert ("geomean fp8: now" if mode == "ab" else "4x1024 s2: 8 splits") in out.stdout
    assert ("  base " if mode == "ab" else "4x1024 base: ") in out.stdout


@pytest.mark.parametrize("argv", [["timeline", "--serving", "serving.yml"],
                                  ["ab", "--serving", "serving.yml", "--page", "64"],
                                  ["ab", "--serving", "serving.yml", "--rows", "1x1k-h16-q3"],
                                  ["phases"]])
def test_serving_rows_are_for_ab_and_phases_and_named_as_the_spec_names_them(argv):
    with pytest.raises(SystemExit, match="--serving|--rows"):
        tune.main([*argv])


def test_every_phase_mark_finds_its_place(csrc):
    tune.add_phases(csrc)
    kernel = (csrc / tune.PHASES_IN).read_text()
    assert kernel.count("clock64()") == len(tune.PHASE_MARKS) + 1  # the marks and the loop's start
    assert kernel.count(f"ph_[{tune.PHASE_SLOTS - 1}] += 1;") == 1  # a pair counted once
    assert 'extern "C" int mla_phases_get' in (csrc / B.MAIN_SOURCE).read_text()
    # only lines added, each after its anchor: the declaration, the sums' start (2), the marks, the write (2), export
    added = [line for p in B.source_files(B.CSRC) for line in difflib.ndiff(
        p.read_text().splitlines(), (csrc / p.name).read_text().splitlines()) if line.startswith(("+ ", "- "))]
    assert not [line for line in added if line.startswith("- ")]
    assert len(added) == 1 + 2 + len(tune.PHASE_MARKS) + 2 + 11


@pytest.mark.parametrize("anchor", ["pairs", "pair-softmax", "pairs-done"])
def test_a_kernel_edit_that_loses_a_phase_anchor_fails(csrc, anchor):
    kernel = csrc / tune.PHASES_IN
    text = kernel.read_text()
    line = next(line for line in text.splitlines(keepends=True) if line.strip() == f"// TUNE: {anchor}")
    kernel.write_text(text.replace(line, ""))
    with pytest.raises(ValueError, match=f"phase mark '{anchor}': expected one `// TUNE: {anchor}` line"):
        tune.add_phases(csrc)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None, reason="needs an NVIDIA GPU")
def test_gpu_ab_over_serving_rows(tmp_path):
    base = tmp_path / "base"
    shutil.copytree(B.CSRC, base)
    args = [sys.executable, str(TUNE), "ab", "--serving", "serving_heads.yml", "--rows", "8x8k-h64-q1,1x8k-h128-q2",
            "--iters", "3", "--source", f"base={base}"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env=dict(os.environ, MLA_CUDA_CACHE=str(tmp_path / "cache")))
    assert out.returncode == 0, out.stderr
    assert "FAIL" not in out.stdout and "8x8k-h64-q1: now " in out.stdout and "  base " in out.stdout
    assert "geomean fp8 serving rows: now" in out.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None, reason="needs an NVIDIA GPU")
def test_gpu_phases_of_the_64_row_kernel(tmp_path):
    args = [sys.executable, str(TUNE), "phases", "--serving", "serving_heads.yml", "--rows", "8x8k-h64-q1",
            "--runs", "3"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env=dict(os.environ, MLA_CUDA_CACHE=str(tmp_path / "cache")))
    assert out.returncode == 0, out.stderr
    assert "8x8k-h64-q1 now: " in out.stdout and "cycles per pair: warpgroup 0: top " in out.stdout
