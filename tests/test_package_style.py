"""What the package promises of its own source: every public function typed, and no comment or docstring that quotes
a timing (measurements live in docs/, where they can be dated). Each check is shown to catch a planted case."""

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mla_decode"
TIMING = re.compile(r"\d(\.\d+)?\s*(us|µs|ms|ns)\b|\d\s*[GT]B/s|TFLOP")


def untyped(source: str) -> list[str]:
    """The public functions and methods of a module (top level and public classes) missing an argument or return
    annotation (self, cls and __init__'s return excepted)."""
    found = []

    def check(fn: ast.FunctionDef, where: str) -> None:
        args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
        missing = [a.arg for a in args if a.annotation is None and a.arg not in ("self", "cls")]
        missing += [f"*{a.arg}" for a in (fn.args.vararg, fn.args.kwarg) if a is not None and a.annotation is None]
        if missing or (fn.returns is None and fn.name != "__init__"):
            found.append(f"{where}{fn.name}{missing if missing else ' (return)'}")

    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            check(node, "")
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for method in node.body:
                if isinstance(method, ast.FunctionDef) and (not method.name.startswith("_")
                                                            or method.name in ("__init__", "__call__")):
                    check(method, f"{node.name}.")
    return found


def quoted_timings(source: str) -> list[str]:
    """Comments and docstrings (string statements) that quote a timing, a bandwidth or a throughput."""
    found = [tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT and TIMING.search(tok.string)]
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            found += [s.value.value for s in body if isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                      and isinstance(s.value.value, str) and TIMING.search(s.value.value)]
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))
KERNEL_SOURCES = sorted([*PACKAGE.rglob("*.cu"), *PACKAGE.rglob("*.cuh")])


def quoted_timings_in_kernel(source: str) -> list[str]:
    """The // comments of a CUDA source that quote a timing, a bandwidth or a throughput."""
    return [line.strip() for line in source.splitlines() if "//" in line and TIMING.search(line.split("//", 1)[1])]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_public_functions_are_typed(path):
    assert untyped(path.read_text()) == []


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_comment_quotes_a_timing(path):
    assert quoted_timings(path.read_text()) == []


@pytest.mark.parametrize("path", KERNEL_SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_kernel_comment_quotes_a_timing(path):
    assert quoted_timings_in_kernel(path.read_text()) == []


def test_the_checks_catch_planted_cases():
    assert untyped("def f(x) -> int:\n    return x\n") == ["f['x']"]
    assert untyped("class C:\n    def run(self, y: int):\n        pass\n") == ["C.run (return)"]
    assert untyped("def _private(x):\n    pass\n") == []
    assert quoted_timings("x = 1  # took 4.5 us on the H200\n") == ["# took 4.5 us on the H200"]
    assert quoted_timings('def f() -> None:\n    """Reads 3,000 GB/s."""\n') == ["Reads 3,000 GB/s."]
    assert quoted_timings('label = "us"  # the unit\n') == []
    assert quoted_timings_in_kernel("int x;  // 4x8192 took 18.7 us\n") == ["int x;  // 4x8192 took 18.7 us"]
    assert quoted_timings_in_kernel('printf("%d us");  // the unit\n') == []
