# The two commands of the README: `make eval` and `make test`. Each installs what it needs first.
PYTHON ?= python3

.PHONY: setup eval test

# torch is installed only where none is importable (a GPU build already there is never replaced); on the CPU
# machines this project is developed on, `torch==2.13.0` resolves to a local CPU wheel.
setup:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[test]"

eval: setup
	$(PYTHON) eval.py

test: setup
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest
