# The commands of the README: `make eval`, `make test` and `make presubmit [FILE=path]`. Each installs what it needs
# first.
PYTHON ?= python3
FILE ?= submission.py

# torch is installed only where none is importable: a GPU build already there is never replaced. On a machine with
# neither nvidia-smi nor rocminfo (no GPU driver) it comes from PyTorch's CPU index, which spares the multi-GB CUDA
# libraries of the default Linux wheel; elsewhere from the default index. `make test TORCH_INDEX=` uses the
# default index everywhere; TORCH_SPEC picks another version.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?= $(if $(shell command -v nvidia-smi || command -v rocminfo),,https://download.pytorch.org/whl/cpu)

# The AMD compile check compiles with the MI355X runner's Triton too, installed beside the project's (pip --target).
AMD_TRITON ?= 3.6.0
AMD_TRITON_DIR ?= .amd-triton/$(AMD_TRITON)

.PHONY: torch eval test test-quick test-deps presubmit amd-check amd-check-run bundle bundle-check first-screen

torch:
	$(PYTHON) -c "import torch" 2>/dev/null || \
		$(PYTHON) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"

# eval needs the runtime dependencies only (torch, numpy, pyyaml); test adds pytest (and pytest-xdist), ruff, triton
# and kernelguard.
eval: torch
	$(PYTHON) -m pip install -q -e .
	$(PYTHON) eval.py

test-deps: torch
	$(PYTHON) -m pip install -q -e ".[test]"

# The CPU tests in TEST_WORKERS processes (pytest-xdist; auto: one a core).
TEST_WORKERS ?= auto

test: test-deps amd-check-run bundle-check
	$(PYTHON) -m ruff check .
	$(PYTHON) tools/presubmit.py submission.py
	$(PYTHON) -m pytest -n $(TEST_WORKERS)

# The inner loop: ruff, the bundle's freshness and the library's own tests (no AMD compile, no leaderboard gates).
test-quick: test-deps bundle-check
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest tests/test_library.py

# The README's first screen in a fresh virtual environment of the runtime dependencies alone (no Triton, no test
# extras): `pip install -e .`, then `python -m mla_decode`, which must import, judge the backends and pass its check.
FIRST_SCREEN_VENV ?= .venv-first-screen
first-screen:
	rm -rf $(FIRST_SCREEN_VENV)
	$(PYTHON) -m venv $(FIRST_SCREEN_VENV)
	$(MAKE) torch PYTHON=$(FIRST_SCREEN_VENV)/bin/python
	$(FIRST_SCREEN_VENV)/bin/python -m pip install -q -e .
	$(FIRST_SCREEN_VENV)/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('triton') is not None)" \
		|| (echo "first-screen: triton is installed; this check is for a venv without it" && false)
	$(FIRST_SCREEN_VENV)/bin/python -m mla_decode

# submission.py is generated from the package's portable modules (tools/bundle.py); CI fails when it is stale.
bundle:
	$(PYTHON) tools/bundle.py

bundle-check:
	$(PYTHON) tools/bundle.py --check

# The checks of tools/presubmit.py on the file the leaderboard would receive.
presubmit: test-deps
	$(PYTHON) tools/presubmit.py $(FILE)

# Every Triton kernel of submission.py compiled for gfx950 (MI355X) and gfx942 (MI300X) on this CPU through its own
# launch path, with the runner's Triton and the tests' (tools/amd_check.py says what it checks).
amd-check: amd-check-run

amd-check-run: test-deps
	test -d $(AMD_TRITON_DIR)/triton || $(PYTHON) -m pip install -q --no-deps --target $(AMD_TRITON_DIR) \
		triton==$(AMD_TRITON)
	$(PYTHON) tools/amd_check.py --triton $(AMD_TRITON_DIR) --triton env
