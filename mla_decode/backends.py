"""The backend registry: one record per backend, in auto's order of preference. select_backend, the api's plans,
the leaderboard adapter and `python -m mla_decode` read these records and nothing else, so the library and
custom_kernel choose alike. Adding a backend is its module and one record here. Settings come in as arguments."""

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from .aiter_backend import AiterDecode, aiter_auto_reason, aiter_unusable_reason
from .contract import Problem, expect_choice, log
from .torch_backend import TorchDecode, torch_unusable_reason
from .triton import TritonDecode, triton_unusable_reason

CUDA_PACKAGE_MISSING = ("cuda backend: the mla_decode.cuda package is not importable: install this repo "
                        "(pip install -e .) for the CUDA kernels")


@functools.cache
def cuda_package() -> tuple[object, str | None]:
    """(the mla_decode.cuda module, None), or (None, why it cannot be imported): imported the first time the backend
    is considered. The leaderboard file alone has no such package: NVIDIA GPUs then get the triton backend."""
    try:
        import mla_decode.cuda as package
    except ImportError as e:
        if e.name in ("mla_decode", "mla_decode.cuda"):
            return None, CUDA_PACKAGE_MISSING
        return None, f"cuda backend: the mla_decode.cuda package failed to import: {e}"
    return package, None


def cuda_unusable_reason(problem: Problem) -> str | None:
    """None when the cuda backend serves `problem` (mla_decode.cuda.cuda_unusable_reason), else why not (the
    package's absence included)."""
    package, missing = cuda_package()
    return missing if package is None else package.cuda_unusable_reason(problem)


def on_rocm(device: torch.device) -> bool:
    return device.type == "cuda" and torch.version.hip is not None


def on_nvidia(device: torch.device) -> bool:
    return device.type == "cuda" and torch.version.hip is None


@functools.cache
def cuda_auto_reason(problem: Problem) -> str | None:
    """cuda_unusable_reason, cached (auto asks it for every new problem; a failed build is not retried), and logged
    as a warning where an NVIDIA GPU cannot have the cuda backend at all (no package, no nvcc): the triton backend
    runs there instead."""
    reason = cuda_unusable_reason(problem)
    plainest = problem._replace(q_len=1, num_heads=16, kv_format="fp8", kv_dtype=torch.float8_e4m3fn,
                                scale_dtype=torch.float32, precision="fast")  # what every cuda build serves
    if reason is not None and on_nvidia(problem.device) and cuda_unusable_reason(plainest) is not None:
        log.warning("MLA decode: using the triton backend, not cuda: %s", reason)
    return reason


def cuda_decode(problem: Problem, **options: object) -> object:
    """The cuda backend's plan (mla_decode.cuda.CudaDecode), imported where it is first made."""
    return cuda_package()[0].CudaDecode(problem, **options)


class Backend(NamedTuple):
    """One backend: where auto considers it, why it cannot serve a problem, its plan and the options that plan takes.
    A plan is made as make_plan(problem, **options) and runs as plan.run(q, kv, scale, seqs, table, out, lse)."""

    name: str
    considered_on: Callable[[torch.device], bool]  # whether auto considers it on a device
    unusable_reason: Callable[[Problem], str | None]  # asked for by name: None when it serves the problem
    auto_reason: Callable[[Problem], str | None]  # auto's verdict: the above, and what auto avoids besides
    make_plan: Callable[..., object]
    options: tuple[str, ...]  # the keyword arguments make_plan takes after the problem (backend_options)


# auto's order of preference: the first that auto considers on the device and that can serve the problem wins.
BACKEND_REGISTRY = (
    Backend("aiter", on_rocm, aiter_unusable_reason, aiter_auto_reason, AiterDecode, ("variant", "kv_seq_len")),
    Backend("cuda", on_nvidia, cuda_unusable_reason, cuda_auto_reason, cuda_decode,
            ("unit_rows", "schedule", "min_share", "cut", "slack")),
    Backend("triton", lambda device: device.type == "cuda", triton_unusable_reason, triton_unusable_reason,
            TritonDecode, ("target", "plan", "schedule", "min_share")),
    Backend("torch", lambda device: True, torch_unusable_reason, torch_unusable_reason, TorchDecode, ()),
)
BACKENDS = tuple(backend.name for backend in BACKEND_REGISTRY)
BACKEND_CHOICES = BACKENDS + ("auto",)


class BackendUnavailable(RuntimeError):
    """A backend asked for by name cannot serve the problem; .backend and .reason say which and why."""

    def __init__(self, backend: str, reason: str):
        super().__init__(f"backend={backend!r}: {reason}")
        self.backend, self.reason = backend, reason


class Selection(NamedTuple):
    record: Backend
    passed_over: tuple[str, ...]  # "name: reason" of each backend auto considered first and passed over

    @property
    def backend(self) -> str:
        return self.record.name


_ANNOUNCED: set = set()  # (device, asked, chosen, format, precision) already logged


def select_backend(problem: Problem, backend: str = "auto") -> Selection:
    """`backend` by name (BackendUnavailable, a RuntimeError, saying why where it cannot serve the problem), or for
    "auto" the first record of BACKEND_REGISTRY that is considered on the device and can; the choice and what auto
    passed over are logged once per kind."""
    expect_choice(backend, "backend", BACKEND_CHOICES)
    passed_over = []
    for record in BACKEND_REGISTRY:
        if backend == record.name:
            reason = record.unusable_reason(problem)
            if reason is not None:
                raise BackendUnavailable(backend, reason)
            break
        if backend == "auto" and record.considered_on(problem.device):
            reason = record.auto_reason(problem)
            if reason is None:
                break
            passed_over.append(f"{record.name}: {reason}")
    announced = (problem.device, backend, record.name, problem.kv_format, problem.precision)
    if announced not in _ANNOUNCED:
        _ANNOUNCED.add(announced)
        skipped = "; passed over: " + "; ".join(passed_over) if passed_over else ""
        log.info("MLA decode on %s: %s backend (asked: %s, %s cache, %s)%s", problem.device, record.name, backend,
                 problem.kv_format, problem.precision, skipped)
    return Selection(record, tuple(passed_over))


def make_backend_plan(record: Backend, problem: Problem, options: dict) -> object:
    """The record's plan for `problem`, after checking that `options` are ones it takes (auto may have picked
    another backend than the options were written for)."""
    unknown = sorted(set(options) - set(record.options))
    if unknown:
        raise ValueError(f"backend_options: the {record.name} backend takes {list(record.options) or 'none'}, not "
                         f"{unknown}")
    return record.make_plan(problem, **options)
