"""Tests import the top-level modules (task, reference, utils, submission, eval) by name, as the harness does."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


import pytest  # noqa: E402


@pytest.fixture
def standin(monkeypatch):
    """install(version, **kwargs) puts a stand-in aiter (tests/aiter_standin.py) in sys.modules for this test; the
    aiter backend's caches start empty, MLA_BACKEND=aiter, and no MLA_KV_FORMAT, MLA_VALIDATE or MLA_AITER_VARIANT."""
    from aiter_standin import StandinAiter

    import submission

    monkeypatch.setenv("MLA_BACKEND", "aiter")
    for name in ("MLA_KV_FORMAT", "MLA_VALIDATE", "MLA_AITER_VARIANT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(submission, "_AITER_PLANS", {})
    monkeypatch.setattr(submission, "_AITER_VERDICTS", {})
    monkeypatch.setattr(submission, "_DISPATCH", {})  # its decisions hold the aiter functions of their time
    submission._aiter_importable.cache_clear()  # the import probe is cached per process; each test installs its own

    def install(version="RUNNER", **kwargs) -> StandinAiter:
        return StandinAiter(version, **kwargs).install(monkeypatch)

    return install
