"""FlashMLA's own dense decode test, unmodified, against mla_decode.flash_mla.

The test is tests/test_flash_mla_decoding.py of vllm-project/FlashMLA at 46d64a8ebef03fa50b4ae74937276a5c940e3f95
(the commit vLLM pins; that commit has no tests/test_flash_mla.py), with lib.py and quant.py, which it imports, beside
it. It is fetched, never committed: .peers/flashmla-test/ holds the three files. This script writes a stand-in
`flash_mla` package to a temporary directory (get_mla_metadata, flash_mla_with_kvcache and
flash_mla_with_kvcache_fp8 of mla_decode.flash_mla under FlashMLA's names; any other name raises), puts it first on
sys.path, imports the test file and runs its main() as `python tests/test_flash_mla_decoding.py` would (bf16, cuda:0,
its own case list, reference and tolerances, triton.testing.do_bench for the performance cases). FlashMLA's compiled
ops are not needed: the test reaches FlashMLA only through `import flash_mla`.

Each case goes through a wrapper of the file's test_flash_mla: the sparse cases (topk set: not served) are counted
and skipped, the others run and are counted as passed or failed (a failure does not stop the run; --stop-on-fail
does). The exit status is 1 when a case failed.

    python3 bench/flashmla_test.py .peers/flashmla-test/test_flash_mla_decoding.py                 # a GPU: all
    python3 bench/flashmla_test.py PATH --only correctness,corner --json $OUT/flashmla.json        # a part
    python3 bench/flashmla_test.py PATH --only performance --fp8-precision fast
    python3 bench/flashmla_test.py PATH --cpu-smoke      # the CPU: a few small cases, the torch backend

--only picks the kinds of case (correctness: main's grid; corner: zero lengths; performance: the timed ones),
--caches the dense cases' caches (bf16, fp8),
--shard K/N every N-th of the selected cases from the K-th (1-based), --backend and --fp8-precision are passed to
mla_decode.flash_mla's functions. The face's plans are dropped after each case (its cache would otherwise keep up
to 64 plans' workspaces of the large cases); --keep-plans keeps them.
"""

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST_NAMES = ("test_flash_mla_decoding.py", "test_flash_mla.py")  # the pinned commit's name, the older one's
KINDS = ("correctness", "corner", "performance")
CACHES = ("bf16", "fp8")  # the dense cases' caches (TestParam.is_fp8)

STANDIN = '''"""Stand-in for FlashMLA's package, written by mla_decode's bench/flashmla_test.py: mla_decode.flash_mla's
functions under FlashMLA's names, so that FlashMLA's test calls them and nothing of FlashMLA's own."""

import functools

from mla_decode import flash_mla as _face

__version__ = "mla_decode stand-in"
get_mla_metadata = _face.get_mla_metadata
flash_mla_with_kvcache = functools.partial(_face.flash_mla_with_kvcache, **{bf16!r})
flash_mla_with_kvcache_fp8 = functools.partial(_face.flash_mla_with_kvcache_fp8, **{fp8!r})


def __getattr__(name):
    raise AttributeError(f"flash_mla.{{name}}: the stand-in of bench/flashmla_test.py serves get_mla_metadata, "
                         "flash_mla_with_kvcache and flash_mla_with_kvcache_fp8 only (mla_decode.flash_mla)")
'''


def write_standin(directory: Path, backend: str = "auto", fp8_precision: str | None = None) -> Path:
    """directory/flash_mla/__init__.py, the stand-in package; returns the package's directory."""
    package = directory / "flash_mla"
    package.mkdir(parents=True, exist_ok=True)
    bf16 = {"backend": backend}
    fp8 = {"backend": backend, **({"precision": fp8_precision} if fp8_precision else {})}
    (package / "__init__.py").write_text(STANDIN.format(bf16=bf16, fp8=fp8))
    return package


def resolve_test_file(path: str) -> Path:
    """The test file: `path` itself, or the first of TEST_NAMES in the directory `path`."""
    p = Path(path)
    if p.is_dir():
        found = [p / name for name in TEST_NAMES if (p / name).is_file()]
        if not found:
            raise SystemExit(f"flashmla_test.py: no {' or '.join(TEST_NAMES)} in {p}")
        p = found[0]
    if not p.is_file():
        raise SystemExit(f"flashmla_test.py: no test file at {p}")
    return p.resolve()


def import_test(test_file: Path, standin_root: Path):
    """The test file imported as a module, with the stand-in first on sys.path, then the test's directory (its lib.py
    and quant.py) and the repository (mla_decode). Refuses to go on if `flash_mla` resolves elsewhere."""
    for entry in (str(ROOT), str(test_file.parent), str(standin_root)):
        if entry in sys.path:
            sys.path.remove(entry)
        sys.path.insert(0, entry)
    for name in [m for m in sys.modules if m == "flash_mla" or m.startswith("flash_mla.")]:
        del sys.modules[name]  # a FlashMLA imported earlier in this process must not answer for the stand-in
    import flash_mla

    origin = Path(flash_mla.__file__).resolve()
    if origin.parent.parent != standin_root.resolve():
        raise SystemExit(f"flashmla_test.py: `import flash_mla` found {origin}, not the stand-in")
    spec = importlib.util.spec_from_file_location("flashmla_decoding_test", test_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    missing = [name for name in ("TestParam", "test_flash_mla", "main") if not hasattr(module, name)]
    if missing:
        raise SystemExit(f"flashmla_test.py: {test_file} has no {missing}: not the dense decode test this runs")
    return module


def kind_of(t) -> str:
    if t.test_performance:
        return "performance"
    if getattr(t, "have_zero_seqlen_k", False) or getattr(t, "is_all_indices_invalid", False):
        return "corner"
    return "correctness"


class Runner:
    """Wraps the test file's test_flash_mla: skips what is not served or not selected, runs the rest, records each."""

    def __init__(self, module, kinds=KINDS, shard=(1, 1), stop_on_fail: bool = False, keep_plans: bool = False,
                 json_path: str | None = None, caches=CACHES):
        self.original, self.kinds, self.shard, self.caches = module.test_flash_mla, set(kinds), shard, set(caches)
        self.stop_on_fail, self.keep_plans, self.json_path = stop_on_fail, keep_plans, json_path
        self.extra: dict = {}  # what the summary says besides the cases (main fills it)
        self.selected = 0  # dense cases of the selected kinds seen so far, for the shard
        self.results: list[dict] = []
        self.skipped = {"sparse": 0, "not selected": 0}

    def __call__(self, t) -> None:
        if getattr(t, "topk", None) is not None:
            self.skipped["sparse"] += 1
            return
        kind = kind_of(t)
        if kind not in self.kinds or CACHES[bool(t.is_fp8)] not in self.caches:
            self.skipped["not selected"] += 1
            return
        self.selected += 1
        k, n = self.shard
        if (self.selected - k) % n:
            self.skipped["not selected"] += 1
            return
        record = {"case": repr(t), "kind": kind}
        start = time.perf_counter()
        try:
            self.original(t)
            record["result"] = "passed"
        except Exception as e:  # an assertion of the test's, or an error of ours: recorded, the run goes on
            record["result"] = "failed"
            record["error"] = "".join(traceback.format_exception_only(type(e), e)).strip()
            traceback.print_exc()
            if self.stop_on_fail:
                raise
        finally:
            record["seconds"] = round(time.perf_counter() - start, 3)
            self.results.append(record)
            if not self.keep_plans:
                from mla_decode import flash_mla as face
                face._PLANS.clear()
        print(f"[flashmla_test] {record['result']}: {record['case']} ({record['seconds']} s)", flush=True)
        self.write()  # after every case: a run cut short by its time limit still leaves what it did

    def summary(self) -> dict:
        failed = [r for r in self.results if r["result"] == "failed"]
        return {"passed": len(self.results) - len(failed), "failed": len(failed), "skipped": self.skipped,
                **self.extra, "failures": failed, "cases": self.results}

    def write(self) -> None:
        if self.json_path:
            os.makedirs(os.path.dirname(os.path.abspath(self.json_path)), exist_ok=True)
            Path(self.json_path).write_text(json.dumps(self.summary(), indent=1))


def smoke_cases(module) -> list:
    """Small dense cases of the file's own TestParam for the CPU: BF16 and FP8, s_q 1 and 2, causal, varlen, zero
    lengths."""
    p = module.TestParam
    return [
        p(2, 1, 20, is_varlen=False, is_causal=False, is_fp8=False, test_performance=False, h_q=16),
        p(3, 2, 140, is_varlen=True, is_causal=True, is_fp8=False, test_performance=False, h_q=16),
        p(2, 2, 140, is_varlen=True, is_causal=True, is_fp8=True, test_performance=False, h_q=16),
        p(8, 2, 140, is_varlen=True, is_causal=True, is_fp8=True, test_performance=False, h_q=16,
          have_zero_seqlen_k=True),
        p(4, 2, 140, is_varlen=True, is_causal=False, is_fp8=False, test_performance=False, h_q=16,
          have_zero_seqlen_k=True, seed=1),  # every length 0 (this seed): a block_table of no pages
        p(2, 1, 20, is_varlen=False, is_causal=False, is_fp8=True, topk=16, test_performance=False),  # sparse: skipped
    ]


def cpu_smoke(module, runner: Runner) -> None:
    """The file's test_flash_mla on smoke_cases, on the CPU: torch.cuda.synchronize and Tensor.cuda made no-ops for
    the duration (the test calls them; there is no GPU), the default dtype bf16 as main() sets it."""
    import torch

    saved = (torch.cuda.synchronize, torch.Tensor.cuda, torch.get_default_dtype())
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.set_default_dtype(torch.bfloat16)
    try:
        for t in smoke_cases(module):
            runner(t)
    finally:
        torch.cuda.synchronize, torch.Tensor.cuda = saved[:2]
        torch.set_default_dtype(saved[2])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("test", help="the test file, or the directory holding it (with lib.py and quant.py)")
    parser.add_argument("--only", default=",".join(KINDS), help=f"kinds of case, of {KINDS} (default: all)")
    parser.add_argument("--caches", default=",".join(CACHES), help=f"the dense cases' caches, of {CACHES} (default: "
                        "both)")
    parser.add_argument("--shard", default="1/1", help="K/N: every N-th selected case from the K-th (default 1/1)")
    parser.add_argument("--backend", default="auto", help="mla_decode's backend (default auto)")
    parser.add_argument("--fp8-precision", choices=("precise", "fast"), default=None,
                        help="flash_mla_with_kvcache_fp8's precision (default: its own, precise)")
    parser.add_argument("--stop-on-fail", action="store_true", help="stop at the first failed case")
    parser.add_argument("--keep-plans", action="store_true", help="keep the face's plans between cases")
    parser.add_argument("--cpu-smoke", action="store_true", help="a few small cases on the CPU instead of main()")
    parser.add_argument("--json", help="write the summary here")
    args = parser.parse_args(argv)
    kinds = [k.strip() for k in args.only.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"--only: {unknown} not among {KINDS}")
    caches = [c.strip() for c in args.caches.split(",") if c.strip()]
    if not caches or set(caches) - set(CACHES):
        parser.error(f"--caches: expected some of {CACHES}, got {args.caches!r}")
    try:
        k, n = (int(x) for x in args.shard.split("/"))
        assert 1 <= k <= n
    except (ValueError, AssertionError):
        parser.error(f"--shard: expected K/N with 1 <= K <= N, got {args.shard!r}")

    test_file = resolve_test_file(args.test)
    with tempfile.TemporaryDirectory(prefix="flashmla-standin-") as tmp:
        write_standin(Path(tmp), args.backend, args.fp8_precision)
        module = import_test(test_file, Path(tmp))
        runner = Runner(module, kinds, (k, n), args.stop_on_fail, args.keep_plans, args.json, caches)
        module.test_flash_mla = runner  # main() looks it up in the module at each case
        import torch

        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        runner.extra = {"test": str(test_file), "device": device, "torch": torch.__version__, "backend": args.backend,
                        "fp8_precision": args.fp8_precision or "precise", "only": kinds, "caches": caches,
                        "shard": args.shard}
        print(f"[flashmla_test] {test_file}; stand-in {tmp}/flash_mla; torch {torch.__version__}; {device}",
              flush=True)
        start = time.perf_counter()
        if args.cpu_smoke:
            cpu_smoke(module, runner)
        else:
            module.main(torch.bfloat16)  # what `python test_flash_mla_decoding.py` (--dtype bf16) runs
        runner.extra["seconds"] = round(time.perf_counter() - start, 1)
        runner.write()
        summary = runner.summary()
    print(f"[flashmla_test] passed {summary['passed']}, failed {summary['failed']}, skipped {summary['skipped']} "
          f"in {summary['seconds']} s", flush=True)
    for failure in summary["failures"]:
        print(f"[flashmla_test] FAILED {failure['case']}: {failure['error']}")
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
