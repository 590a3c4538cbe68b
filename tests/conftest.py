"""Tests import the top-level modules (task, reference, utils, submission, eval) by name, as the harness does.

On a machine without a GPU the Triton kernels run under Triton's interpreter in this process: TRITON_INTERPRET=1
must be set before triton is first imported (its language helpers are interpreted or compiled at import), so it is
set here, with tests/triton_interpreter.py's patch. A GPU machine runs them compiled, behind the `gpu` marker."""

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRETED:
    try:
        import triton_interpreter
    except ImportError:  # no triton: the tests that need it say so
        pass
    else:
        triton_interpreter.patch()

import pytest  # noqa: E402


@pytest.fixture
def standin(monkeypatch):
    """install(version, **kwargs) puts a stand-in aiter (tests/aiter_standin.py) in sys.modules for this test; the
    aiter backend's caches start empty, in submission.py and in the mla_decode package alike (two module objects:
    the leaderboard file's and the library's), MLA_BACKEND=aiter, and no MLA_KV_FORMAT, MLA_VALIDATE or
    MLA_AITER_VARIANT. The cached import probes are cleared again afterwards: a later test sees no aiter."""
    from aiter_standin import StandinAiter

    import mla_decode.aiter_backend
    import mla_decode.api
    import submission

    monkeypatch.setenv("MLA_BACKEND", "aiter")
    for name in ("MLA_KV_FORMAT", "MLA_VALIDATE", "MLA_AITER_VARIANT"):
        monkeypatch.delenv(name, raising=False)
    for module in (submission, mla_decode.aiter_backend):
        monkeypatch.setattr(module, "_AITER_PLANS", {})
        monkeypatch.setattr(module, "_AITER_VERDICTS", {})
    monkeypatch.setattr(submission, "_DISPATCH", {})  # its decisions hold the aiter functions of their time
    monkeypatch.setattr(mla_decode.api, "_PLANS", {})  # the library's one-shot plans, likewise
    probes = (submission.aiter_importable, mla_decode.aiter_backend.aiter_importable)
    for probe in probes:  # the import probe is cached per process; each test installs its own
        probe.cache_clear()

    def install(version="RUNNER", **kwargs) -> StandinAiter:
        return StandinAiter(version, **kwargs).install(monkeypatch)

    yield install
    for probe in probes:
        probe.cache_clear()
