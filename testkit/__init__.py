"""What the tests and the benchmarks share to check the kernels: paged inputs with every unowned slot poisoned and
their float64 truth (paged), the emulations of what each fast kernel rounds (emulation), the hostile and the grid
inputs (inputs), and the comparison helpers (compare). Nothing in mla_decode or submission.py imports it."""
