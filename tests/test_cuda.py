"""The cuda backend (the mla_decode.cuda package) on the CPU: its build (nvcc needs no GPU) and plan, and how
submission.py finds it. The kernels on a GPU, behind the `gpu` marker: tests/test_cuda_gpu.py."""

import ctypes
import fcntl
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cuda_standin import standin_library

import mla_decode
import mla_decode.cuda.build as B
import mla_decode.cuda.decode as D
import mla_decode.cuda.plan as P
import reference as R
import submission as S

ROOT = Path(__file__).resolve().parent.parent
needs_nvcc = pytest.mark.skipif(B.find_nvcc() is None, reason="needs nvcc (the CUDA toolkit)")


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    monkeypatch.setenv("MLA_CUDA_CACHE", str(tmp_path))
    monkeypatch.setattr(B, "_LIBS", {})
    return tmp_path


@pytest.fixture(scope="session")
def sources_cache(tmp_path_factory):
    """A cache for the libraries of the package's own sources, one a session (under pytest-xdist, one for all its
    workers: their base directories' parent)."""
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "mla-cuda-cache"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture
def shared_build(monkeypatch, sources_cache):
    """The session's cache for the unedited sources: each library is nvcc's minute once, not once a test. A build
    holds a lock on the cache, so a second worker waits for it and then loads the library."""
    monkeypatch.setenv("MLA_CUDA_CACHE", str(sources_cache))
    monkeypatch.setattr(B, "_LIBS", {})
    build = B.build_library

    def build_once(*args, **kwargs):
        with open(sources_cache / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return build(*args, **kwargs)

    monkeypatch.setattr(B, "build_library", build_once)
    return sources_cache


@pytest.fixture
def edited_sources(monkeypatch, tmp_path):
    """edit(file, text, line=None): a copy of the sources with `text` inserted before 1-based `line` of `file` (appended
    when None), which the build then uses; returns the edited file's path."""
    csrc = tmp_path / "csrc"
    shutil.copytree(B.CSRC, csrc)
    monkeypatch.setattr(B, "CSRC", csrc)

    def edit(file: str, text: str, line: int | None = None):
        path = csrc / file
        lines = path.read_text().splitlines(keepends=True)
        lines.insert(len(lines) if line is None else line - 1, text)
        path.write_text("".join(lines))
        return path

    return edit


@needs_nvcc
@pytest.mark.parametrize("capability,suffix,ctas_per_sm", [((9, 0), "sm90a", 2), ((8, 0), "sm80", 1)],
                         ids=["wgmma", "mma_sync"])
def test_source_builds_and_exports_the_launcher(shared_build, capability, suffix, ctas_per_sm):
    lib = B.library(capability)
    assert lib.mla_decode.restype is not None
    assert lib.mla_unit_ctas_per_sm(16) == ctas_per_sm  # which kernel the library holds
    assert lib.mla_supports_mxfp4() == lib.mla_supports_bf16() == (capability == B.WGMMA_CAPABILITY)
    assert lib.mla_bf16_ctas_per_sm() == (1 if capability == B.WGMMA_CAPABILITY else 0)
    assert lib.mla_max_unit_rows() == (64 if capability == B.WGMMA_CAPABILITY else 16)
    # the cooperative launch needs every CTA resident: the 64-row kernel's CTA takes an SM
    assert [lib.mla_unit_ctas_per_sm(rows) for rows in (16, 32, 64)] == (
        [2, 2, 1] if capability == B.WGMMA_CAPABILITY else [1, 1, 1])
    assert len(list(shared_build.glob(f"libmla_decode_{suffix}_*.so"))) == 1
    assert B.library(capability) is lib  # built once, then reused
    assert lib.mla_decode_call_fields() == len(B.DecodeCall._fields_) == 34
    layout = (ctypes.c_int * (lib.mla_decode_call_fields() + 1))()
    lib.mla_decode_call_layout(layout)  # the C struct the launcher reads, field by field, then its size
    fields = [getattr(B.DecodeCall, name).offset for name, _ in B.DecodeCall._fields_]
    assert list(layout) == fields + [ctypes.sizeof(B.DecodeCall)]


LAYOUT = B.decode_call_layout()  # the ctypes DecodeCall's field offsets, then its size


def field_shifted(layout: list[int], field: int, by: int) -> list[int]:
    """`layout` with one field's offset moved `by` bytes."""
    return layout[:field] + [layout[field] + by] + layout[field + 1:]


# (the stand-in library's DecodeCall layout, or None for no layout exports; what the refusal names): the first field
# that differs, a field too few or too many, another size, a library that cannot say
@pytest.mark.parametrize("layout,named", [
    (field_shifted(LAYOUT, 4, 8), r"field 4 \(seqs\) lies at byte 40 there, 32 here"),
    (field_shifted(field_shifted(LAYOUT, 22, 4), 24, -4), r"field 22 \(qk_scale\) lies at byte"),
    (LAYOUT[:33] + LAYOUT[-1:], r"33 fields, not 34 \(the first unmatched: slack\)"),
    (LAYOUT[:34] + [192, 200], r"35 fields, not 34 \(the first unmatched: its field 34\)"),
    (LAYOUT[:34] + [200], "its size is 200 bytes there, 192 here"),
    (None, "does not report its DecodeCall's layout"),
], ids=["offset", "first-of-two", "fewer", "more", "size", "no-export"])
def test_a_library_whose_decode_call_differs_is_refused_naming_the_field(layout, named):
    """check_decode_call compares the library's DecodeCall (mla_decode_call_layout) with the ctypes one field by
    field (negative controls; the real library's layout is checked in test_source_builds_and_exports_the_launcher)."""
    lib = standin_library(layout=layout)
    if layout is None:
        del lib.mla_decode_call_layout
    with pytest.raises(B.DecodeCallMismatch, match=named):
        B.check_decode_call(lib)


def test_a_library_whose_decode_call_matches_passes_the_check():
    assert LAYOUT[-1] == ctypes.sizeof(B.DecodeCall) == 192
    B.check_decode_call(standin_library())


def test_the_load_refuses_a_library_whose_decode_call_differs_and_remembers(fresh_build, monkeypatch):
    """library() checks the DecodeCall of what it loads: a mismatch is raised as build errors are, and raised again
    without another build or load; a library that matches is loaded with its exports typed."""
    builds, layouts = [], {"lib_80": field_shifted(LAYOUT, 26, 4), "lib_86": None}
    monkeypatch.setattr(B, "find_nvcc", lambda: "/opt/nvcc")
    monkeypatch.setattr(B, "build_library", lambda nvcc, arch, wgmma, csrc=None: builds.append(arch) or f"lib_{arch}")
    monkeypatch.setattr(B.ctypes, "CDLL", lambda path: standin_library(path, layouts[path]))
    for _ in range(2):
        with pytest.raises(B.DecodeCallMismatch, match=r"field 26 \(guess_rows\)"):
            B.library((8, 0))
    assert builds == ["80"]
    lib = B.library((8, 6))
    assert lib.path == "lib_86" and lib.mla_decode.restype is ctypes.c_int and B.library((8, 6)) is lib


@needs_nvcc
@pytest.mark.parametrize("capability", [(9, 0), (8, 0)], ids=["wgmma", "mma_sync"])
def test_the_launcher_refuses_units_its_kernel_does_not_take(shared_build, capability):
    """mla_decode checks the unit's rows before it touches the GPU (so on the CPU too): 16, or 32 and (the FP8 and BF16
    caches) 64 in the wgmma build, at least one head (a token's last unit is masked past its heads), and a cache
    format the build reads (BF16: the wgmma build); otherwise cudaErrorInvalidValue (1)."""
    lib = B.library(capability)
    widest = lib.mla_max_unit_rows()
    refused = [(0, 16, 0), (8, 16, 0), (24, 48, 0), (48, 96, 0), (widest * 2, 256, 0), (16, 0, 0), (16, -8, 0),
               (64, 128, 1), (16, 16, 3)]  # MXFP4 in 64-row units; no format 3
    if widest < 64:
        refused += [(64, 128, 0), (64, 128, 2), (16, 16, 2)]  # the mma.sync build: no 64-row units, no BF16
    for rows, num_heads, kv_format in refused:
        call = B.DecodeCall(batch=1, num_splits=1, num_heads=num_heads, q_len=1, unit_rows=rows, kv_format=kv_format)
        assert lib.mla_decode(ctypes.addressof(call)) == 1, (rows, num_heads, kv_format)


@needs_nvcc
@pytest.mark.parametrize("capability", [(9, 0), (8, 0)], ids=["wgmma", "mma_sync"])
def test_the_launcher_refuses_a_page_divisor_that_is_not_exact(shared_build, capability):
    """A paged call whose page_mul and page_shift are not page_divisor's (off by one either way, or a shift too small
    for the page size) or whose guess_rows is negative is refused before the GPU is touched (cudaErrorInvalidValue,
    1); the same call with page_divisor's pair is not refused (it fails later: no batch, so nothing is launched)."""
    lib = B.library(capability)

    def launch(page_size: int, page_mul: int, page_shift: int, guess_rows: int = 0) -> int:
        call = B.DecodeCall(batch=0, num_splits=1, num_heads=16, q_len=1, unit_rows=16, page_size=page_size,
                            max_pages=1, block_table=16, page_mul=page_mul, page_shift=page_shift,
                            guess_rows=guess_rows)
        return lib.mla_decode(ctypes.addressof(call))

    for size in (1, 48, 64):
        mul, shift = P.page_divisor(size)
        assert launch(size, mul, shift) != 1, size
        short_mul = -(-(1 << (shift - 1)) // size)
        for bad in [(mul - 1, shift), (mul + 1, shift), (short_mul, shift - 1), (mul, 63)]:
            assert launch(size, *bad) == 1, (size, bad)
        assert launch(size, mul, shift, guess_rows=-64) == 1, size


@needs_nvcc
def test_hopper_falls_back_to_the_mma_sync_kernel_with_a_warning(fresh_build, edited_sources, caplog):
    """An nvcc that cannot build the wgmma kernel (before 12.0: no sm_90a) still gives Hopper the mma.sync one."""
    edited_sources(B.MAIN_SOURCE, "#if MLA_WGMMA\n#error no sm_90a here\n#endif\n", line=1)
    with caplog.at_level("WARNING", logger="mla_decode"):
        lib = B.library((9, 0))
    assert lib.mla_unit_ctas_per_sm(16) == 1 and not lib.mla_supports_mxfp4() and lib.mla_max_unit_rows() == 16
    assert not lib.mla_supports_bf16()
    assert "the Hopper (wgmma) kernel did not build" in caplog.text and "no sm_90a here" in caplog.text
    assert [p.name.split("_")[2] for p in fresh_build.glob("*.so")] == ["sm90"]


@needs_nvcc
def test_a_failed_build_is_reported_with_nvcc_output_and_remembered(fresh_build, edited_sources):
    edited_sources(B.MAIN_SOURCE, "\nthis is not C++;\n")
    with pytest.raises(RuntimeError, match="nvcc failed"):
        B.library((9, 0))
    with pytest.raises(RuntimeError, match="nvcc failed"):  # remembered: no second compile
        B.library((9, 0))
    assert not list(fresh_build.glob("*.so"))


@needs_nvcc
@pytest.mark.parametrize("file,line", [("wgmma.cuh", 47), ("merge.cuh", 12), (B.MAIN_SOURCE, 29)])
def test_a_compiler_error_names_the_real_file_and_line(fresh_build, edited_sources, file, line):
    """nvcc compiles the package's files where they lie: its message points at the line to fix."""
    path = edited_sources(file, "this is not C++;\n", line)
    arch, wgmma = ("90a", True) if file == "wgmma.cuh" else ("80", False)
    with pytest.raises(RuntimeError, match="nvcc failed") as failure:
        B.build_library(B.find_nvcc(), arch, wgmma)
    assert re.search(rf"{re.escape(str(path))}\({line}\): error", str(failure.value)), str(failure.value)


def test_the_build_hash_covers_every_source_file(fresh_build, edited_sources, monkeypatch):
    """An edit to any of the files gives another library name (no stale build is loaded); unchanged sources reuse
    the library built before."""
    runs = []

    def fake_nvcc(cmd, **kwargs):  # writes the library nvcc would
        runs.append(cmd)
        Path(cmd[cmd.index("-o") + 1]).write_bytes(b"")
        return SimpleNamespace(returncode=0, stderr="")

    monkeypatch.setattr(B.subprocess, "run", fake_nvcc)
    first = B.build_library("/opt/nvcc", "80", False)
    assert B.build_library("/opt/nvcc", "80", False) == first and len(runs) == 1
    assert runs[0][-1] == str(B.CSRC / B.MAIN_SOURCE) and runs[0][runs[0].index("-I") + 1] == str(B.CSRC)
    names = {first}
    for path in B.source_files(B.CSRC):
        edited_sources(path.name, "// an edit\n")
        names.add(B.build_library("/opt/nvcc", "80", False))
    names |= {B.build_library("/opt/nvcc", "90a", True), B.build_library("/opt/other/nvcc", "80", False)}
    assert len(names) == len(B.source_files(B.CSRC)) + 3 == len(runs)


# (batch, seq_len, splits with 1 CTA per SM (mma.sync), with 2 (wgmma)): the measured best counts on the H200
@pytest.mark.parametrize("batch,seq_len,one,two", [(4, 1024, 16, 16), (4, 8192, 32, 32), (32, 1024, 4, 4),
                                                   (32, 8192, 4, 8), (64, 1024, 2, 4), (64, 8192, 2, 4),
                                                   (256, 1024, 1, 1), (256, 8192, 1, 1), (1, 1, 1, 1), (3, 0, 1, 1),
                                                   (1000, 50, 1, 1), (1, 100_000, 128, 256)])
def test_plan_fills_the_sms(batch, seq_len, one, two):
    assert P.cuda_plan(batch, seq_len, 132, 1) == one
    assert P.cuda_plan(batch, seq_len, 132, 2) == two


def test_plan_stays_within_what_the_merge_takes():
    assert P.cuda_plan(1, 10_000_000, 1000, 2) == P.MAX_SPLITS == 512


# (units, seq_len, page_size, kv_format, precise, unit_rows, splits) on 132 SMs, two CTAs per SM: FP8 pages under 64
# rows (rows gathered one by one) in the fast mode's 16-row units keep up to GATHERED_KEEP_SPLITS splits with a second
# CTA per SM, whatever their tiles; ragged, pages of 64, MXFP4, the precise mode and 32-row units halve below
# SPLIT_MIN_TILES tiles a split
@pytest.mark.parametrize("units,seq_len,page_size,kv_format,precise,rows,splits",
                         [(32, 1024, 1, "fp8", False, 16, 8), (32, 1024, 16, "fp8", False, 16, 8),
                          (32, 512, 1, "fp8", False, 16, 8), (4, 8192, 1, "fp8", False, 16, 32),
                          (64, 1024, 1, "fp8", False, 16, 4), (4, 1024, 1, "fp8", False, 16, 16),
                          (256, 1024, 1, "fp8", False, 16, 1), (7, 8191, 1, "fp8", False, 16, 16),
                          (32, 1024, 0, "fp8", False, 16, 4), (32, 1024, 64, "fp8", False, 16, 4),
                          (32, 1024, 128, "fp8", False, 16, 4), (32, 1024, 1, "mxfp4", False, 16, 4),
                          (32, 1024, 1, "fp8", True, 16, 4), (32, 512, 0, "fp8", False, 16, 4),
                          (32, 1024, 1, "fp8", False, 32, 4)])
def test_gathered_pages_keep_finer_splits(units, seq_len, page_size, kv_format, precise, rows, splits):
    key = P.LaunchKey(torch.device("cuda", 0), units, seq_len, kv_format, precise, rows, page_size)
    assert P.plan_splits(key, P.DeviceFacts(132, lambda unit_rows: 2, 64)) == splits


def test_page_divisor_is_the_division_below_2_31():
    """page_of's multiply and shift (page_divisor) is pos // page_size for every page size to 4096 and 200 larger
    ones, at the positions around the top of the range and around multiples of the size, where a rounding error
    would show; a shift one smaller (the negative control) is not exact for some."""
    gen = torch.Generator().manual_seed(0)
    sizes = list(range(1, 4097)) + torch.randint(4097, 1 << 24, (200,), generator=gen).tolist()
    top = (1 << 31) - 1
    inexact = 0
    for size in sizes:
        mul, shift = P.page_divisor(size)
        assert 0 < mul < 1 << 32 and 31 <= shift < 63, size
        last = top // size * size
        positions = {0, 1, size - 1, size, size + 1, top, top - 1, last, last - 1, last - size, last - size - 1}
        assert all((pos * mul) >> shift == pos // size for pos in positions), size
        short_mul = -(-(1 << (shift - 1)) // size)
        inexact += any((pos * short_mul) >> (shift - 1) != pos // size for pos in positions)
    assert inexact > 0


def test_split_rows_are_whole_tiles_covering_the_sequence():
    for length, splits in [(0, 1), (1, 1), (64, 1), (65, 1), (1024, 16), (1000, 16), (8191, 32), (8192, 64), (3, 4)]:
        rows = P.split_rows(length, splits)
        assert rows % P.BLOCK_N == 0 and rows * splits >= length and (rows - P.BLOCK_N) * splits < max(length, 1)


# (batch, q_len, num_heads, max_seqlen, kv format, precision, the library's widest unit, the plan's unit rows); 132 SMs.
# The H200 rows behind the rule, in 16- and 32-row units (docs/2026-12-02-serving.md, sections 8 and 10): 8 x 1k x
# 128 heads 20.3 / 28.7 us, 32 x 1k x 128 40.0 / 50.0, 1 x 8k x 128 x q_len 2 26.3 / 27.4, 8 x 8k x 64 41.8 / 38.9,
# 16 x 4k x 128 x q_len 2 127.5 / 114.9, 8 x 8k x 128 72.5 / 62.1.
@pytest.mark.parametrize("batch,q_len,num_heads,max_seqlen,kv_format,precision,widest,rows",
                         [(128, 1, 128, 1024, "fp8", "fast", 32, 32),  # 512 CTAs, 16 tiles each
                          (8, 1, 128, 1024, "fp8", "fast", 32, 16),  # 32 units x 4 splits = 128 CTAs: idle SMs
                          (32, 1, 128, 1024, "fp8", "fast", 32, 16),  # 2 splits of 8 tiles; 16 rows need no split
                          (1, 2, 128, 8192, "fp8", "fast", 32, 16),  # 32 splits of 4 tiles
                          (8, 1, 64, 8192, "fp8", "fast", 32, 32),  # 16 splits of 8 tiles; 16 rows split too
                          (16, 2, 128, 4096, "fp8", "fast", 32, 32),  # 2 splits of 32 tiles
                          (8, 1, 128, 8192, "fp8", "fast", 32, 32),  # 8 splits of 16 tiles
                          (128, 1, 32, 1024, "fp8", "fast", 32, 16), (2, 1, 32, 1024, "fp8", "fast", 32, 16),
                          (128, 1, 16, 1024, "fp8", "fast", 32, 16), (128, 1, 48, 1024, "fp8", "fast", 32, 16),
                          (128, 1, 128, 1024, "fp8", "precise", 32, 16), (128, 1, 128, 1024, "fp8", "fast", 16, 16),
                          (128, 1, 96, 1024, "fp8", "fast", 64, 32), (128, 1, 128, 1024, "mxfp4", "fast", 64, 32),
                          (128, 1, 128, 1024, "fp8", "precise", 64, 16),
                          # with the 64-row kernel: the thirteen rows of the serving journal's section 12, and more
                          (1, 2, 128, 32768, "fp8", "fast", 64, 64),  # 32 splits of 16 tiles
                          (8, 1, 128, 1024, "fp8", "fast", 64, 16),  # 8 splits of 2 tiles
                          (32, 2, 128, 8192, "fp8", "fast", 64, 64), (32, 1, 128, 32768, "fp8", "fast", 64, 64),
                          (128, 2, 128, 1024, "fp8", "fast", 64, 64),  # 512 CTAs, no split
                          (1, 2, 128, 8192, "fp8", "fast", 64, 64),  # 32 splits of 4 tiles; 16 rows split too
                          (8, 1, 128, 8192, "fp8", "fast", 64, 64), (8, 1, 128, 32768, "fp8", "fast", 64, 64),
                          (16, 2, 128, 4096, "fp8", "fast", 64, 64),
                          (32, 1, 128, 1024, "fp8", "fast", 64, 16),  # 2 splits of 8 tiles; 16 rows need no split
                          (64, 1, 128, 8192, "fp8", "fast", 64, 64),
                          (8, 1, 64, 8192, "fp8", "fast", 64, 64),  # 16 splits of 8 tiles; 16 rows split too
                          (32, 2, 64, 8192, "fp8", "fast", 64, 64),
                          (128, 1, 128, 1024, "fp8", "fast", 64, 64), (33, 1, 128, 1024, "fp8", "fast", 64, 16),
                          (256, 1, 64, 1024, "fp8", "fast", 64, 64), (128, 1, 64, 1024, "fp8", "fast", 64, 64),
                          (2, 1, 64, 1024, "fp8", "fast", 64, 16),
                          (256, 1, 64, 512, "fp8", "fast", 64, 64)])  # 256 CTAs of 8 tiles, no split
def test_wider_units_where_the_hopper_kernel_serves_them(fake_nvidia_gpu, batch, q_len, num_heads, max_seqlen,
                                                         kv_format, precision, widest, rows):
    """plan_unit_rows, on the CPU with the GPU's facts given (132 SMs, 2 CTAs an SM, 1 for 64-row units): in the fast
    mode's wgmma library (its mla_max_unit_rows; 16 in Hopper's mma.sync fallback),
    64 query rows a CTA where served (heads in 64s, FP8) and a 64-row CTA walks at least 16 tiles, the unsplit
    64-row grid fills the SMs, or it walks at least 4 tiles where the 16-row plan splits too; else 32 where the heads
    come in 32s, the 32-row grid has more CTAs than SMs and a 32-row CTA walks at least 16 tiles, or 8 where the
    16-row plan splits too; else 16. The units (the grid's y, the split plan's and the workspace's count) are of
    those rows. The backend option unit_rows asks for what the kernel serves (64: heads in 64s, the FP8 cache) and is
    refused otherwise, naming what it takes."""
    facts = P.DeviceFacts(132, lambda unit_rows: 1 if unit_rows == 64 else 2, widest)
    dtype = torch.float8_e4m3fn if kv_format == "fp8" else torch.uint8
    problem = mla_decode.api.make_problem(batch, dtype, fake_nvidia_gpu, layout="ragged", max_seqlen=max_seqlen,
                                          num_heads=num_heads, q_len=q_len, causal=q_len > 1, precision=precision)
    assert P.plan_unit_rows(problem, facts) == rows
    assert P.query_units(problem, rows) == batch * q_len * num_heads // rows
    assert P.plan_unit_rows(problem, facts, 16) == 16
    fast = precision == "fast"
    served = [16] + [r for r in (32, 64) if fast and num_heads % r == 0 and widest >= r and (r < 64 or kv_format !=
                                                                                                 "mxfp4")]
    for asked in (32, 64):
        if asked in served:
            assert P.plan_unit_rows(problem, facts, asked) == asked
        else:
            with pytest.raises(ValueError, match=rf"unit_rows {asked}: this problem's cuda kernel takes "
                                                 rf"\[{', '.join(map(str, served))}\] query rows"):
                P.plan_unit_rows(problem, facts, asked)
    with pytest.raises(ValueError, match="unit_rows 128"):
        P.plan_unit_rows(problem, facts, 128)


# (num_heads, precision, kv_format, the library's widest unit, the rows a unit can take)
@pytest.mark.parametrize("num_heads,precision,kv_format,widest,served", [
    (128, "fast", "fp8", 64, [16, 32, 64]), (64, "fast", "fp8", 64, [16, 32, 64]), (96, "fast", "fp8", 64, [16, 32]),
    (128, "fast", "mxfp4", 64, [16, 32]), (128, "fast", "bf16", 64, [16, 32, 64]),
    (64, "fast", "bf16", 64, [16, 32, 64]), (128, "fast", "fp8", 32, [16, 32]), (128, "fast", "fp8", 16, [16]),
    (48, "fast", "fp8", 64, [16]), (16, "fast", "fp8", 64, [16]), (128, "precise", "fp8", 64, [16])])
def test_served_unit_rows(fake_nvidia_gpu, num_heads, precision, kv_format, widest, served):
    """Wider units only in the fast mode, where the heads come in 32s (64s, and the FP8 or BF16 cache, for 64 rows) and
    the library takes them."""
    dtype = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}.get(kv_format, torch.uint8)
    problem = mla_decode.api.make_problem(8, dtype, fake_nvidia_gpu, layout="ragged", max_seqlen=1024,
                                          num_heads=num_heads, precision=precision)
    assert P.served_unit_rows(problem, widest) == served


def test_the_unit_rows_follow_the_gpu_s_facts(fake_nvidia_gpu):
    """The same problem (128 x 2 tokens x 128 heads, 1024 positions) in 64-row units on 132 SMs, where its 512 unsplit
    64-row CTAs fill the GPU, and in 16-row units on 1024 SMs, where they would not and a 32-row CTA would walk 8
    tiles; units of a sequence's rows, so 48 heads x 2 tokens take 32-row units (three a sequence, the second
    spanning both tokens) and 48 heads x 1 token 16-row ones whatever the GPU; a unit the kernel does not take is
    refused by its backend option's name."""
    problem = mla_decode.api.make_problem(128, torch.float8_e4m3fn, fake_nvidia_gpu, layout="ragged", max_seqlen=1024,
                                          num_heads=128, q_len=2, causal=True)
    hopper = P.DeviceFacts(132, lambda unit_rows: 1 if unit_rows == 64 else 2, 64)
    assert P.plan_unit_rows(problem, hopper) == 64
    assert P.plan_unit_rows(problem, hopper._replace(sms=1024)) == 16
    assert P.plan_unit_rows(problem._replace(num_heads=48), hopper) == 32
    assert P.query_units(problem._replace(num_heads=48), 32) == 128 * 3
    one_token = problem._replace(num_heads=48, q_len=1, causal=False)
    assert P.plan_unit_rows(one_token, hopper) == 16
    with pytest.raises(ValueError, match=r"^backend_options: unit_rows 32: this problem's cuda kernel takes \[16\] "
                                         r"query rows a CTA \(1 x 48 heads, fp8, fast mode\)$"):
        P.plan_unit_rows(one_token, hopper, 32)


# (batch, kv, heads, q_len, kv_format, rows): units of a sequence's query rows, spanning its tokens where they fit
SPANNING_PLANS = [(128, 16384, 16, 2, "fp8", 32), (128, 16384, 32, 2, "fp8", 64), (128, 4096, 16, 4, "fp8", 64),
                  (128, 16384, 16, 2, "bf16", 32), (128, 4096, 32, 1, "bf16", 32), (128, 16384, 32, 2, "bf16", 64),
                  (128, 16384, 16, 2, "mxfp4", 32), (128, 16384, 8, 2, "fp8", 16), (8, 8192, 16, 2, "bf16", 16)]


@pytest.mark.parametrize("batch,kv,num_heads,q_len,kv_format,rows", SPANNING_PLANS)
def test_units_span_a_sequence_s_tokens(fake_nvidia_gpu, batch, kv, num_heads, q_len, kv_format, rows):
    """A unit holds a sequence's q_len x heads query rows in turn, so 16 heads x 2 tokens fill a 32-row unit and 32 x 2
    (or 16 x 4) a 64-row one: the KV is read once for both tokens. BF16 runs one CTA an SM whatever the rows, so
    batch 128 at 16 heads x 2 takes 32-row units (128 CTAs) where 16-row ones would need two waves (256); 8 x 2 heads
    make one 16-row unit a sequence."""
    facts = P.DeviceFacts(132, lambda unit_rows: 1 if unit_rows == 64 else 2, 64, 1)
    dtype = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}.get(kv_format, torch.uint8)
    problem = mla_decode.api.make_problem(batch, dtype, fake_nvidia_gpu, layout="paged", page_size=64,
                                          max_pages=kv // 64, num_heads=num_heads, q_len=q_len, causal=q_len > 1,
                                          max_seqlen=kv)
    assert P.plan_unit_rows(problem, facts) == rows
    assert P.query_units(problem, rows) == batch * -(-q_len * num_heads // rows)


def test_device_facts_are_the_gpu_s_and_its_library_s(fake_nvidia_gpu, monkeypatch):
    """decode.device_facts reads the SM count and the library of the problem's mode (built by then): what the plan
    and launch_splits are given."""
    libraries = {False: standin_library("fast", mla_max_unit_rows=lambda: 64, mla_unit_ctas_per_sm=lambda rows: 2,
                                        mla_bf16_ctas_per_sm=lambda: 1),
                 True: standin_library("precise")}
    monkeypatch.setattr(D, "capability", lambda device: (9, 0))
    monkeypatch.setattr(D, "library", lambda capability, precise=False: libraries[precise])
    for precise, lib in libraries.items():
        assert D.device_facts(fake_nvidia_gpu, precise) == (132, lib.mla_unit_ctas_per_sm, lib.mla_max_unit_rows(),
                                                           lib.mla_bf16_ctas_per_sm())
    key = P.LaunchKey(fake_nvidia_gpu, 32, 8192, "fp8", False)  # 8 splits with 2 CTAs an SM, 4 with 1
    assert D.launch_splits(key) == P.cuda_plan(32, 8192, 132, 2) == 8
    assert D.launch_splits(key._replace(kv_format="bf16")) == P.cuda_plan(32, 8192, 132, 1) == 4  # one BF16 CTA
    assert D.launch_splits(key._replace(precise=True)) == P.cuda_plan(32, 8192, 132, 1) == 4


def test_forced_cuda_off_nvidia_fails_clearly(monkeypatch):
    monkeypatch.setenv("MLA_BACKEND", "cuda")
    with pytest.raises(RuntimeError, match="MLA_BACKEND=cuda: cuda backend: needs an NVIDIA GPU"):
        S.leaderboard_backend(torch.device("cpu"))


def test_the_package_needs_nothing_from_submission():
    """submission.py imports the package lazily, and the package never imports it back (no import cycle)."""
    code = "import sys, mla_decode.cuda; assert 'submission' not in sys.modules, sorted(sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr


@pytest.fixture
def fake_nvidia_gpu(monkeypatch):
    """An NVIDIA GPU as leaderboard_backend sees it (with the SM count the plan reads), on the CPU; the cached
    package import and auto's cached verdicts are dropped before and after."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    monkeypatch.delenv("MLA_BACKEND", raising=False)
    monkeypatch.delenv("MLA_KV_FORMAT", raising=False)
    monkeypatch.delenv("MLA_PRECISION", raising=False)
    S.cuda_package.cache_clear()
    S.cuda_auto_reason.cache_clear()
    yield torch.device("cuda", 0)
    S.cuda_package.cache_clear()
    S.cuda_auto_reason.cache_clear()


def leaderboard_problem(device: torch.device, kv_format: str = "fp8", precision: str = "fast"):
    """The Problem of a leaderboard call on `device` in that format and precision (as leaderboard_backend makes it)."""
    kv_dtype = torch.float8_e4m3fn if kv_format == "fp8" else torch.uint8
    return S.make_problem(1, kv_dtype, device, layout="ragged", max_seqlen=1, precision=precision, return_lse=False)


def test_the_bf16_cache_is_served_by_the_hopper_kernel_in_the_fast_mode(fake_nvidia_gpu, monkeypatch):
    """The BF16 cache: the cuda backend serves it (auto's pick) with a library that has the BF16 kernel (Hopper, one
    CTA an SM), in units of 16, 32 or 64 rows (64 here: 128 heads), with half the FP8 plan's splits; it refuses it in
    the precise mode and with a library without that kernel, saying why. The libraries are stand-ins: what is checked
    is what the backend reads of them."""
    hopper = standin_library("lib_90a", mla_supports_bf16=lambda: 1, mla_bf16_ctas_per_sm=lambda: 1,
                             mla_max_unit_rows=lambda: 64, mla_unit_ctas_per_sm=lambda rows: 1 if rows == 64 else 2)
    ampere = standin_library("lib_80")  # the mma.sync build: no BF16 kernel
    gpu = {"capability": (9, 0)}
    monkeypatch.setattr(D, "capability", lambda device: gpu["capability"])
    monkeypatch.setattr(D, "library", lambda capability, precise=False: hopper if capability == (9, 0) and not precise
                        else ampere)
    problem = S.make_problem(128, torch.bfloat16, fake_nvidia_gpu, layout="paged", page_size=64, max_pages=64,
                             num_heads=128, q_len=2, causal=True)
    assert problem.kv_format == "bf16" and D.cuda_unusable_reason(problem) is None
    assert S.cuda_auto_reason(problem) is None  # auto's pick for BF16 on Hopper (the precise mode: triton's)
    facts = D.device_facts(fake_nvidia_gpu, False)
    assert facts.bf16_ctas_per_sm == 1 and P.plan_unit_rows(problem, facts) == 64
    assert P.served_unit_rows(problem, 64) == [16, 32, 64]
    key = P.LaunchKey(fake_nvidia_gpu, 32, 8192, "bf16", False, 16)  # 4 splits with one CTA an SM, FP8's 8 with 2
    assert P.plan_splits(key, facts) == 4 and P.plan_splits(key._replace(kv_format="fp8"), facts) == 8
    assert D.cuda_unusable_reason(problem._replace(precision="precise")) == (
        "cuda backend: the precise mode reads the FP8 cache only (its mma.sync kernel has no BF16 path)")
    gpu["capability"] = (8, 0)
    assert D.cuda_unusable_reason(problem) == (
        "cuda backend: reads BF16 only with its Hopper (sm_90a) kernel; this GPU has capability (8, 0)")


def test_without_the_package_auto_takes_triton_and_forced_cuda_says_how_to_install_it(fake_nvidia_gpu, monkeypatch,
                                                                                      caplog):
    """submission.py copied alone (the leaderboard's upload): `import mla_decode.cuda` fails."""
    monkeypatch.setitem(sys.modules, "mla_decode.cuda", None)
    assert S.cuda_unusable_reason(leaderboard_problem(fake_nvidia_gpu)) == S.CUDA_PACKAGE_MISSING
    assert "mla_decode.cuda package is not importable" in S.CUDA_PACKAGE_MISSING
    assert "pip install -e ." in S.CUDA_PACKAGE_MISSING
    with caplog.at_level("WARNING", logger="mla_decode"):
        assert S.leaderboard_backend(fake_nvidia_gpu) == ("triton" if S.triton is not None else "torch")
    assert f"not cuda: {S.CUDA_PACKAGE_MISSING}" in caplog.text
    monkeypatch.setenv("MLA_BACKEND", "cuda")
    with pytest.raises(RuntimeError, match=re.escape(f"MLA_BACKEND=cuda: {S.CUDA_PACKAGE_MISSING}")):
        S.leaderboard_backend(fake_nvidia_gpu)


def test_auto_warns_only_where_the_cuda_backend_serves_nothing(fake_nvidia_gpu, monkeypatch, caplog):
    """A GPU whose cuda kernels build but do not read MXFP4 (not Hopper): auto takes triton for an MXFP4 cache with no
    warning (the reason is only logged among what auto passed over), and cuda for FP8."""
    monkeypatch.setattr(D, "unusable_reason", lambda device, kv_format="fp8", precise=False: (
        "cuda backend: reads MXFP4 only with its Hopper (sm_90a) kernel" if kv_format == "mxfp4" else None))
    monkeypatch.setattr(D, "device_facts", lambda device, precise: P.DeviceFacts(132, lambda unit_rows: 1, 16))
    with caplog.at_level("WARNING", logger="mla_decode"):
        assert S.leaderboard_backend(fake_nvidia_gpu, "mxfp4") == ("triton" if S.triton is not None else "torch")
        assert S.leaderboard_backend(fake_nvidia_gpu, "fp8") == "cuda"
    assert "not cuda" not in caplog.text


def test_a_package_that_fails_to_import_says_why(fake_nvidia_gpu, monkeypatch, tmp_path):
    """A cuda package that is there but whose own import fails: the reason carries that import's error. The broken
    package stands first on mla_decode's search path; the real one is back in sys.modules afterwards."""
    broken = tmp_path / "cuda"
    broken.mkdir()
    (broken / "__init__.py").write_text("import no_such_module_for_this_test\n")
    monkeypatch.setattr(mla_decode, "__path__", [str(tmp_path), *mla_decode.__path__])
    monkeypatch.delitem(sys.modules, "mla_decode.cuda")
    monkeypatch.delattr(mla_decode, "cuda")
    reason = S.cuda_unusable_reason(leaderboard_problem(fake_nvidia_gpu))
    assert reason.startswith("cuda backend: the mla_decode.cuda package failed to import") and \
        "no_such_module_for_this_test" in reason


@needs_nvcc
def test_auto_on_nvidia_falls_back_to_triton_with_a_warning_when_the_kernel_cannot_build(fresh_build, edited_sources,
                                                                                           monkeypatch, caplog):
    """The choice auto makes on an NVIDIA GPU, checked on the CPU: a GPU of capability 9.0 is simulated and the
    build is broken on purpose; MLA_BACKEND=cuda raises the build error instead."""
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(D, "capability", lambda device: (9, 0))
    edited_sources(B.MAIN_SOURCE, "\nthis is not C++;\n")
    S.cuda_auto_reason.cache_clear()
    monkeypatch.delenv("MLA_BACKEND", raising=False)
    monkeypatch.delenv("MLA_KV_FORMAT", raising=False)
    with caplog.at_level("WARNING", logger="mla_decode"):
        assert S.leaderboard_backend(gpu) == ("triton" if S.triton is not None else "torch")
    assert "not cuda: cuda backend: nvcc failed" in caplog.text
    monkeypatch.setenv("MLA_BACKEND", "cuda")
    with pytest.raises(RuntimeError, match="MLA_BACKEND=cuda: cuda backend: nvcc failed"):
        S.leaderboard_backend(gpu)
    S.cuda_auto_reason.cache_clear()


@needs_nvcc
@pytest.mark.parametrize("capability,mxfp4_backend", [((9, 0), "cuda"), ((8, 0), "triton")],
                         ids=["hopper", "ampere"])
def test_auto_on_nvidia_picks_cuda_where_it_reads_the_format(shared_build, monkeypatch, capability, mxfp4_backend):
    """FP8: cuda on any NVIDIA GPU it builds for; MXFP4: cuda with the Hopper kernel, else triton; MLA_BACKEND=cuda
    with MXFP4 elsewhere fails naming why."""
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(D, "capability", lambda device: capability)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    S.cuda_auto_reason.cache_clear()
    monkeypatch.delenv("MLA_BACKEND", raising=False)
    monkeypatch.setenv("MLA_KV_FORMAT", "fp8")
    assert S.leaderboard_backend(gpu) == "cuda"
    monkeypatch.setenv("MLA_KV_FORMAT", "mxfp4")
    fallback = "triton" if S.triton is not None else "torch"
    assert S.leaderboard_backend(gpu) == (mxfp4_backend if mxfp4_backend == "cuda" else fallback)
    if mxfp4_backend != "cuda":
        monkeypatch.setenv("MLA_BACKEND", "cuda")
        with pytest.raises(RuntimeError, match="MLA_BACKEND=cuda: cuda backend: reads MXFP4 only with its Hopper"):
            S.leaderboard_backend(gpu)
    S.cuda_auto_reason.cache_clear()


def test_precise_mode_takes_the_mma_sync_kernel_and_refuses_mxfp4(fake_nvidia_gpu, monkeypatch):
    """MLA_PRECISION=precise: the mma.sync kernel (fp16 score product) even on Hopper, a library of its own beside
    the wgmma one; MXFP4 (only the wgmma kernel reads it) is refused naming the precise mode, and auto then takes
    triton for it. Builds are faked: which kernel and target each library is built for is what is checked."""
    built = []

    def fake_build(nvcc, arch, wgmma, csrc=None):
        built.append((arch, wgmma))
        return f"lib_{arch}"

    def fake_cdll(path):
        return standin_library(path, mla_supports_mxfp4=lambda: int(path.endswith("a")))

    monkeypatch.setattr(B, "_LIBS", {})
    monkeypatch.setattr(B, "find_nvcc", lambda: "/opt/nvcc")
    monkeypatch.setattr(B, "build_library", fake_build)
    monkeypatch.setattr(B.ctypes, "CDLL", fake_cdll)
    monkeypatch.setattr(D, "capability", lambda device: (9, 0))
    assert B.library((9, 0)).path == "lib_90a" and B.library((9, 0), precise=True).path == "lib_90"
    assert built == [("90a", True), ("90", False)]
    assert S.cuda_unusable_reason(leaderboard_problem(fake_nvidia_gpu, "fp8", "precise")) is None
    assert "precise mode reads the FP8 cache only" in S.cuda_unusable_reason(
        leaderboard_problem(fake_nvidia_gpu, "mxfp4", "precise"))
    monkeypatch.setenv("MLA_PRECISION", "precise")
    assert S.leaderboard_backend(fake_nvidia_gpu, "fp8") == "cuda"
    assert S.leaderboard_backend(fake_nvidia_gpu, "mxfp4") == ("triton" if S.triton is not None else "torch")
    monkeypatch.setenv("MLA_BACKEND", "cuda")
    with pytest.raises(RuntimeError, match="MLA_BACKEND=cuda: .*precise mode reads the FP8 cache only"):
        S.leaderboard_backend(fake_nvidia_gpu, "mxfp4")


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("rows,kv_seq_len,uniform", [(1024, 256, True), (1000, 256, False), (1024, None, False)],
                         ids=["uniform", "short", "no-promise"])
def test_the_adapter_asks_for_fixed_splits_where_the_leaderboard_was_tuned(monkeypatch, rows, kv_seq_len, uniform,
                                                                           backend):
    """custom_kernel's cuda plan cuts fixed splits whatever the lengths (the leaderboard face keeps what it was
    tuned with; the library's cuda default is balanced); its triton plan where the config promises every length
    (kv_seq_len, the longest, with batch x kv_seq_len rows in all: equal splits are balanced and need no schedule
    kernel), else the library's default, whatever that is."""
    options = {"schedule": "fixed"} if backend == "cuda" or uniform else None
    import mla_decode.leaderboard as L

    seen = []

    class Recorder:
        def __init__(self, problem, backend, backend_options=None):
            seen.append(backend_options)
            self.backend = backend

    monkeypatch.setattr(L, "_choose", lambda problem, chosen: backend)
    monkeypatch.setattr(L, "DecodePlan", Recorder)
    q, kv_data, _, kv_indptr, config = R.generate_input(4, 1, 256, seed=1)
    kv, scale = kv_data["fp8"]
    L._new_dispatch(q, kv[:rows], scale, kv_indptr, {**config, "kv_seq_len": kv_seq_len}, "fp8")
    assert seen == [options]


def test_a_schedule_of_another_plan_is_refused():
    """A given schedule must have this plan's parts and items (schedule_words, int32): one of another plan, or the old
    (max_items, 4) layout, would send the kernels past its end for part_first."""
    D = pytest.importorskip("mla_decode.cuda.decode")
    want = (D.schedule_words(264, 264 + 8),)
    good = torch.zeros(want, dtype=torch.int32)
    D.expect_schedule(good, want)
    for bad in (torch.zeros(D.schedule_words(132, 132 + 8), dtype=torch.int32),
                torch.zeros((264 + 8, 4), dtype=torch.int32), good.long()):
        with pytest.raises(ValueError, match="schedule: expected this balanced plan's make_schedule"):
            D.expect_schedule(bad, want)


@pytest.mark.parametrize("kv_dtype,num_heads,options,slack", [
    (torch.float8_e4m3fn, 128, {}, 8), (torch.bfloat16, 128, {}, 4), (torch.float8_e4m3fn, 16, {}, 0),
    (torch.bfloat16, 16, {}, 0), (torch.float8_e4m3fn, 128, {"slack": 3}, 3), (torch.bfloat16, 16, {"slack": 0}, 0)])
def test_the_fill_cut_s_slack_follows_the_unit_and_the_option(fake_nvidia_gpu, monkeypatch, kv_dtype, num_heads,
                                                               options, slack):
    """The balanced plan's DecodeCall carries the slack of its units' format and rows (plan.FILL_SLACK: 64-row FP8
    and BF16 units), or the backend option's."""
    problem = S.make_problem(128, kv_dtype, fake_nvidia_gpu, layout="paged", page_size=64, max_pages=256,
                             num_heads=num_heads, max_seqlen=16384)
    decode = hopper_decode(monkeypatch, problem, **options)
    assert (decode.call.unit_rows, decode.call.slack) == (64 if num_heads == 128 else 16, slack)


def hopper_decode(monkeypatch, problem, **options) -> "D.CudaDecode":
    """The plan on a Hopper GPU's stand-in library (BF16, units of 16 to 64 rows)."""
    hopper = standin_library("lib_90a", mla_supports_bf16=lambda: 1, mla_bf16_ctas_per_sm=lambda: 1,
                             mla_max_unit_rows=lambda: 64, mla_unit_ctas_per_sm=lambda rows: 1 if rows == 64 else 2)
    monkeypatch.setattr(D, "capability", lambda device: (9, 0))
    monkeypatch.setattr(D, "library", lambda capability, precise=False: hopper)
    return D.CudaDecode(problem, **options)


def test_a_negative_slack_is_refused_naming_the_option(fake_nvidia_gpu):
    problem = S.make_problem(8, torch.float8_e4m3fn, fake_nvidia_gpu, layout="paged", page_size=64, max_pages=4)
    with pytest.raises(ValueError, match="backend_options: slack -1: expected an int >= 0"):
        D.CudaDecode(problem, slack=-1)


@pytest.mark.parametrize("cut", ["line", "fill", "pack"])
def test_the_cut_option_reaches_the_call(fake_nvidia_gpu, monkeypatch, cut):
    problem = S.make_problem(8, torch.float8_e4m3fn, fake_nvidia_gpu, layout="paged", page_size=64, max_pages=4)
    assert hopper_decode(monkeypatch, problem, cut=cut).call.cut == ("line", "fill", "pack").index(cut)


def test_the_pack_cut_refuses_a_batch_past_its_sort(fake_nvidia_gpu, monkeypatch):
    """The pack cut's kernel sorts the batch in shared memory: a larger batch is refused before any launch, naming the
    option and the way out."""
    problem = S.make_problem(4097, torch.float8_e4m3fn, fake_nvidia_gpu, layout="paged", page_size=64, max_pages=4)
    with pytest.raises(ValueError, match="cut 'pack' takes batches of at most 4096 sequences, got 4097: pass cut"):
        hopper_decode(monkeypatch, problem, cut="pack")
    assert hopper_decode(monkeypatch, problem, cut="fill").call.cut == 1
