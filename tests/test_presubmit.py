"""tools/presubmit.py on fixture files written here: a small honest submission passes every gate, and each defect
fails the gate that names it, with a nonzero exit. The runs-alone gate is shown to block this repo's modules
(importable here through the editable install) and to reject a zero output; the real submission.py passes every
gate but no-stream, which another branch settles."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "presubmit.py"
_spec = importlib.util.spec_from_file_location("presubmit", SCRIPT)
presubmit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(presubmit)

HEADER = "#!POPCORN leaderboard amd-mixed-mla\n#!POPCORN gpu MI355X\n"
# fp32 attention over the dequantized FP8 cache: what the torch backend computes, written with torch and task only.
BODY = '''"""A minimal honest submission."""

import torch

from task import input_t, output_t


def custom_kernel(data: input_t) -> output_t:
    q, kv_data, _, kv_indptr, config = data
    kv_fp8, scale = kv_data["fp8"]
    kv = kv_fp8.float() * scale
    ends = kv_indptr.tolist()
    out = torch.zeros(q.shape[0], 16, 512)
    for b in range(q.shape[0]):
        keys = kv[ends[b]:ends[b + 1], 0]
        probs = torch.softmax(q[b].float() @ keys.T * config["sm_scale"], dim=-1)
        out[b] = probs @ keys[:, :512]
    return out.to(torch.bfloat16)
'''
GOOD = HEADER + BODY
STATIC_GATES = ("utf8", "size", "no-stream", "popcorn", "imports")


def write(tmp_path: Path, text: str, name: str = "candidate.py") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def run_cli(path: Path, gates: tuple[str, ...] = ()) -> tuple[int, dict[str, str], str]:
    """Exit status, {gate: PASS/FAIL/SKIP} and stdout of the checker run as a user runs it."""
    args = [arg for gate in gates for arg in ("--gate", gate)]
    proc = subprocess.run([sys.executable, str(SCRIPT), str(path), *args], capture_output=True, text=True,
                          timeout=600)
    status = {line.split()[1].rstrip(":"): line.split()[0] for line in proc.stdout.splitlines()
              if line.split()[:1] in (["PASS"], ["FAIL"], ["SKIP"])}
    return proc.returncode, status, proc.stdout + proc.stderr


def test_good_file_passes_every_gate(tmp_path):
    rc, status, out = run_cli(write(tmp_path, GOOD))
    assert rc == 0, out
    assert status == dict.fromkeys(presubmit.GATES, "PASS"), out
    assert "fp32 attention over the fp8 cache" in out
    assert "all gates passed" in out


@pytest.mark.parametrize("text, gate, hint", [
    (GOOD.replace("A minimal", "A Stream-free minimal"), "no-stream", '3:6: """A Stream-free minimal'),
    (GOOD + "# " + "x" * presubmit.MAX_BYTES + "\n", "size", "> 1,000,000"),
    (BODY, "popcorn", "expected '#!POPCORN leaderboard amd-mixed-mla'"),
    (GOOD.replace("#!POPCORN gpu MI355X", "#!POPCORN gpu MI300X"), "popcorn", "found '#!POPCORN gpu MI300X'"),
], ids=["stream-comment", "over-size", "no-popcorn", "wrong-gpu"])
def test_static_defect_fails_its_gate_only(tmp_path, text, gate, hint):
    rc, status, out = run_cli(write(tmp_path, text), STATIC_GATES)
    assert rc == 1, out
    assert status == {g: "FAIL" if g == gate else "PASS" for g in STATIC_GATES}, out
    assert hint in out
    assert f"FAILED ({gate})" in out


def test_unguarded_repo_import_fails_imports_and_runs_alone(tmp_path):
    text = GOOD.replace("import torch\n", "import torch\n\nimport reference  # noqa: F401\n")
    rc, status, out = run_cli(write(tmp_path, text), ("imports", "runs-alone"))
    assert rc == 1, out
    # runs-alone fails too although reference is importable here (editable install, tests' sys.path): blocked.
    assert status == {"imports": "FAIL", "runs-alone": "FAIL"}, out
    assert "line 7: `import reference`: this repo's own module" in out
    assert "No module named 'reference'" in out


def test_guarded_repo_import_passes(tmp_path):
    text = GOOD.replace("import torch\n", "import torch\n\ntry:\n    import reference\nexcept ImportError:  # absent "
                        "on the leaderboard\n    reference = None\n")
    results = presubmit.run_checks(write(tmp_path, text), ("imports", "runs-alone"))
    assert [(r.name, r.ok) for r in results] == [("imports", True), ("runs-alone", True)], results


def test_zero_output_fails_runs_alone(tmp_path):
    text = GOOD.replace("return out.to(torch.bfloat16)", "return torch.zeros_like(out).to(torch.bfloat16)")
    (result,) = presubmit.run_checks(write(tmp_path, text), ("runs-alone",))
    assert result.ok is False
    assert "not an fp32 attention over any KV cache" in "\n".join(result.details), result


def test_a_one_percent_sm_scale_error_fails_runs_alone(tmp_path):
    text = GOOD.replace('* config["sm_scale"]', '* config["sm_scale"] * 1.01')
    assert text != GOOD
    (result,) = presubmit.run_checks(write(tmp_path, text), ("runs-alone",))
    assert result.ok is False, result


@pytest.mark.parametrize("snippet, guarded", [
    ("import numpy", False),
    ("from . import helpers", False),
    ("from __future__ import annotations\nimport json\nimport triton.language as tl\nimport aiter.mla", True),
    ("try:\n    import numpy\nexcept (ValueError, ImportError):\n    numpy = None", True),
    ("try:\n    import numpy\nexcept ModuleNotFoundError:\n    numpy = None", True),
    ("try:\n    import numpy\nexcept:\n    numpy = None", True),
    ("try:\n    import numpy\nexcept ValueError:\n    numpy = None", False),
    ("try:\n    pass\nexcept ImportError:\n    import numpy", False),
    ("def f():\n    import utils", False),
    ("def f():\n    try:\n        import utils\n    except Exception:\n        return None", True),
    ("try:\n    def f():\n        import utils\nexcept ImportError:\n    pass", False),
    ("import importlib\nmod = importlib.import_module('utils')", False),
    ("mod = __import__('reference')", False),
], ids=["numpy", "relative", "allowed", "tuple-handler", "subclass-handler", "bare-except", "wrong-handler",
        "in-handler", "lazy", "lazy-guarded", "lazy-in-guarded-def", "import_module", "dunder-import"])
def test_import_rules(snippet, guarded):
    result = presubmit.check_imports(HEADER + snippet + "\n")
    assert result.ok is guarded, result.render()
    if not guarded:
        assert result.details and result.details[0].startswith("line "), result.render()


def test_kernelguard_flags_a_timer_patch():
    result = presubmit.check_kernelguard(GOOD + "\ntorch.cuda.Event.elapsed_time = lambda self, end: 1e-3\n")
    assert result.ok is False
    assert "TIMER_MONKEYPATCH" in result.render()


def test_kernelguard_missing_says_how_to_install(monkeypatch):
    monkeypatch.setattr(presubmit.importlib.util, "find_spec", lambda name: None)
    result = presubmit.check_kernelguard(GOOD)
    assert result.ok is False
    assert "pip install kernelguard==0.3.1" in result.summary


def test_non_utf8_fails_and_skips_the_text_gates(tmp_path):
    path = tmp_path / "latin1.py"
    path.write_bytes(GOOD.encode() + "# caf\xe9\n".encode("latin-1"))
    rc, status, out = run_cli(path, STATIC_GATES)
    assert rc == 1, out
    assert status == {"utf8": "FAIL", "size": "PASS", "no-stream": "SKIP", "popcorn": "SKIP", "imports": "SKIP"}


def test_real_submission_passes_every_gate():
    results = presubmit.run_checks(ROOT / "submission.py")
    assert [r.name for r in results] == list(presubmit.GATES)
    failed = {r.name: r.render() for r in results if r.ok is not True}
    assert not failed, failed
