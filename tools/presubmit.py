"""Pre-submit check of the exact file the amd-mixed-mla leaderboard would receive.

Usage:
  make presubmit                    # checks submission.py
  make presubmit FILE=other.py      # checks any file
  python tools/presubmit.py [path] [--gate NAME ...]   # path defaults to submission.py; --gate runs only those
Gates, each printed PASS or FAIL (with what to change) on its own line; exit status 0 only when all pass:
  utf8, size (<= 1,000,000 bytes), no-stream (the server refuses the word in any case), popcorn (the two header
  lines), imports (outside stdlib/torch/triton/aiter/task only inside `try: ... except ImportError`), runs-alone
  (the file alone beside task.py, in an isolated Python that cannot see this repo, runs custom_kernel on the CPU
  torch backend against an fp32 attention), kernelguard (the leaderboard's scanner, default and strict profiles).
"""

import argparse
import ast
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DRIVER = Path(__file__).resolve().parent / "presubmit_driver.py"
MAX_BYTES = 1_000_000
POPCORN_LINES = ("#!POPCORN leaderboard amd-mixed-mla", "#!POPCORN gpu MI355X")
# What the leaderboard's runner can import besides the standard library; "task" is the runner's own task.py.
ALLOWED_MODULES = frozenset({"torch", "triton", "aiter", "task"})
# Handlers that catch ImportError (a bare `except:` too): an import under one of them degrades when absent.
IMPORT_ERROR_CATCHERS = frozenset({"ImportError", "ModuleNotFoundError", "Exception", "BaseException"})
KERNELGUARD_VERSION = "0.3.1"  # the version gpu-mode/kernelbot pins
KERNELGUARD_PROFILES = ("default", "strict")
RUNS_ALONE_TIMEOUT_S = 600
GATES = ("utf8", "size", "no-stream", "popcorn", "imports", "runs-alone", "kernelguard")


@dataclass
class GateResult:
    name: str
    ok: bool | None  # None: skipped, because the file is not text
    summary: str
    details: list[str] = field(default_factory=list)

    def render(self) -> str:
        status = {True: "PASS", False: "FAIL", None: "SKIP"}[self.ok]
        return "\n".join([f"{status} {self.name}: {self.summary}", *(f"    {d}" for d in self.details)])


def repo_module_names() -> frozenset[str]:
    """Top-level names this repo could supply on sys.path (its flat modules and folders), except the two the
    leaderboard provides itself."""
    names = {p.stem for p in REPO.glob("*.py")}
    names |= {p.name for p in REPO.iterdir() if p.is_dir() and p.name.isidentifier() and p.name != "__pycache__"}
    return frozenset(names - {"submission", "task"} - ALLOWED_MODULES - sys.stdlib_module_names)


def check_utf8(raw: bytes) -> tuple[GateResult, str | None]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return GateResult("utf8", False, f"byte {e.start} is not UTF-8 ({e.reason}): save the file as UTF-8"), None
    return GateResult("utf8", True, "decodes as UTF-8"), text


def check_size(raw: bytes) -> GateResult:
    size = len(raw)
    if size > MAX_BYTES:
        return GateResult("size", False, f"{size:,} bytes > {MAX_BYTES:,}: cut {size - MAX_BYTES:,} bytes")
    return GateResult("size", True, f"{size:,} bytes <= {MAX_BYTES:,}")


def check_no_stream(text: str) -> GateResult:
    hits = [f"{n}:{m.start() + 1}: {line.rstrip()}" for n, line in enumerate(text.split("\n"), 1)
            for m in re.finditer("stream", line, re.IGNORECASE)]
    if hits:
        return GateResult("no-stream", False, f"{len(hits)} occurrence(s) of 'stream' (any case; the server refuses "
                          "the file, comments included): reword or remove each", hits)
    return GateResult("no-stream", True, "no 'stream' in any case")


def check_popcorn(text: str) -> GateResult:
    found = (text.split("\n") + ["", ""])[:2]
    bad = [f"line {i}: expected {want!r}, found {got!r}"
           for i, (want, got) in enumerate(zip(POPCORN_LINES, found, strict=True), 1) if got != want]
    if bad:
        return GateResult("popcorn", False, "the first two lines must be the POPCORN headers exactly", bad)
    return GateResult("popcorn", True, "first two lines are the POPCORN headers")


def _catches_import_error(handler_type: ast.expr | None) -> bool:
    if handler_type is None:
        return True
    if isinstance(handler_type, ast.Tuple):
        return any(_catches_import_error(e) for e in handler_type.elts)
    if isinstance(handler_type, ast.Name):
        return handler_type.id in IMPORT_ERROR_CATCHERS
    return isinstance(handler_type, ast.Attribute) and handler_type.attr in IMPORT_ERROR_CATCHERS


class _ImportScanner(ast.NodeVisitor):
    """Collects (line, statement, module) of every import of a module outside the allowed set that is not
    inside the body of a try whose handlers catch ImportError, including dynamic __import__/import_module calls
    with a literal name. A function body runs later, outside any try around its definition, so it starts
    unguarded."""

    def __init__(self, source: str):
        self.source = source
        self.guarded = False
        self.offending: list[tuple[int, str, str]] = []

    def _check(self, node: ast.AST, module: str) -> None:
        top = module.split(".")[0]
        if not self.guarded and not (top in ALLOWED_MODULES or top in sys.stdlib_module_names):
            self.offending.append((node.lineno, ast.get_source_segment(self.source, node) or module, module))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._check(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        # A relative import has no package to resolve against: the file is uploaded alone.
        self._check(node, "." * node.level + (node.module or "") if node.level else node.module)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        dynamic = (isinstance(func, ast.Name) and func.id == "__import__") or (
            isinstance(func, ast.Attribute) and func.attr == "import_module")
        if dynamic and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            self._check(node, node.args[0].value)
        self.generic_visit(node)

    def visit_Try(self, node: ast.Try) -> None:
        outer = self.guarded
        self.guarded = outer or any(_catches_import_error(h.type) for h in node.handlers)
        for stmt in node.body:
            self.visit(stmt)
        self.guarded = outer
        for stmt in [*node.handlers, *node.orelse, *node.finalbody]:
            self.visit(stmt)

    visit_TryStar = visit_Try

    def _new_scope(self, node: ast.AST) -> None:
        outer, self.guarded = self.guarded, False
        self.generic_visit(node)
        self.guarded = outer

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _new_scope


def check_imports(text: str) -> GateResult:
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        return GateResult("imports", False, f"does not parse: line {e.lineno}: {e.msg}: fix the syntax")
    scanner = _ImportScanner(text)
    scanner.visit(tree)
    if not scanner.offending:
        return GateResult("imports", True, "stdlib, torch, triton, aiter and task only, others inside try/except "
                          "ImportError")
    own = repo_module_names()
    details = []
    for line, stmt, module in scanner.offending:
        top = module.split(".")[0]
        why = ("this repo's own module; the leaderboard has only this file and its own task.py" if top in own or
               module.startswith(".") else "not stdlib, torch, triton, aiter or task")
        details.append(f"line {line}: `{stmt}`: {why}")
    return GateResult("imports", False, "unguarded import(s): put each inside `try: ... except ImportError:` with a "
                      "fallback, or remove it", details)


def check_runs_alone(path: Path, timeout: float = RUNS_ALONE_TIMEOUT_S) -> GateResult:
    with tempfile.TemporaryDirectory(prefix="presubmit-") as tmp:
        shutil.copyfile(path, Path(tmp, "submission.py"))
        shutil.copyfile(REPO / "task.py", Path(tmp, "task.py"))
        # -I ignores PYTHON* variables (removed too, for the processes the file may start), the user site and the
        # script's folder; the driver then blocks this repo's module names (which the editable install of this
        # repo would otherwise supply).
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "MLA_"))}
        env["MLA_BACKEND"] = "torch"
        cmd = [sys.executable, "-I", str(DRIVER), tmp, ",".join(sorted(repo_module_names()))]
        try:
            proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return GateResult("runs-alone", False, f"custom_kernel did not finish in {timeout:.0f} s on the CPU "
                              "torch backend: make the import and the MLA_BACKEND=torch path finish")
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    if proc.returncode != 0:
        return GateResult("runs-alone", False, "the file alone (beside task.py, MLA_BACKEND=torch, CPU) fails: make "
                          "it import and run without this repo", lines[-15:])
    return GateResult("runs-alone", True, lines[-1] if lines else "ran")


def check_kernelguard(text: str) -> GateResult:
    if importlib.util.find_spec("kernelguard") is None:
        return GateResult("kernelguard", False, f"kernelguard is not importable: pip install "
                          f"kernelguard=={KERNELGUARD_VERSION}")
    version = importlib.metadata.version("kernelguard")
    if version != KERNELGUARD_VERSION:
        return GateResult("kernelguard", False, f"kernelguard {version} is installed, the leaderboard runs "
                          f"{KERNELGUARD_VERSION}: pip install kernelguard=={KERNELGUARD_VERSION}")
    ok, details = True, []
    for profile in KERNELGUARD_PROFILES:
        proc = subprocess.run([sys.executable, "-m", "kernelguard", "--profile", profile, "--api-mode"], input=text,
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            ok = False
            details.append(f"{profile}: kernelguard exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
            continue
        try:
            verdict = json.loads(proc.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            ok = False
            details.append(f"{profile}: kernelguard printed no JSON verdict: {proc.stdout.strip()[-500:]!r}")
            continue
        flagged = verdict["should_filter"]
        ok = ok and not flagged
        patterns = [f"{p['pattern']} ({p.get('severity')}: {p.get('evidence')})" for p in verdict["matched_patterns"]]
        details.append(f"{profile}: {verdict['classification']}, should_filter={flagged}"
                       + (f", reason {verdict['filter_reason']}" if flagged else "")
                       + f"; patterns: {', '.join(patterns) or 'none'}")
    summary = (f"kernelguard {version} accepts the file" if ok else
               "kernelguard would filter the file: remove the code behind the patterns listed")
    return GateResult("kernelguard", ok, summary, details)


def run_checks(path: str | Path, gates: tuple[str, ...] = GATES) -> list[GateResult]:
    """The results of the chosen gates, in GATES order, on the file at `path`."""
    path = Path(path)
    raw = path.read_bytes()
    utf8, text = check_utf8(raw)
    results = {"utf8": utf8, "size": check_size(raw)}
    text_checks = {"no-stream": check_no_stream, "popcorn": check_popcorn, "imports": check_imports,
                   "runs-alone": lambda _: check_runs_alone(path), "kernelguard": check_kernelguard}
    for name, check in text_checks.items():
        if name in gates:
            results[name] = check(text) if text is not None else GateResult(name, None, "skipped: not UTF-8")
    return [results[name] for name in GATES if name in gates]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", default="submission.py", help="the file to upload (default submission.py)")
    parser.add_argument("--gate", action="append", choices=GATES, help="run only this gate (repeatable)")
    args = parser.parse_args(argv)
    if not Path(args.path).is_file():
        parser.error(f"path: {args.path} is not a file")
    results = run_checks(args.path, tuple(args.gate or GATES))
    for result in results:
        print(result.render(), flush=True)
    failed = [r.name for r in results if r.ok is not True]
    print(f"presubmit {args.path}: " + (f"FAILED ({', '.join(failed)})" if failed else "all gates passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
