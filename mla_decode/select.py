"""Which backend serves a problem: each backend says why it cannot (or None), and `auto` takes the first of an
ordered preference that is considered on the device and can. Settings come in as arguments only."""

import functools
from typing import NamedTuple

import torch

from .aiter_backend import aiter_auto_reason, aiter_unusable_reason
from .contract import BACKEND_CHOICES, Problem, expect_choice, log
from .torch_backend import torch_unusable_reason
from .triton import triton_unusable_reason

CUDA_PACKAGE_MISSING = ("cuda backend: the mla_decode.cuda package is not importable: install this repo "
                        "(pip install -e .) for the CUDA kernels")


@functools.cache
def cuda_package():
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
    """None when the cuda backend serves `problem` (mla_decode.cuda.cuda_unusable_reason: an NVIDIA GPU of capability
    >= 8.0 whose kernels build with the machine's nvcc; MXFP4 only on Hopper, in the fast mode), else why not (the
    package's absence included)."""
    package, missing = cuda_package()
    return missing if package is None else package.cuda_unusable_reason(problem)


@functools.cache
def _cuda_reason_for_auto(problem: Problem) -> str | None:
    """cuda_unusable_reason, cached (auto asks it for every new problem), and logged as a warning where an NVIDIA GPU
    cannot have the cuda backend at all (no package, no nvcc): the triton backend runs there instead."""
    reason = cuda_unusable_reason(problem)
    plainest = problem._replace(q_len=1, num_heads=16, kv_format="fp8", kv_dtype=torch.float8_e4m3fn,
                                scale_dtype=torch.float32, precision="fast")  # what every cuda build serves
    if reason is not None and _on_nvidia(problem.device) and cuda_unusable_reason(plainest) is not None:
        log.warning("MLA decode: using the triton backend, not cuda: %s", reason)
    return reason


def _on_rocm(device: torch.device) -> bool:
    return device.type == "cuda" and torch.version.hip is not None


def _on_nvidia(device: torch.device) -> bool:
    return device.type == "cuda" and torch.version.hip is None


class BackendChoice(NamedTuple):
    """One backend as select_backend weighs it."""

    name: str
    unusable_reason: object  # problem -> None when it serves the problem, else why not
    auto_on: object  # device -> whether auto considers it on that device
    forced_reason: object = None  # unusable_reason when asked for by name, where it differs (cuda: not cached; aiter:
    # no grid check)


# auto's order of preference: the first that auto considers on the device and that can serve the problem wins.
BACKEND_PREFERENCE = (
    BackendChoice("aiter", aiter_auto_reason, _on_rocm, aiter_unusable_reason),
    BackendChoice("cuda", _cuda_reason_for_auto, _on_nvidia, cuda_unusable_reason),
    BackendChoice("triton", triton_unusable_reason, lambda device: device.type == "cuda"),
    BackendChoice("torch", torch_unusable_reason, lambda device: True),
)


class BackendUnavailable(RuntimeError):
    """A backend asked for by name cannot serve the problem; .backend and .reason say which and why."""

    def __init__(self, backend: str, reason: str):
        super().__init__(f"backend={backend!r}: {reason}")
        self.backend, self.reason = backend, reason


class Selection(NamedTuple):
    backend: str
    passed_over: tuple[str, ...]  # "name: reason" of each backend auto considered first and passed over


_ANNOUNCED: set = set()  # (device, asked, chosen, format, precision) already logged


def select_backend(problem: Problem, backend: str = "auto") -> Selection:
    """`backend` by name (BackendUnavailable, a RuntimeError, saying why where it cannot serve the problem), or for
    "auto" the first of BACKEND_PREFERENCE that is considered on the device and can; the choice and what auto passed
    over are logged once per kind."""
    expect_choice(backend, "backend", BACKEND_CHOICES)
    passed_over = []
    for choice in BACKEND_PREFERENCE:
        if backend == choice.name:
            reason = (choice.forced_reason or choice.unusable_reason)(problem)
            if reason is not None:
                raise BackendUnavailable(backend, reason)
            break
        if backend == "auto" and choice.auto_on(problem.device):
            reason = choice.unusable_reason(problem)
            if reason is None:
                break
            passed_over.append(f"{choice.name}: {reason}")
    announced = (problem.device, backend, choice.name, problem.kv_format, problem.precision)
    if announced not in _ANNOUNCED:
        _ANNOUNCED.add(announced)
        skipped = "; passed over: " + "; ".join(passed_over) if passed_over else ""
        log.info("MLA decode on %s: %s backend (asked: %s, %s cache, %s)%s", problem.device, choice.name, backend,
                 problem.kv_format, problem.precision, skipped)
    return Selection(choice.name, tuple(passed_over))
