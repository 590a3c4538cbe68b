"""submission.py: input validation, backend selection, and the torch backend against the BF16 reference."""

import os
import sys
import threading
from pathlib import Path

import pytest
import torch

import mla_decode
import reference as R
import submission as S
from testkit.attention import assert_matches, fp8_per_head, fp32_attention, nan_outside

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    monkeypatch.setenv("MLA_BACKEND", "torch")
    monkeypatch.delenv("MLA_KV_FORMAT", raising=False)
    monkeypatch.delenv("MLA_VALIDATE", raising=False)


def clone(data):
    q, kv_data, qo, kv, config = data
    return (q.clone(), {k: tuple(t.clone() for t in v) if isinstance(v, tuple) else v.clone()
                        for k, v in kv_data.items()}, qo.clone(), kv.clone(), dict(config))


LENGTHS = {
    "uniform": [256] * 4,
    "varlen_odd_and_one": [1, 7, 0, 33, 129, 1, 2],
    "single_long": [3001],
}


@pytest.mark.parametrize("kv_format", ["fp8", "mxfp4"])
@pytest.mark.parametrize("lengths", sorted(LENGTHS))
@pytest.mark.parametrize("chunk_rows", [S.TORCH_CHUNK_ROWS, 500])
def test_torch_backend_matches_reference(monkeypatch, kv_format, lengths, chunk_rows):
    monkeypatch.setenv("MLA_KV_FORMAT", kv_format)
    monkeypatch.setattr(S, "TORCH_CHUNK_ROWS", chunk_rows)  # 500 forces grouping limits and multi-chunk merges
    data = R.generate_varlen_input(LENGTHS[lengths], seed=len(lengths) + chunk_rows, device=CPU)
    out = S.custom_kernel(clone(data))
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (len(LENGTHS[lengths]), 16, 512)
    assert_matches(data, out, fp32_attention(data, kv_format), 4e-3)  # bf16 rounding only


# Lengths whose last one stays in the cache past kv_indptr[-1] (nan_outside's `trailing`): 0, 1 and odd lengths.
NAN_OUTSIDE_LENGTHS = [5, 1, 0, 70, 3, 9]


@pytest.mark.parametrize("kv_format", ["fp8", "mxfp4"])
@pytest.mark.parametrize("keep", range(len(NAN_OUTSIDE_LENGTHS) - 1))
def test_torch_backend_reads_no_row_outside_a_sequence(monkeypatch, kv_format, keep):
    """Every cache row outside sequence `keep` is NaN, those past kv_indptr[-1] included: its output stays exact."""
    monkeypatch.setenv("MLA_KV_FORMAT", kv_format)
    data, exact = nan_outside(R.generate_varlen_input(NAN_OUTSIDE_LENGTHS, seed=keep, device=CPU), kv_format, keep, 1)
    out = S.custom_kernel(data)[keep]
    assert torch.isfinite(out).all()
    assert R.worst_row_relative_l2(out[None], exact[None]) < 4e-3


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs triton under its interpreter"))])
@pytest.mark.parametrize("q_seq_len", [2, 4])
def test_multi_token_tuples_are_causal(monkeypatch, backend, q_seq_len):
    """The tuple with q_seq_len L > 1 (qo_indptr steps of L): token i of L sees the first n - L + 1 + i rows
    (reference.py's rule); lengths 0, 1 and 2 leave tokens that see nothing (zeros)."""
    monkeypatch.setenv("MLA_BACKEND", backend)
    data = R.generate_varlen_input([0, 1, 2, 77, 130], seed=q_seq_len, qseqlen=q_seq_len, device=CPU)
    out = S.custom_kernel(clone(data))
    assert tuple(out.shape) == (5 * q_seq_len, 16, 512)
    q = fp8_per_head(data[0]) if backend == "triton" else None  # the triton kernel's fast FP8 Q
    exact = fp32_attention(data, "fp8", q)
    assert_matches(data, out, exact, 4e-3, kv_format="fp8")
    # the bound fails on a planted bug: the tokens not causal (every one sees its whole sequence)
    kv, scale = data[1]["fp8"]
    blind = mla_decode.plan_ragged(5, kv.dtype, CPU, 130, q_len=q_seq_len, causal=False, backend="torch")
    wrong, _ = blind.run_ragged(data[0].view(5, q_seq_len, 16, 576), kv, data[3], scale)
    assert R.worst_row_relative_l2(wrong.view(out.shape), exact) > 4e-3


def test_torch_backend_leaderboard_case_uniform_1024():
    data = R.generate_input(4, 1, 1024, seed=4220)
    ok, msg = R.check_implementation(data, S.custom_kernel(clone(data)))
    assert ok, msg


def test_inputs_are_not_modified():
    data = R.generate_varlen_input([5, 9], seed=2, device=CPU)
    before = clone(data)
    S.custom_kernel(data)
    assert torch.equal(data[0], before[0]) and torch.equal(data[1]["fp8"][0].view(torch.uint8),
                                                           before[1]["fp8"][0].view(torch.uint8))


# --- validation: each bad input raises a clear error naming the field -------------------------------------


def base():
    return clone(R.generate_varlen_input([4, 6, 5], seed=1, device=CPU))


def with_q(fn):
    def make():
        q, kv, qo, kvp, c = base()
        return fn(q), kv, qo, kvp, c
    return make


def with_kv(fmt, fn):
    def make():
        q, kv, qo, kvp, c = base()
        kv[fmt] = fn(kv[fmt])
        return q, kv, qo, kvp, c
    return make


def with_config(**changes):
    def make():
        q, kv, qo, kvp, c = base()
        c.update(changes)
        for key, value in changes.items():
            if value is KeyError:
                del c[key]
        return q, kv, qo, kvp, c
    return make


def with_indptr(qo_fn=None, kv_fn=None):
    def make():
        q, kv, qo, kvp, c = base()
        return q, kv, qo_fn(qo) if qo_fn else qo, kv_fn(kvp) if kv_fn else kvp, c
    return make


BAD_INPUTS = {
    "data not a 5-tuple": (lambda: base()[:4], TypeError, "data"),
    "q float32": (with_q(lambda q: q.float()), ValueError, "q.dtype"),
    "q 8 heads": (with_q(lambda q: q[:, :8].contiguous()), ValueError, "q.shape"),
    "q 512 dims": (with_q(lambda q: q[:, :, :512].contiguous()), ValueError, "q.shape"),
    "q strided": (with_q(lambda q: q.transpose(0, 1).contiguous().transpose(0, 1)), ValueError, "q"),
    "q rows != batch": (with_q(lambda q: q[:2].contiguous()), ValueError, "q.shape[0]"),
    "q not a tensor": (with_q(lambda q: q.tolist()), TypeError, "q"),
    "kv_data not a dict": (lambda: (base()[0], [1], *base()[2:]), TypeError, "kv_data"),
    "fp8 missing": (lambda: (base()[0], {"bf16": base()[1]["bf16"]}, *base()[2:]), ValueError, "kv_data"),
    "fp8 kv bf16": (with_kv("fp8", lambda v: (v[0].to(torch.bfloat16), v[1])), ValueError,
                    "the FP8 cache (kv_data['fp8'][0]).dtype"),
    "fp8 kv 2 heads": (with_kv("fp8", lambda v: (v[0].expand(-1, 2, -1).contiguous(), v[1])), ValueError,
                       "the FP8 cache (kv_data['fp8'][0]).shape"),
    "fp8 kv strided": (with_kv("fp8", lambda v: (v[0].view(torch.uint8).repeat(2, 1, 1)[::2].view(v[0].dtype), v[1])),
                       ValueError, "the FP8 cache (kv_data['fp8'][0]): expected a contiguous tensor"),
    "fp8 kv not a tensor": (with_kv("fp8", lambda v: (v[0].tolist(), v[1])), TypeError,
                            "the FP8 cache (kv_data['fp8'][0]): expected a torch.Tensor"),
    "fp8 scale float64": (with_kv("fp8", lambda v: (v[0], v[1].double())), ValueError,
                          "the FP8 scale (kv_data['fp8'][1]).dtype"),
    "fp8 scale bf16": (with_kv("fp8", lambda v: (v[0], v[1].bfloat16())), ValueError,
                       "the FP8 scale (kv_data['fp8'][1]).dtype: expected torch.float32 (the plan's), got "
                       "torch.bfloat16"),
    "fp8 scale 2 values": (with_kv("fp8", lambda v: (v[0], v[1].repeat(2))), ValueError,
                           "the FP8 scale (kv_data['fp8'][1]).shape"),
    "fp8 scale not a tensor": (with_kv("fp8", lambda v: (v[0], 0.01)), TypeError,
                               "the FP8 scale (kv_data['fp8'][1]): expected a torch.Tensor, got float"),
    "fp8 not a pair": (with_kv("fp8", lambda v: v[0]), TypeError, "kv_data['fp8']"),
    "fp8 kv on another device": (with_kv("fp8", lambda v: (v[0].to("meta"), v[1])), ValueError,
                                 "the FP8 cache (kv_data['fp8'][0]): expected a tensor on cpu (q's device), got one "
                                 "on meta"),
    "fp8 scale on another device": (with_kv("fp8", lambda v: (v[0], v[1].to("meta"))), ValueError,
                                    "the FP8 scale (kv_data['fp8'][1]): expected a tensor on cpu (q's device), got "
                                    "one on meta"),
    "q on another device": (with_q(lambda q: q.to("meta")), ValueError,
                            "q and qo_indptr are on different devices (meta, cpu)"),
    "qo_indptr on another device": (with_indptr(qo_fn=lambda x: x.to("meta")), ValueError,
                                    "q and qo_indptr are on different devices (cpu, meta)"),
    "kv_indptr on another device": (with_indptr(kv_fn=lambda x: x.to("meta")), ValueError,
                                    "kv_indptr: expected a tensor on cpu (q's device), got one on meta"),
    "qo_indptr int64": (with_indptr(qo_fn=lambda x: x.long()), ValueError, "qo_indptr.dtype"),
    "kv_indptr int64": (with_indptr(kv_fn=lambda x: x.long()), ValueError, "kv_indptr.dtype"),
    "kv_indptr short": (with_indptr(kv_fn=lambda x: x[:-1].contiguous()), ValueError, "kv_indptr.shape"),
    "kv_indptr 2-D": (with_indptr(kv_fn=lambda x: x.reshape(1, -1)), ValueError, "kv_indptr.shape"),
    "config missing key": (with_config(sm_scale=KeyError), ValueError, "config"),
    "config batch_size": (with_config(batch_size=7), ValueError, "config['batch_size']"),
    "config num_heads": (with_config(num_heads=32), ValueError, "config['num_heads']"),
    "config q_seq_len 0": (with_config(q_seq_len=0), ValueError, "config['q_seq_len']"),
    "config q_seq_len 4, q of 1": (with_config(q_seq_len=4), ValueError, "q.shape[0]"),
    "config kv_seq_len str": (with_config(kv_seq_len="8"), TypeError, "config['kv_seq_len']"),
    "config sm_scale nan": (with_config(sm_scale=float("nan")), ValueError, "config['sm_scale']"),
    "config sm_scale tensor": (with_config(sm_scale=torch.tensor(0.04)), ValueError, "config['sm_scale']"),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_names_the_field(name):
    make, exc, field = BAD_INPUTS[name]
    S.custom_kernel(base())  # a good input of the same shapes first: its memoized signature must not mask the error
    with pytest.raises(exc) as info:
        S.custom_kernel(make())
    assert str(info.value).startswith(field), str(info.value)


def test_env_reads_what_os_environ_holds(monkeypatch):
    """submission._env (its cheap read of the environment) against os.environ, as it is set, changed and unset."""
    name = "MLA_TEST_SETTING"
    monkeypatch.delenv(name, raising=False)
    assert S._env(name) is None
    for value in ("fp8", "", "é/ü x"):
        monkeypatch.setenv(name, value)
        assert S._env(name) == os.environ.get(name) == value
    del os.environ[name]
    assert S._env(name) is None


def test_a_call_follows_the_settings_of_its_time(monkeypatch):
    """The decision for a kind of input is remembered; a setting changed since is a new kind, checked again."""
    data = R.generate_varlen_input([300, 257], seed=3, device=CPU)  # long enough for MXFP4 to pass the gate
    S.custom_kernel(data)
    monkeypatch.setenv("MLA_BACKEND", "rocm")
    with pytest.raises(ValueError, match="MLA_BACKEND"):
        S.custom_kernel(data)
    monkeypatch.setenv("MLA_BACKEND", "torch")
    monkeypatch.setenv("MLA_KV_FORMAT", "int4")
    with pytest.raises(ValueError, match="MLA_KV_FORMAT"):
        S.custom_kernel(data)
    monkeypatch.setenv("MLA_KV_FORMAT", "mxfp4")
    assert_matches(data, S.custom_kernel(data), fp32_attention(data, "mxfp4"), 4e-3)
    monkeypatch.delenv("MLA_BACKEND")
    monkeypatch.setattr(S, "DEFAULT_BACKEND", "cuda")
    with pytest.raises(RuntimeError, match="MLA_BACKEND=cuda"):
        S.custom_kernel(data)


def test_a_repeated_kind_of_input_is_validated_by_its_kind(monkeypatch):
    """What the remembered decision is keyed on covers every check: an input of the same kind but for one attribute
    (a view with other strides, another config value) is checked again, and each kind's memo stays bounded."""
    data = base()
    S.custom_kernel(data)
    q, kv, qo, kvp, config = clone(data)
    with pytest.raises(ValueError, match="^q: expected a contiguous tensor"):
        S.custom_kernel((q.transpose(1, 2).contiguous().transpose(1, 2), kv, qo, kvp, config))
    with pytest.raises(TypeError, match="^config\\['kv_seq_len'\\]"):
        S.custom_kernel((q, kv, qo, kvp, dict(config, kv_seq_len=6.0)))
    S.custom_kernel((q, kv, qo, kvp, dict(config, extra=[1])))  # an unhashable value: validated, not remembered
    monkeypatch.setattr(S, "DISPATCH_LIMIT", 2)
    for scale in (0.01, 0.02, 0.03):
        S.custom_kernel((q, kv, qo, kvp, dict(config, sm_scale=scale)))
        assert len(S._DISPATCH) <= 2


MXFP4_BAD = {
    "mxfp4 kv 576 wide": (lambda v: (v[0].view(torch.uint8).repeat(1, 1, 2), v[1]),
                          "the MXFP4 cache (kv_data['mxfp4'][0]).shape"),
    "mxfp4 kv fp8": (lambda v: (v[0].view(torch.float8_e4m3fn), v[1]), "the MXFP4 cache (kv_data['mxfp4'][0]).dtype"),
    "mxfp4 scales too few rows": (lambda v: (v[0], v[1][:3].contiguous()),
                                  "the MXFP4 block scales (kv_data['mxfp4'][1]): expected (>= 15, >= 18) E8M0"),
    "mxfp4 scales too few blocks": (lambda v: (v[0], v[1][:, :17].contiguous()),
                                    "the MXFP4 block scales (kv_data['mxfp4'][1]): expected (>= 15, >= 18) E8M0"),
    "mxfp4 scales float32": (lambda v: (v[0], v[1].view(torch.uint8).float()),
                             "the MXFP4 block scales (kv_data['mxfp4'][1]).dtype"),
    "mxfp4 kv on another device": (lambda v: (v[0].to("meta"), v[1]),
                                   "the MXFP4 cache (kv_data['mxfp4'][0]): expected a tensor on cpu (q's device), "
                                   "got one on meta"),
    "mxfp4 scales on another device": (lambda v: (v[0], v[1].to("meta")), "the MXFP4 block scales "
                                       "(kv_data['mxfp4'][1]): expected a tensor on cpu (q's device), got one on meta"),
    "mxfp4 scales blocks strided": (lambda v: (v[0], v[1].t().contiguous().t()),
                                    "the MXFP4 block scales (kv_data['mxfp4'][1]): expected (>= 15, >= 18) E8M0 "
                                    "block scales, unit stride along a row"),
}


@pytest.mark.parametrize("name", sorted(MXFP4_BAD))
def test_bad_mxfp4_input_names_the_field(monkeypatch, name):
    monkeypatch.setenv("MLA_KV_FORMAT", "mxfp4")
    fn, field = MXFP4_BAD[name]
    S.custom_kernel(base())  # memoizes the good signature, which must not mask the error
    with pytest.raises(ValueError) as info:
        S.custom_kernel(with_kv("mxfp4", fn)())
    assert str(info.value).startswith(field), str(info.value)


INDPTR_CONTENTS = {
    "kv first not 0": (lambda qo: qo, lambda kv: kv + 1, "kv_indptr[0]"),
    "kv decreasing": (lambda qo: qo, lambda kv: kv.flip(0).contiguous(), "kv_indptr"),
    "kv past the cache": (lambda qo: qo, lambda kv: kv * 2, "kv_indptr[-1]"),
    "qo not one query each": (lambda qo: qo * 2, lambda kv: kv, "qo_indptr"),
}


@pytest.mark.parametrize("name", sorted(INDPTR_CONTENTS))
def test_torch_backend_checks_indptr_contents(name):
    qo_fn, kv_fn, field = INDPTR_CONTENTS[name]
    with pytest.raises(ValueError) as info:
        S.custom_kernel(with_indptr(qo_fn, kv_fn)())
    assert str(info.value).startswith(field), str(info.value)


def test_kv_seq_len_below_the_longest_sequence_is_rejected():
    with pytest.raises(ValueError, match=r"config\['kv_seq_len'\]"):
        S.custom_kernel(with_config(kv_seq_len=5)())  # the longest sequence has 6 rows


def test_declared_uniform_batch_with_other_lengths_is_rejected():
    q, kv, qo, _, c = base()  # a 15-row cache
    kvp = torch.tensor([0, 5, 9, 14], dtype=torch.int32)  # lengths 5, 4, 5 and a spare row
    c["kv_seq_len"] = 5  # the maximum, but batch * 5 == total_kv declares every length 5
    with pytest.raises(ValueError, match="kv_indptr: expected every length"):
        S.custom_kernel((q, kv, qo, kvp, c))


def test_a_shorter_kv_indptr_than_the_cache_is_allowed():
    q, kv, qo, kvp, c = base()
    kvp = torch.tensor([0, 2, 3, 3], dtype=torch.int32)  # uses rows 0..2 of 15
    c["kv_seq_len"] = None
    data = (q, kv, qo, kvp, c)
    assert R.check_implementation(data, S.custom_kernel(clone(data)))[0]


# --- backend and format selection -------------------------------------------------------------------------


def test_auto_picks_torch_on_cpu(monkeypatch):
    monkeypatch.setenv("MLA_BACKEND", "auto")
    assert S.leaderboard_backend(CPU) == "torch"
    monkeypatch.delenv("MLA_BACKEND")
    assert S.leaderboard_backend(CPU) == "torch"


@pytest.mark.parametrize("value,exc,match", [
    ("rocm", ValueError, "MLA_BACKEND"),
    ("aiter", RuntimeError, "aiter"),
])
def test_forced_backend_fails_clearly(monkeypatch, value, exc, match):
    monkeypatch.setenv("MLA_BACKEND", value)
    monkeypatch.setitem(__import__("sys").modules, "aiter", None)  # make sure no aiter imports
    S.aiter_importable.cache_clear()
    with pytest.raises(exc, match=match):
        S.leaderboard_backend(CPU)
    S.aiter_importable.cache_clear()  # forget the probe made without aiter


def test_forced_triton_without_gpu_or_interpreter_fails(monkeypatch):
    monkeypatch.setenv("MLA_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="MLA_BACKEND=triton"):
        S.leaderboard_backend(CPU)


def test_bad_kv_format_fails_clearly(monkeypatch):
    monkeypatch.setenv("MLA_KV_FORMAT", "int4")
    with pytest.raises(ValueError, match="MLA_KV_FORMAT"):
        S.custom_kernel(base())


def test_the_defaults_apply_where_the_environment_sets_nothing(monkeypatch):
    """The leaderboard sets no environment variables: DEFAULT_BACKEND / DEFAULT_KV_FORMAT are what a submission
    edits; MLA_BACKEND / MLA_KV_FORMAT override them."""
    assert (S.DEFAULT_BACKEND, S.DEFAULT_KV_FORMAT) == ("auto", "fp8")
    monkeypatch.delenv("MLA_BACKEND")
    monkeypatch.setattr(S, "DEFAULT_BACKEND", "triton")
    monkeypatch.setattr(S, "DEFAULT_KV_FORMAT", "mxfp4")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert S.select_kv_format() == "mxfp4"
    if S.triton is not None:  # forced triton runs on the CPU under the interpreter
        assert S.leaderboard_backend(CPU) == "triton"
    monkeypatch.setenv("MLA_BACKEND", "torch")
    monkeypatch.setenv("MLA_KV_FORMAT", "fp8")
    assert (S.leaderboard_backend(CPU), S.select_kv_format()) == ("torch", "fp8")


@pytest.mark.parametrize("name,value", [("DEFAULT_BACKEND", "rocm"), ("DEFAULT_KV_FORMAT", "int4"),
                                        ("DEFAULT_PRECISION", "exact")])
def test_a_bad_default_is_named(monkeypatch, name, value):
    monkeypatch.delenv("MLA_BACKEND")
    monkeypatch.delenv("MLA_PRECISION", raising=False)
    monkeypatch.setattr(S, name, value)
    with pytest.raises(ValueError, match=f"^{name}: expected one of .*, got '{value}'$"):
        S.custom_kernel(base())


def test_precision_is_the_default_unless_mla_precision_says_otherwise(monkeypatch):
    monkeypatch.delenv("MLA_PRECISION", raising=False)
    assert S.select_precision() == S.DEFAULT_PRECISION == "fast"
    monkeypatch.setenv("MLA_PRECISION", "precise")
    assert S.select_precision() == "precise"
    monkeypatch.setenv("MLA_PRECISION", "exact")
    with pytest.raises(ValueError, match="^MLA_PRECISION: expected one of .*, got 'exact'$"):
        S.custom_kernel(base())


def test_the_torch_backend_is_the_same_in_both_precisions(monkeypatch):
    data = base()
    monkeypatch.setenv("MLA_PRECISION", "fast")
    fast = S.custom_kernel(data)
    monkeypatch.setenv("MLA_PRECISION", "precise")
    assert torch.equal(S.custom_kernel(data), fast)


def test_the_leaderboard_file_never_says_stream():
    """The leaderboard's server refuses an upload containing that word in any case (code for it lives in the
    mla_decode_cuda package)."""
    assert "stream" not in Path(S.__file__).read_text().lower()


def test_the_leaderboard_file_alone_keys_workspaces_by_thread(monkeypatch):
    """Where the mla_decode package is not installed (the leaderboard file alone), a plan's workspaces are keyed by
    thread alone: the per-queue handle lives in mla_decode.device_queue, kept out of the file; with the package,
    caller_key takes it from there."""
    import mla_decode.device_queue

    assert S._queue_handle() is mla_decode.device_queue.current_handle
    monkeypatch.setitem(sys.modules, "mla_decode.device_queue", None)  # its import then raises ImportError
    S._queue_handle.cache_clear()
    try:
        assert S._queue_handle() is None
        assert S.caller_key(torch.device("cuda", 0)) == (threading.get_ident(), 0)
    finally:
        S._queue_handle.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("backend", ["auto", "triton", "torch"])
def test_gpu_inputs_on_another_gpu_than_the_current_one(monkeypatch, backend):
    """Inputs on cuda:1 while cuda:0 is current: the launches (ctypes, Triton) follow the inputs' device, and the
    output is the one computed with cuda:1 current."""
    monkeypatch.setenv("MLA_BACKEND", backend)
    data = R.generate_varlen_input([700, 3, 1, 2000], seed=11, device=torch.device("cuda:1"))
    with torch.cuda.device(1):
        want = S.custom_kernel(data)
    with torch.cuda.device(0):
        out = S.custom_kernel(data)
    assert out.device == torch.device("cuda:1") and torch.equal(out, want)
    assert R.check_implementation(data, out)[0]
