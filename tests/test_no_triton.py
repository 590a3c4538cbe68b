"""Where Triton is not installed: `import mla_decode` works, the torch backend decodes, and the triton backend says it
cannot serve, naming the import. Run in a child process whose `import triton` raises ImportError (sys.modules holds
None for it), since this one has Triton imported already."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import sys
sys.modules["triton"] = None  # `import triton` and `import triton.<anything>` raise ImportError from here on

import mla_decode
from mla_decode.backends import BackendUnavailable, select_backend
from testkit.paged import errors, make_paged_case, paged_reference

case = make_paged_case("fp8", 16, [0, 1, 77], seed=3)
out, lse = mla_decode.mla_decode_with_kvcache(*case.args(), backend="torch")
out_error, lse_error = errors(out, lse, *paged_reference(case))
assert out_error < 5e-3 and lse_error < 1e-4, (out_error, lse_error)

problem = mla_decode.api.make_problem(3, case.kv_cache.dtype, "cpu", layout="paged", page_size=16,
                                      max_pages=case.block_table.shape[1])
try:
    select_backend(problem, "triton")
except BackendUnavailable as e:
    reason = e.reason
else:
    raise AssertionError("the triton backend was selected without triton")
assert "triton" in reason and "import" in reason, reason
assert select_backend(problem).backend == "torch"

import submission  # the leaderboard file imports without Triton too
assert submission.triton is None
print("no-triton: ok")
"""


def test_mla_decode_imports_and_decodes_without_triton():
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "no-triton: ok" in done.stdout, done.stdout + done.stderr
