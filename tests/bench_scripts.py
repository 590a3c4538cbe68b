"""The bench/ scripts as modules, for tests that use their measurements' definitions (the calls, the batches, the
emulation each kernel is held to): bench/ is not a package, and its scripts put the repo on sys.path themselves."""

import importlib.util
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load_bench_script(name: str) -> ModuleType:
    """bench/<name>.py, imported once per call under the module name <name>_script."""
    spec = importlib.util.spec_from_file_location(f"{name}_script", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
