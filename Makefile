# The commands of the README: `make eval`, `make test` and `make presubmit [FILE=path]`. Each installs what it needs
# first.
PYTHON ?= python3
FILE ?= submission.py

.PHONY: setup eval test presubmit

# torch is installed only where none is importable (a GPU build already there is never replaced); on the CPU
# machines this project is developed on, `torch==2.13.0` resolves to a local CPU wheel.
setup:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[test]"

eval: setup
	$(PYTHON) eval.py

test: setup
	$(PYTHON) -m ruff check .
	$(PYTHON) tools/presubmit.py submission.py
	$(PYTHON) -m pytest

# The checks of tools/presubmit.py on the file the leaderboard would receive.
presubmit: setup
	$(PYTHON) tools/presubmit.py $(FILE)
