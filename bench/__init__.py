"""The benchmark scripts: run each from the repo root as `python3 bench/<script>.py`; tests import them by name."""
